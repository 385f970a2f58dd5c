// Package housekeeping keeps the outbox file in shape beside the relay:
// the backlog gauges, retention of done rows and of the consumers' dedup
// ledger, and WAL checkpoints. It relays nothing; the relay's commit watch
// only tells it when commits happen. A Keeper runs one loop per concern
// until its context ends; each pass is also callable on its own.
package housekeeping

import (
	"context"
	"errors"
	"maps"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/episode"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Store is the SQLite side (OnFile's).
type Store interface {
	Backlog(ctx context.Context) (event.Backlog, error)
	Prune(ctx context.Context, table string, before time.Time, pause time.Duration, sw Sweep) (Swept, error)
	// Span is the outbox's highest rowid less its lowest (0: empty).
	Span(ctx context.Context) (int64, error)
	Checkpoint(ctx context.Context) (walPages, checkpointed int, err error)
}

// OnFile returns the Store of the database file db; parks says whether
// dead letters park their ordering keys there (see Backlog).
func OnFile(db *sqlitedb.DB, parks bool) Store { return file{db, parks} }

// file is a database file's Store: its checkpoints are sqlitedb's.
type file struct {
	*sqlitedb.DB
	parks bool
}

func (f file) Backlog(ctx context.Context) (event.Backlog, error) { return Backlog(ctx, f.DB, f.parks) }

func (f file) Prune(ctx context.Context, table string, before time.Time, pause time.Duration, sw Sweep) (Swept, error) {
	return Prune(ctx, f.DB, table, before, pause, sw)
}

func (f file) Span(ctx context.Context) (int64, error) { return Span(ctx, f.DB) }

// Sweeps is where a file's retention stands: when its last pass began,
// where each table's sweep stopped and how far the outbox's next sweep
// beyond its new rows goes (see Retain). A Keeper keeps its own; a fleet
// carries a file's from one Keeper to the next as it closes the file
// while idle and opens it on a commit, so that a file opened every few
// seconds is pruned once a RetentionInterval, not at every open, and its
// sweeps go on from where they stopped rather than reading the table's
// first rows again.
type Sweeps struct {
	Last time.Time
	From map[string]int64 // table -> rowid where its last sweep stopped (the outbox: its first sweep)
	// Beyond is where the outbox's last sweep beyond its new rows stopped,
	// and Rows how many rows the next one goes through (see beyondRows).
	Beyond int64
	Rows   int
	// Round is how many rows the sweeps beyond the new rows went through
	// since they last started at the table's start, and Density how many
	// their last whole round went through for each rowid of the table's
	// span (0: no round yet): rowids far apart make the span no measure
	// of the table's rows.
	Round   int64
	Density float64
}

// Clone returns a copy of s that shares nothing with it.
func (s Sweeps) Clone() Sweeps {
	s.From = maps.Clone(s.From)
	return s
}

// Options say what to keep and how often. A zero interval turns its loop
// off.
type Options struct {
	// StatsInterval refreshes the backlog gauges.
	StatsInterval time.Duration
	// RetentionInterval runs retention: done rows older than RetainDone
	// and ledger rows older than RetainProcessedEvents are deleted (0
	// keeps them).
	RetentionInterval     time.Duration
	RetainDone            time.Duration
	RetainProcessedEvents time.Duration
	// CheckpointInterval is the least time between two WAL checkpoints
	// (see checkpointLoop).
	CheckpointInterval time.Duration
	// Commits announces commits to the file (the relay's commit watch);
	// Watching reports whether it does at the moment. Without them the
	// checkpoints look every checkpointPoll.
	Commits  <-chan struct{}
	Watching func() bool
	// LastClaim says when the relay last claimed rows (zero: never);
	// while it claims none, only its heartbeats write to the file and
	// checkpoints come every checkpointIdleGap. Nil: as if it always did.
	LastClaim func() time.Time
	Metrics   *metrics.Metrics
	// Gauges are the file's shares of the backlog gauges (NewGauges);
	// nil: new ones.
	Gauges *Gauges
	// Sweeps is where the file's retention stands, which the Keeper
	// updates as it prunes: its first pass comes a RetentionInterval
	// after Sweeps.Last. Nil: its own, the first pass at once. The
	// caller reads it once Run and Retain have returned.
	Sweeps *Sweeps
	Log    *zap.Logger
}

// Keeper runs the housekeeping of one outbox.
type Keeper struct {
	store       Store
	o           Options
	log         *zap.Logger
	m           *metrics.Metrics
	readTrouble *episode.Log // the backlog read
	g           *Gauges
}

// Gauges are one file's shares of the backlog gauges, which a fleet's
// files sum (the oldest pending age: the highest), and its tenant's own
// when the metrics carry a tenant label. They outlive a Keeper: a fleet
// closes an idle file and opens it again, and its figures stay counted
// meanwhile.
type Gauges struct {
	pending, processing, dead, parked *metrics.Part
	age                               *metrics.HighPart
	tenant                            *metrics.TenantGauges // nil without the tenant label
	mu                                sync.Mutex            // a fleet's look and the file's keeper may both set them
	last                              event.Backlog         // as last read
}

// NewGauges returns a file's shares of m's backlog gauges, and its
// tenant's gauges when m has them (metrics.Metrics.Tenants).
func NewGauges(m *metrics.Metrics, tenant string) *Gauges {
	backlog := func(s event.Status) *metrics.Part { return metrics.NewPart(m.Backlog.WithLabelValues(string(s))) }
	return &Gauges{pending: backlog(event.StatusPending), processing: backlog(event.StatusProcessing), dead: backlog(event.StatusDeadLettered),
		parked: metrics.NewPart(m.ParkedKeys), age: m.OldestPending.Part(), tenant: m.Tenant(tenant)}
}

// set records a backlog read at age seconds of the oldest due row.
// Show sets the gauges from b, the file's backlog as just read.
func (g *Gauges) Show(b event.Backlog) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.last = b
	g.setLast()
}

// aging sets the gauges from the backlog last read, its oldest pending
// row as old as it is now.
func (g *Gauges) aging() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.setLast()
}

// setLast is aging with g.mu held.
func (g *Gauges) setLast() {
	b, age := g.last, 0.0
	if !b.OldestPending.IsZero() {
		age = max(0, time.Since(b.OldestPending).Seconds())
	}
	g.set(b, age)
}

func (g *Gauges) set(b event.Backlog, age float64) {
	g.pending.Set(float64(b.Pending))
	g.processing.Set(float64(b.Processing))
	g.dead.Set(float64(b.DeadLettered))
	g.age.Set(age)
	g.parked.Set(float64(b.ParkedKeys))
	if g.tenant != nil {
		g.tenant.Set(float64(b.Pending), float64(b.DeadLettered), age)
	}
}

// Forget takes the file out of the gauges: it is no longer served.
func (g *Gauges) Forget() {
	for _, p := range []*metrics.Part{g.pending, g.processing, g.dead, g.parked} {
		p.Set(0)
	}
	g.age.Drop()
	if g.tenant != nil {
		g.tenant.Delete()
	}
}

// New returns a Keeper; Run starts it.
func New(store Store, o Options) *Keeper {
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	if o.Metrics == nil {
		o.Metrics = metrics.New("", "")
	}
	if o.Watching == nil {
		o.Watching = func() bool { return o.Commits != nil }
	}
	if o.Gauges == nil {
		o.Gauges = NewGauges(o.Metrics, "")
	}
	if o.Sweeps == nil {
		o.Sweeps = &Sweeps{}
	}
	if o.Sweeps.From == nil {
		o.Sweeps.From = map[string]int64{}
	}
	return &Keeper{store: store, o: o, log: o.Log, m: o.Metrics, g: o.Gauges,
		readTrouble: episode.New(o.Log, zap.ErrorLevel, "cannot read the outbox", "outbox readable again")}
}

// Run runs the loops whose interval is set until ctx ends.
func (k *Keeper) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, loop := range []struct {
		every time.Duration
		run   func(context.Context)
	}{{k.o.StatsInterval, k.statsLoop}, {k.o.RetentionInterval, k.retentionLoop}, {k.o.CheckpointInterval, k.checkpointLoop}} {
		if loop.every > 0 {
			wg.Add(1)
			go func() { defer wg.Done(); loop.run(ctx) }()
		}
	}
	wg.Wait()
}

// retentionPause separates pruning deletes so the application's writers
// get the lock between them.
const retentionPause = 20 * time.Millisecond

// statsLoop refreshes the backlog gauges from a cheap indexed query, so a
// scrape never scans the table. A failing read is logged at error level
// once, and its end once.
func (k *Keeper) statsLoop(ctx context.Context) {
	every(ctx, k.o.StatsInterval, func() {
		if err := k.RefreshBacklog(ctx); err == nil {
			k.readTrouble.OK()
		} else if ctx.Err() == nil {
			k.readTrouble.Fail(err)
		}
	})
}

// RefreshBacklog sets the backlog gauges from the table. While the table
// cannot be read, the oldest pending row last read keeps aging in
// oldest_pending_age_seconds, so that an alert on it fires; the counts
// stay as last read.
func (k *Keeper) RefreshBacklog(ctx context.Context) error {
	b, err := k.store.Backlog(ctx)
	if err != nil {
		k.g.aging()
		return err
	}
	k.g.Show(b)
	return nil
}

// retentionLoop runs Retain every RetentionInterval, the first time a
// RetentionInterval after the last pass (at once if none was made).
func (k *Keeper) retentionLoop(ctx context.Context) {
	t := time.NewTimer(time.Until(k.o.Sweeps.Last.Add(k.o.RetentionInterval)))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return
	case <-t.C:
	}
	every(ctx, k.o.RetentionInterval, func() { k.Retain(ctx) })
}

// Retain deletes done rows, their records and ledger rows past their retention, logging
// and counting what it deleted.
func (k *Keeper) Retain(ctx context.Context) {
	gap := k.o.RetentionInterval // since the last pass
	if last := k.o.Sweeps.Last; !last.IsZero() {
		gap = max(gap, time.Since(last))
	}
	k.o.Sweeps.Last = time.Now()
	for _, p := range []struct {
		table string
		keep  time.Duration
	}{{event.PruneOutbox, k.o.RetainDone}, {event.PruneDoneRecords, k.o.RetainDone}, {event.PruneProcessedEvents, k.o.RetainProcessedEvents}} {
		if p.keep <= 0 {
			continue // 0 keeps rows forever
		}
		n, err := k.prune(ctx, p.table, p.keep, gap)
		if n > 0 {
			k.m.PrunedRows.WithLabelValues(p.table).Add(float64(n))
			k.log.Info("pruned rows past retention", zap.String("table", p.table), zap.Int64("rows", n), zap.Duration("retention", p.keep))
		}
		if err != nil && ctx.Err() == nil {
			k.log.Warn("prune rows", zap.String("table", p.table), zap.Error(err))
		}
	}
}

// pruneBeyond is the least number of rows the outbox's sweep beyond its
// new rows goes through in a pass.
const pruneBeyond = 1000

// prune sweeps table for rows finished longer than keep ago, on from where its
// last sweep stopped, gap after the last pass. The outbox has two sweeps a pass. The first runs
// from the table's start to the first row written after the cutoff, where
// all old rows are while SQLite numbers the rows: it reads what it
// deletes, not the rows kept. The second goes on through the rest from
// where the last pass left it, for the rows an application wrote with ids
// of its own and old rows inserted late (see beyondRows).
func (k *Keeper) prune(ctx context.Context, table string, keep, gap time.Duration) (int64, error) {
	sw, before := k.o.Sweeps, time.Now().Add(-keep)
	first, err := k.store.Prune(ctx, table, before, retentionPause, Sweep{From: sw.From[table], Rows: pruneBudget, New: table == event.PruneOutbox})
	sw.From[table] = first.Next
	if table != event.PruneOutbox || ctx.Err() != nil {
		return first.Deleted, err
	}
	span, serr := k.store.Span(ctx) // 0 where it cannot be read: the least
	rows := k.beyondRows(span, keep, gap)
	beyond, berr := k.store.Prune(ctx, table, before, retentionPause, Sweep{From: sw.Beyond, Rows: rows})
	sw.Beyond = beyond.Next
	sw.Round += beyond.Read
	switch {
	case beyond.Deleted > 0:
		sw.Rows = min(2*rows, pruneBudget)
	case berr == nil:
		sw.Rows = rows / 2
	}
	if berr == nil && serr == nil && beyond.Next == 0 {
		sw.Density, sw.Round = min(float64(sw.Round)/float64(max(span, 1)), 1), 0
	}
	return first.Deleted + beyond.Deleted, errors.Join(err, serr, berr)
}

// beyondRows is how many rows the outbox's sweep beyond its new rows goes
// through this pass, on a table whose rowids span span, keeping rows for
// keep, gap after the last pass: as many as the last pass said
// (Sweeps.Rows, which doubles while the sweep finds rows to delete, and
// halves while it finds none), but at least pruneBeyond and enough to go
// through the table in half of keep at a pass every gap, and at most
// pruneBudget. The table holds span rows at most; once a round of the
// sweep went through it, as many as its density of rows says, or as the
// round under way found, if more. On a table SQLite numbers, where it
// finds none, it thus reads twice the rows written meanwhile.
func (k *Keeper) beyondRows(span int64, keep, gap time.Duration) int {
	sw, size := k.o.Sweeps, float64(span)
	if sw.Density > 0 {
		size = min(size, max(size*sw.Density, float64(sw.Round)))
	}
	passes := float64(keep/2) / float64(max(gap, time.Minute))
	least := max(pruneBeyond, int(min(size/max(passes, 1), pruneBudget)))
	return min(max(sw.Rows, least), pruneBudget)
}

// checkpointLoop copies the WAL into the database beside the relay's
// reads and settles, so that their commits do not pay for it. Checkpoints
// are PASSIVE: they never wait for or block the application. They follow
// commits, at most one every CheckpointInterval while they find many pages
// (see checkpointGap): small checkpoints then leave the application's own
// automatic checkpoints (run inside its commits) little to copy, and its
// commits stall less (docs/performance.md). While the relay claims no
// rows, they come every checkpointIdleGap, or at its next claim: its
// heartbeats alone, a page a second, are not worth two fsyncs a second.
// Without commits, nothing runs but a look every checkpointIdle, in case
// the watch missed one; without a watch, a look every checkpointPoll. The
// first comes checkpointFirst after the start.
func (k *Keeper) checkpointLoop(ctx context.Context) {
	if !k.rest(ctx, checkpointFirst, false, time.Now()) {
		return
	}
	look := time.NewTimer(checkpointIdle)
	defer look.Stop()
	gap := k.o.CheckpointInterval
	copied := 0        // the WAL's pages in the database after the last checkpoint
	var last time.Time // when the last checkpoint began
	for {
		if k.o.Watching() {
			look.Reset(checkpointIdle)
		} else {
			look.Reset(checkpointPoll)
		}
		select {
		case <-ctx.Done():
			return
		case <-k.o.Commits:
		case <-look.C:
		}
		start := time.Now()
		idle := !last.IsZero() && !k.claimedSince(last)
		walPages, done, err := k.store.Checkpoint(ctx)
		if err != nil && ctx.Err() == nil {
			k.log.Debug("checkpoint", zap.Error(err))
		}
		gap = checkpointGap(gap, newPages(walPages, copied), k.o.CheckpointInterval)
		copied, last = done, start
		// Busy a third of the time at most: large checkpoints (a drain, a
		// slow disk) come less often.
		wait := max(gap, 2*time.Since(start))
		if idle {
			wait = max(wait, checkpointIdleGap)
		}
		if !k.rest(ctx, wait, idle, start) {
			return
		}
	}
}

// claimedSince reports whether the relay has claimed rows since t.
func (k *Keeper) claimedSince(t time.Time) bool {
	return k.o.LastClaim == nil || !k.o.LastClaim().Before(t)
}

// rest waits d after the checkpoint begun at start, or while idle until
// a commit finds that the relay has claimed rows since; false when ctx
// ends.
func (k *Keeper) rest(ctx context.Context, d time.Duration, idle bool, start time.Time) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	var commits <-chan struct{}
	if idle {
		commits = k.o.Commits
	}
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		case <-commits:
			if k.claimedSince(start) {
				return true
			}
		}
	}
}

// newPages returns how many of a WAL's walPages pages were written since
// a checkpoint left copied of them in the database: all of them when the
// WAL has started again from its beginning since. The WAL's size alone
// says nothing of the work: while a reader is often in it (the relay's
// own claims, at a trickle) the WAL seldom starts again and stays
// hundreds of pages long, and checkpoints judged by it ran every few
// milliseconds to copy a commit or two each.
func newPages(walPages, copied int) int {
	if walPages < copied {
		return walPages
	}
	return walPages - copied
}

// checkpointGap returns the wait after a checkpoint that found fresh
// pages written to the WAL since the one before, given the previous wait:
// it doubles, up to checkpointMaxGap, while checkpoints find less than
// checkpointSmall new pages (a trickle, where every checkpoint's two
// fsyncs cost more than the copy), and halves back to least once they
// find more (a drain, where small, frequent checkpoints keep the
// application's commits short).
func checkpointGap(gap time.Duration, fresh int, least time.Duration) time.Duration {
	if fresh < checkpointSmall {
		return max(least, min(2*gap, checkpointMaxGap))
	}
	return max(least, gap/2)
}

// A checkpoint of fewer than checkpointSmall pages (400 KiB of 4 KiB
// pages) makes the next one wait longer, up to checkpointMaxGap: well
// below the 1000 pages at which the application's own connections
// checkpoint inside their commits. A relay that claims no rows
// checkpoints every checkpointIdleGap.
const (
	checkpointSmall   = 100
	checkpointMaxGap  = time.Second
	checkpointIdleGap = 10 * time.Second
)

// checkpointFirst is how long a relay's first checkpoint waits after its
// start: the start's own commits (the heartbeat, the stream position, the
// first settles) then share it, and a fleet's files woken together by
// their applications' commits publish their first rows before any of them
// syncs (each checkpoint fsyncs the WAL and the database, and the first
// the directory too).
const checkpointFirst = time.Second

// How often checkpointLoop looks without a commit: while the commit watch
// runs, and while none does (it could not start, or stopped).
const (
	checkpointIdle = time.Second
	checkpointPoll = 200 * time.Millisecond
)

// every runs fn at once and then every d until ctx ends.
func every(ctx context.Context, d time.Duration, fn func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	fn()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		fn()
	}
}
