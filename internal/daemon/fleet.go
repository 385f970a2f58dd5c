package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/claim"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/natsname"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Fleet timings and bounds.
const (
	// fleetTick is how often the fleet looks at its files: which to close
	// as idle, which to open as due.
	fleetTick = 250 * time.Millisecond
	// fleetRescan is how often the pattern is matched again when no
	// file-system notification said the directory changed.
	fleetRescan = 5 * time.Second
	// fleetScanSoon is how soon the pattern is matched again once a
	// notification (a file created, moved in or removed, a commit to a
	// name the fleet does not know) asks for it, and fleetScanGap how
	// often at most: a burst of files created costs ten scans a second.
	fleetScanSoon = 10 * time.Millisecond
	fleetScanGap  = 100 * time.Millisecond
	// fleetRewatchFor is how long the relay tries to watch a directory
	// that replaced the watched one, every fleetRewatchStep: a directory
	// removed and made again (a restore) may be away, or made again once
	// more, as the relay looks.
	fleetRewatchFor  = time.Second
	fleetRewatchStep = 50 * time.Millisecond
	// fleetRetry is how long a file that could not be served waits
	// before it is tried again.
	fleetRetry = 5 * time.Second
	// fleetIdleAfter is how long a file stays open with no commit from
	// another connection and nothing due before it is closed: an idle
	// file costs no connection, goroutine, timer or heartbeat.
	fleetIdleAfter = 10 * time.Second
	// fleetMaxOpen bounds the files open at once; the others wait their
	// turn, in the order they came due. A file waits for the idle time
	// at most: then the file served longest is closed for it (takeTurns).
	fleetMaxOpen = 256
	// fleetMaxLooks bounds the looks at closed files' rows under way at
	// once (each a connection of its own).
	fleetMaxLooks = 16
	// fleetLookLockWait is how long a look waits for a file its
	// application holds locked against readers: a file it cannot read
	// counts as due, and opening it waits for the lock, saying so. A
	// lock held longer that is no hold-up (the recovery of a large WAL)
	// opens the file for nothing: it is closed again as idle.
	fleetLookLockWait = 100 * time.Millisecond
	// fleetLastLookWait bounds lookLast, which reads on the relay's own
	// connections as the file closes. Its query takes well under a
	// millisecond; what it may wait for is a file its application holds
	// locked against readers, which keeps the closing file's slot that
	// much longer. A bound as short as fleetLookLockWait is a margin that
	// a loaded machine can use up, and the look after the close would
	// then open the file for nothing.
	fleetLastLookWait = time.Second
	// fleetStarting bounds the files starting at once (see startTurn),
	// and fleetStartHold how long one start holds its turn at most.
	fleetStarting  = 4
	fleetStartHold = 100 * time.Millisecond
)

// fleetRelooks are the looks again at a closed file, after a look that a
// write made found nothing due, counted from that look: a commit's
// notification can come before the commit can be read (its WAL frames are
// written, then the WAL index says they count; with synchronous=FULL the
// WAL is synced between the two), and a look between the two misses it.
// Nothing else would open the file until its next commit. The first comes
// soon, in the look's own goroutine, so that a missed commit waits
// milliseconds; the others at the fleet's ticks, for slow disks.
var fleetRelooks = []time.Duration{fleetQuickRelook, fleetTick, fleetRescan}

// fleetQuickRelook is the first of fleetRelooks.
const fleetQuickRelook = 10 * time.Millisecond

// Fleet is a relay serving every database file that database.path's
// pattern matches: a tenant's file each. A file with rows to publish, or
// commits, has its own App (its lead, lanes, outage handling, retention,
// checkpoints and reconciliation) on one broker connection and one
// metrics registry; an idle file is closed, and opened again by its next
// commit (a notification on the directory) or when its next row comes
// due. A file that cannot be served affects that file alone, and is tried
// again.
type Fleet struct {
	cfg     config.Config
	log     *zap.Logger
	oo      Options
	metrics *metrics.Metrics
	// fileMetrics are metrics with broker_connected the fleet's to set
	// (see tend), for the files' relays.
	fileMetrics *metrics.Metrics
	embedded    *publish.Embedded
	conn        *publish.Conn
	js          *publish.JetStream // for the consumer's advisories; nil in core mode
	natsURL     string
	slots       chan struct{} // one per file open at once
	looks       chan struct{} // one per look at a closed file's rows under way (nextDue)
	starting    chan struct{} // one per file starting (startTurn)
	// budget is relay.max_in_flight and the payload budget, shared by
	// the files: however many drain at once, they hold no more rows in
	// memory than one file's relay.
	budget *relay.Budget
	// sync is the stream's reconciliation, shared by the files' relays.
	sync *streamSync
	// routes hands the open files' notifications from the fleet's watch
	// to their commit watches, while parks.
	routes *fleet.Routes

	mu    sync.Mutex
	files map[string]*member // by path: the files open, or opening
	// parked are the files closed while idle, by path.
	parked map[string]*parkedFile
	// trouble holds why a file is not served, by path, until it is.
	trouble map[string]*fileTrouble
	// said is the error last logged for a file, by path, until it is
	// served and stops cleanly or goes: a file that fails alike on every
	// try is logged once.
	said map[string]string
	// gauges are each file's shares of the backlog gauges, by path: kept
	// while it is closed, forgotten when it goes.
	gauges map[string]*housekeeping.Gauges
	// sweeps are where each file's retention stands, by path: kept while
	// it is closed, forgotten when it goes.
	sweeps map[string]*housekeeping.Sweeps
	fleetM *metrics.FleetMetrics
	rescan bool // the directory changed: match the pattern again
	// away says why the last match could not read the files' directory
	// (nil: it could): it is missing (removed, moved away), not a
	// directory, or cannot be read. It is looked at every tick until it
	// is back.
	away error
	// soon tells Run that rescan was set (see askScan).
	soon chan struct{}
	// turnsSaid: the log said files are served in turn (takeTurns).
	turnsSaid bool
	// parks: idle files are closed, notifications opening them again.
	parks bool
	wg    sync.WaitGroup // the members' goroutines
}

// member is one file open: its App, once opened, and its goroutine.
type member struct {
	tenant  string
	file    os.FileInfo // as first seen: another file at the path is a replacement
	stop    context.CancelFunc
	done    chan struct{}
	app     *App  // nil while it opens
	locked  error // while it opens: what holds its file locked against the relay
	quiet   bool  // log warnings and errors only (see wake)
	retried bool  // started again at once after it was written to while tried (see fileTrouble)
	leaving bool  // stopped because its file went or was replaced
	// park is set when the fleet closes it as idle, with when to open it
	// again (zero: on its next commit).
	park *parkedFile
	// queued is when it began to wait for a slot among the files open,
	// and slotted when it got one (zero: waiting).
	queued, slotted time.Time
}

// fileTrouble is why a file is not served, and when it is tried again.
type fileTrouble struct {
	err   error
	retry time.Time
	as    fileStamp // the file as it was then: a changed file is tried at once
	// quick: the file was written to while it was tried, so it is tried
	// again at the next scan, once: the write may have mended it after
	// the try looked, and its notification came before the try ended.
	quick bool
}

// fileStamp is what a database file and its -wal file were: their
// identity, size and modification time.
type fileStamp struct{ db, wal os.FileInfo }

func stampOf(path string) fileStamp {
	db, _ := os.Stat(path)
	wal, _ := os.Stat(path + "-wal")
	return fileStamp{db: db, wal: wal}
}

// changed reports whether the file is another, or was written, since s.
func (s fileStamp) changed(now fileStamp) bool {
	differ := func(a, b os.FileInfo) bool {
		if a == nil || b == nil {
			return a != b
		}
		return !os.SameFile(a, b) || a.Size() != b.Size() || !a.ModTime().Equal(b.ModTime())
	}
	return differ(s.db, now.db) || differ(s.wal, now.wal)
}

// leave stops the member for good: its file went or was replaced.
func (m *member) leave() {
	m.leaving, m.park = true, nil
	m.stop()
}

// parkedFile is a file closed while idle.
type parkedFile struct {
	file os.FileInfo
	// fresh: this process has not served it yet (found idle at start).
	fresh bool
	wake  time.Time // zero: on its next commit only
	// probing: a look at its rows is under way (see commitTo); again: it
	// was written to meanwhile, so look once more.
	probing, again bool
	// relook is when to look again after an empty look (zero: not), the
	// relooks-th of fleetRelooks.
	relook  time.Time
	relooks int
	// mark is the file's commit mark as its last look at its rows began
	// (marked: it had one), and found what that look found: while the
	// mark is the same, a look would find that again (see lookOnce).
	mark   sqlitedb.CommitMark
	marked bool
	found  time.Time
	// keep is when its housekeeping is due (see keep); keeping: it is
	// under way.
	keep    time.Time
	keeping bool
}

// OpenFleet connects to the broker (or starts the embedded server) for a
// fleet; Run serves its files.
func OpenFleet(ctx context.Context, cfg config.Config, log *zap.Logger, oo Options) (_ *Fleet, err error) {
	if _, err := fleet.Files(cfg.Database.Path); err != nil {
		return nil, &config.Error{Err: err}
	}
	// The directory by its path, not the working directory's inode: a
	// relative pattern's directory removed and made again (a restore) is
	// the new one, and seen missing in between.
	if cfg.Database.Path, err = filepath.Abs(cfg.Database.Path); err != nil {
		return nil, &config.Error{Err: fmt.Errorf("database.path %q: %w", cfg.Database.Path, err)}
	}
	f := &Fleet{cfg: cfg, log: log, oo: oo, metrics: oo.Metrics, natsURL: cfg.NATS.URL,
		files: map[string]*member{}, parked: map[string]*parkedFile{}, trouble: map[string]*fileTrouble{}, said: map[string]string{}, gauges: map[string]*housekeeping.Gauges{},
		sweeps: map[string]*housekeeping.Sweeps{},
		slots:  make(chan struct{}, fleetMaxOpen), looks: make(chan struct{}, fleetMaxLooks), starting: make(chan struct{}, fleetStarting), soon: make(chan struct{}, 1),
		budget: relay.NewBudget(cfg.Relay.MaxInFlight, maxInFlightBytes), sync: newStreamSync(), routes: fleet.NewRoutes()}
	if oo.Test != nil && oo.Test.MaxOpen > 0 {
		f.slots = make(chan struct{}, oo.Test.MaxOpen)
	}
	if f.metrics == nil {
		f.metrics = newMetrics(oo)
	}
	f.fleetM = f.metrics.ServeFleet(cfg.Metrics.TenantLabel)
	f.fileMetrics = f.metrics.ForFiles()
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if f.embedded, f.natsURL, err = startEmbedded(cfg, filepath.Join(filepath.Dir(cfg.Database.Path), "outbox-relay.nats"), log); err != nil {
		return nil, err
	}
	if f.conn, err = connectBroker(ctx, cfg, f.natsURL, log); err != nil {
		return nil, err
	}
	if cfg.NATS.Mode == config.ModeJetStream {
		if f.js, err = publish.NewJetStream(f.conn, cfg.Stream.Name, 1, cfg.Relay.AckTimeout); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// Run serves /metrics, /healthz and /readyz, and the files the pattern
// matches, taking up new ones and letting go of removed ones, until ctx
// ends; then every file's relay drains and stops.
func (f *Fleet) Run(ctx context.Context) error {
	stop, err := f.serveHTTP()
	if err != nil {
		return err
	}
	defer stop()
	f.log.Info("relay starting for a fleet of database files", zap.String("database", f.cfg.Database.Path),
		zap.String("table", f.cfg.Database.Table), zap.String("nats", natsname.RedactURLs(f.natsURL)),
		zap.String("stream", f.cfg.Stream.Name), zap.String("subjects", f.cfg.Stream.SubjectPrefix+"."+f.cfg.Stream.SubjectTemplate))
	if tmpl, err := natsname.ParseTemplate(f.cfg.Stream.SubjectTemplate); err == nil && !tmpl.ReadApart() && f.cfg.NATS.Mode != config.ModeCore {
		f.log.Warn("the tenants share subjects: a file's reconciliation, each time its relay begins to lead with rows pending (an idle file woken by a commit, a restart), reads every tenant's messages since the file's position; set stream.subject_template to "+natsname.FleetTemplate+", the default for a fleet",
			zap.String("subject_template", f.cfg.Stream.SubjectTemplate))
	}
	defer f.stopAll()
	if f.js != nil && f.cfg.Consumer.Durable != "" {
		// One watch for the fleet: a file's own App does not watch.
		defer beside(ctx, func(ctx context.Context) {
			watchExhausted(ctx, f.conn.NC, f.js.API(), f.cfg, f.onExhausted, f.log)
		})()
	}
	var w *fleet.Watcher
	var written <-chan string
	var changed, missed <-chan struct{}
	use := func(nw *fleet.Watcher) {
		w, written, changed, missed = nw, nil, nil, nil
		if w != nil {
			written, changed, missed = w.Written, w.Changed, w.Missed
		}
	}
	use(fleet.Watch(ctx, f.cfg.Database.Path, f.routes))
	gone, problem := fleet.DirProblem(f.cfg.Database.Path)
	switch {
	case w != nil:
		f.parks = true
	case problem == nil: // else scan says what is wrong with the directory
		f.log.Warn("no file-system notifications for the database directory: every file stays open, and new files are found by looking every " + fleetRescan.String() + ", when the relay also tries to watch it again")
	}
	f.scan(ctx, true, gone, problem)
	tick := time.NewTicker(fleetTick)
	defer tick.Stop()
	lastScan := time.Now()
	var soon <-chan time.Time // a scan asked for
	for {
		select {
		case <-ctx.Done():
			return nil
		case path := <-written:
			f.commitTo(ctx, path)
			continue
		case <-changed:
			f.mu.Lock()
			f.askScan()
			f.mu.Unlock()
			continue
		case <-f.soon:
			if soon == nil {
				soon = time.After(max(fleetScanSoon, fleetScanGap-time.Since(lastScan)))
			}
			continue
		case <-missed:
			f.probeAll(ctx)
			continue
		case <-soon:
			soon = nil
		case <-tick.C:
		}
		f.mu.Lock()
		wasAway := f.away != nil
		rescan := f.rescan || wasAway || time.Since(lastScan) >= f.rescanEvery(fleetRescan)
		f.rescan = false
		f.mu.Unlock()
		if rescan {
			// Looked at before the watch is moved: a directory made
			// again after this look, and so not watched yet, is still
			// away to the scan, and the next tick watches it.
			gone, problem := fleet.DirProblem(f.cfg.Database.Path)
			// A replaced directory's watch is moved before the scan, so
			// that a commit after the scan is notified.
			replaced := w != nil && w.Replaced(f.cfg.Database.Path)
			switch {
			case replaced:
				w.Close()
				use(f.rewatch(ctx))
			case w == nil:
				use(f.watchAgain(ctx))
			}
			// The files of a directory that replaced the watched one, or
			// came back, are a restore's: looked at first, as at start,
			// rather than all opened at once.
			f.scan(ctx, replaced || wasAway, gone, problem)
			if replaced {
				// Files moved in with the directory are the same files to
				// the scan; a commit to one before the new watch began
				// was notified to no one.
				f.mu.Lock()
				f.probeParked(ctx)
				f.mu.Unlock()
			}
			lastScan = time.Now()
		}
		f.tend(ctx, time.Now())
	}
}

// scan serves the files the pattern matches now and lets go of the others.
// At first (at start, and in a directory that replaced the watched one)
// a file is opened only when a row in it is due (or it cannot be read for
// that, which opening it reports); a file that appears later is opened at
// once. problem is what fleet.DirProblem said of the directory before
// (gone its verdict), looked at again when the match finds nothing. A
// directory that cannot be read changes nothing: the files are served as
// they were until it can.
func (f *Fleet) scan(ctx context.Context, first, gone bool, problem error) {
	if f.oo.Test != nil && f.oo.Test.Scanning != nil {
		f.oo.Test.Scanning()
	}
	paths, err := fleet.Files(f.cfg.Database.Path)
	if err != nil {
		return // the pattern was checked at Open
	}
	if problem == nil && len(paths) == 0 {
		gone, problem = fleet.DirProblem(f.cfg.Database.Path)
	}
	now := time.Now()
	matched := make(map[string]bool, len(paths))
	f.mu.Lock()
	defer f.mu.Unlock()
	f.noteAway(gone, problem)
	if problem != nil && !gone {
		return
	}
	for _, path := range paths {
		matched[path] = true
		fi, err := os.Stat(path)
		if err != nil {
			continue // gone since the match
		}
		if m := f.files[path]; m != nil {
			if !m.leaving && !os.SameFile(fi, m.file) {
				f.log.Info("database file replaced; serving the new one", zap.String("tenant", m.tenant), zap.String("database", path))
				m.leave() // its goroutine removes it; the new file is taken up after
			}
			continue
		}
		if p := f.parked[path]; p != nil {
			if os.SameFile(fi, p.file) {
				continue
			}
			delete(f.parked, path) // replaced while closed: a new file
			f.forget(path)
		}
		retried := false
		if t := f.trouble[path]; t != nil {
			if t.as.changed(stampOf(path)) {
				// Mended or replaced, may be: tried at once, and a file
				// like any other while it waits its turn.
				delete(f.trouble, path)
			} else if now.Before(t.retry) {
				continue
			} else {
				retried = t.quick
			}
		}
		if first && f.parks {
			// Looked at in a goroutine, as a commit's notification has
			// it: a file its application holds locked holds up no other.
			// Once: the looks again are for a commit notified before
			// it could be read, and a commit now is notified anew.
			p := &parkedFile{file: fi, fresh: true}
			f.park(path, p, true)
			f.probe(ctx, path, p)
			p.relooks = len(fleetRelooks)
			continue
		}
		f.start(ctx, path, fi, false)
		f.files[path].retried = retried
	}
	for path, m := range f.files {
		if !matched[path] && !m.leaving {
			f.log.Info("database file gone; no longer serving it", zap.String("tenant", m.tenant), zap.String("database", path))
			m.leave()
		}
	}
	for path := range f.parked {
		if !matched[path] {
			delete(f.parked, path)
			f.forget(path)
		}
	}
	for path := range f.trouble {
		if !matched[path] {
			delete(f.trouble, path)
		}
	}
	for path := range f.said {
		if !matched[path] {
			delete(f.said, path)
		}
	}
}

// noteAway records what is wrong with the files' directory (nil:
// nothing), and says so when that changes: while it is missing or not a
// directory no file is served, while it cannot be read no file comes or
// goes, and the pattern is matched at every fleetTick, so that a
// directory made again (a restore by rm -rf and mkdir) is found within a
// tick rather than at the next fleetRescan. Called with f.mu held.
func (f *Fleet) noteAway(gone bool, problem error) {
	switch {
	case problem != nil && (f.away == nil || f.away.Error() != problem.Error()):
		what := ": the files open stay served, and no file comes or goes until it can be read"
		if gone {
			what = ": no file is served until it is back"
		}
		f.log.Warn(problem.Error()+what+"; the relay looks again every "+fleetTick.String(), zap.String("database", f.cfg.Database.Path))
	case problem == nil && f.away != nil:
		f.log.Info("the database directory is back; serving its files", zap.String("database", f.cfg.Database.Path))
	}
	f.away = problem
}

// askScan has Run match the pattern again soon (fleetScanSoon), rather
// than at its next tick. Called with f.mu held.
func (f *Fleet) askScan() {
	f.rescan = true
	select {
	case f.soon <- struct{}{}:
	default:
	}
}

// idleAfter is fleetIdleAfter, or what a test made it.
func (f *Fleet) idleAfter() time.Duration {
	if f.oo.Test != nil && f.oo.Test.IdleAfter > 0 {
		return f.oo.Test.IdleAfter
	}
	return fleetIdleAfter
}

// rescanEvery is d, one of the fleet's periodic fallbacks to its
// notifications, or what a test made them.
func (f *Fleet) rescanEvery(d time.Duration) time.Duration {
	if f.oo.Test != nil && f.oo.Test.Rescan > 0 {
		return f.oo.Test.Rescan
	}
	return d
}

// nextDue says whether a row of the file at path is due now, else when
// the next one is (zero: none pending). A file it cannot read counts as
// due: opening it says why. Read-only: a look changes nothing in the
// file (a file in WAL mode whose application removed its -wal and -shm
// on its last close is read, the look creating them again).
func (f *Fleet) nextDue(ctx context.Context, path string) (time.Time, bool) {
	select {
	case f.looks <- struct{}{}:
		defer func() { <-f.looks }()
	case <-ctx.Done():
		return time.Time{}, true
	}
	if f.oo.Test != nil && f.oo.Test.Looked != nil {
		f.oo.Test.Looked(path)
	}
	db, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: f.cfg.Database.Table, BusyTimeout: f.cfg.Database.BusyTimeout, ReadOnly: true, OneConnection: true,
		LockWait: fleetLookLockWait})
	if err != nil {
		return time.Time{}, true
	}
	defer db.Close()
	next, any, err := claim.NextDue(ctx, db, f.cfg.Ordering.Parks())
	if err == nil {
		// A file closed (or never opened) keeps its figures counted, as
		// they are now: a dead letter discarded, a key parked at start.
		if b, err := housekeeping.Backlog(ctx, db, f.cfg.Ordering.Parks()); err == nil {
			f.show(path, b)
		}
	}
	switch {
	case err != nil:
		return time.Time{}, true
	case !any:
		return time.Time{}, false
	}
	return next, !next.After(time.Now())
}

// tend closes the open files that have been idle for fleetIdleAfter,
// opens the closed ones whose next row came due, and sets
// broker_connected: 1 while the connection is up and no open file's relay
// is paused by an outage.
func (f *Fleet) tend(ctx context.Context, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	connected := f.conn.Ready() == nil
	for _, m := range f.files {
		if m.app != nil && m.app.relay.Paused() != nil {
			connected = false
		}
		if !f.parks || m.app == nil || m.park != nil {
			continue
		}
		if idle, wake := m.app.Idle(now, f.idleAfter()); idle {
			m.park = &parkedFile{file: m.file, wake: wake}
			m.stop()
		}
	}
	if connected {
		f.metrics.BrokerConnected.Set(1)
	} else {
		f.metrics.BrokerConnected.Set(0)
	}
	f.takeTurns(now)
	defer f.count()
	for path, p := range f.parked {
		switch {
		case !p.wake.IsZero() && !now.Before(p.wake):
			delete(f.parked, path)
			f.wake(ctx, path, p)
		case !p.relook.IsZero() && !now.Before(p.relook) && !p.probing:
			p.relook = time.Time{}
			f.look(ctx, path, p)
		case !p.keep.IsZero() && !now.Before(p.keep) && !p.keeping && !p.probing: // a look may open it
			f.keep(ctx, path, p)
		}
	}
}

// takeTurns closes, for each file that has waited for a slot for the
// idle time, one of the files served longest (for the idle time at
// least): it waits its turn again at the end of the queue, its rows due,
// so that with more busy files than slots each is served in turn rather
// than the first ones for ever. Called with f.mu held.
func (f *Fleet) takeTurns(now time.Time) {
	turn := f.idleAfter()
	need := 0
	var served []*member
	for path, m := range f.files {
		switch {
		case m.slotted.IsZero():
			// A file in trouble is tried again when a slot is free: it
			// fails at once, and does not close a healthy file for that.
			if now.Sub(m.queued) >= turn && !m.leaving && f.trouble[path] == nil {
				need++
			}
		case m.leaving || m.park != nil:
			need-- // closing: its slot is about to be free
		case m.app != nil && now.Sub(m.slotted) >= turn:
			served = append(served, m)
		}
	}
	if need <= 0 || len(served) == 0 {
		return
	}
	if !f.turnsSaid {
		f.turnsSaid = true
		f.log.Info("more files have rows than may be open at once: they are served in turn", zap.Int("open_at_most", cap(f.slots)), zap.Duration("turn", turn))
	}
	sort.Slice(served, func(i, j int) bool { return served[i].slotted.Before(served[j].slotted) })
	for _, m := range served[:min(need, len(served))] {
		m.park = &parkedFile{file: m.file, wake: now} // opened again at once, after the files waiting
		m.stop()
	}
}

// commitTo looks at the closed file at path, which something wrote to,
// and opens it if a row in it is due; else it stays closed, to be opened
// when its next row comes due. What wrote may be the application with
// data and no event, or another relay of the directory (a heartbeat, a
// settle): opening the file on every write, two relays would open it for
// each other's heartbeats for ever. The look is a read of the pending
// index on a connection of its own, in a goroutine (the application's
// lock may hold it up); writes meanwhile make one more look. A name the
// fleet does not know makes it match the pattern again.
func (f *Fleet) commitTo(ctx context.Context, path string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p := f.parked[path]
	if p == nil {
		if f.files[path] == nil {
			f.askScan()
		}
		return // an open file's relay sees it; one closing is looked at once closed
	}
	f.probe(ctx, path, p)
}

// probeAll looks at every closed file, as if each had been written to:
// notifications were lost, and a commit among them would wait for ever.
func (f *Fleet) probeAll(ctx context.Context) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.log.Warn("file-system notifications were lost; looking at every idle file for due rows", zap.Int("idle", len(f.parked)))
	f.probeParked(ctx)
}

// rewatch watches the directory that replaced the watched one, trying
// for fleetRewatchFor; where it gives no notifications, every file stays
// open.
func (f *Fleet) rewatch(ctx context.Context) *fleet.Watcher {
	if f.oo.Test != nil && f.oo.Test.Rewatch != nil {
		f.oo.Test.Rewatch()
	}
	w := fleet.Watch(ctx, f.cfg.Database.Path, f.routes)
	for tried := time.Now(); w == nil && time.Since(tried) < fleetRewatchFor; {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(fleetRewatchStep):
		}
		w = fleet.Watch(ctx, f.cfg.Database.Path, f.routes)
	}
	if w == nil {
		f.routes.Close() // the open files look periodically
		f.log.Warn("database directory replaced, and the new one gives no file-system notifications: every file stays open, and new files are found by looking every "+fleetRescan.String()+", when the relay also tries to watch it again",
			zap.String("database", f.cfg.Database.Path))
		f.stayOpen(ctx)
		return nil
	}
	f.log.Info("database directory replaced; watching the new one", zap.String("database", f.cfg.Database.Path))
	f.routes.All() // a commit before the new watch began was notified to no one
	return w
}

// watchAgain tries once more to watch the directory that gave no
// notifications (at the start, or once it replaced the watched one). Where
// it now does, idle files close again, woken by their commits, and the
// files opened meanwhile look periodically until they close.
func (f *Fleet) watchAgain(ctx context.Context) *fleet.Watcher {
	w := fleet.Watch(ctx, f.cfg.Database.Path, f.routes)
	if w == nil {
		return nil
	}
	f.routes.Open()
	f.mu.Lock()
	f.parks = true
	f.mu.Unlock()
	f.log.Info("watching the database directory again: idle files close, and wake on their commits", zap.String("database", f.cfg.Database.Path))
	return w
}

// stayOpen opens every closed file and closes none again: no
// notification would open them on a commit.
func (f *Fleet) stayOpen(ctx context.Context) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.parks = false
	for path, p := range f.parked {
		delete(f.parked, path)
		f.wake(ctx, path, p)
	}
}

// probeParked looks at every closed file. Called with f.mu held.
func (f *Fleet) probeParked(ctx context.Context) {
	for path, p := range f.parked {
		f.probe(ctx, path, p)
	}
}

// probe looks at the pending rows of the closed file p at path, which was
// written to (see commitTo), and again after fleetRelooks if it finds
// nothing due. Called with f.mu held.
func (f *Fleet) probe(ctx context.Context, path string, p *parkedFile) {
	p.relooks = 0
	f.look(ctx, path, p)
}

// look is probe's look, once. Called with f.mu held.
func (f *Fleet) look(ctx context.Context, path string, p *parkedFile) {
	if p.probing {
		p.again = true
		return
	}
	p.probing, p.again = true, false
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			wake, due := f.lookOnce(ctx, path, p)
			f.mu.Lock()
			if f.parked[path] != p { // removed, replaced or woken meanwhile
				f.mu.Unlock()
				return
			}
			switch {
			case due:
				delete(f.parked, path)
				f.wake(ctx, path, p)
			case p.again:
				p.again = false
				f.mu.Unlock()
				continue
			case p.relooks == 0:
				p.relooks++
				f.mu.Unlock()
				select {
				case <-ctx.Done():
					return // shutting down: nothing is opened any more
				case <-time.After(fleetQuickRelook):
				}
				continue
			default:
				p.wake, p.probing = wake, false
				if p.relooks < len(fleetRelooks) {
					p.relook = time.Now().Add(fleetRelooks[p.relooks])
					p.relooks++
				}
			}
			f.mu.Unlock()
			return
		}
	}()
}

// lookOnce says, as nextDue does, whether a row of the closed file p at
// path is due now, else when the next one is. When no commit became
// visible in the file since its last look began, as its commit mark
// tells, what that look found stands, and the file is not opened: a look
// costs a connection and a query, the mark a read of 96 bytes. The
// notifications of a commit's writes or of the relay's own last writes as
// it closed the file, and the looks again for a commit that did not show
// yet, thus open the file only for what no look saw.
func (f *Fleet) lookOnce(ctx context.Context, path string, p *parkedFile) (time.Time, bool) {
	mark, marked := sqlitedb.ReadCommitMark(path) // what a look now sees is at least this
	f.mu.Lock()
	same, found := marked && p.marked && mark == p.mark, p.found
	f.mu.Unlock()
	if same {
		return found, !found.IsZero() && !found.After(time.Now())
	}
	found, due := f.nextDue(ctx, path)
	f.mu.Lock()
	p.mark, p.marked, p.found = mark, marked, found
	f.mu.Unlock()
	return found, due
}

// wake serves the closed file p, its App logging only warnings and
// errors once it has been served: opening and closing idle files is
// routine, and each said "relay starting", "leading" and "relay
// stopped". Called with f.mu held.
func (f *Fleet) wake(ctx context.Context, path string, p *parkedFile) {
	f.start(ctx, path, p.file, !p.fresh)
}

// start serves the file at path in a goroutine of its own: it waits for
// a slot among the files open, and opening it may wait for the
// application's lock. Called with f.mu held.
func (f *Fleet) start(ctx context.Context, path string, fi os.FileInfo, quiet bool) {
	mctx, cancel := context.WithCancel(ctx)
	m := &member{tenant: fleet.Tenant(path), file: fi, stop: cancel, done: make(chan struct{}), quiet: quiet, queued: time.Now()}
	f.files[path] = m
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		defer close(m.done)
		var err error
		var tried fileStamp // the file as its try began
		select {
		case f.slots <- struct{}{}:
			// Opening a file is work waiting, as a backlog is: the files
			// that an hour's first commits wake at once open on every
			// core rather than one after another on one.
			f.oo.Procs.Backlog()
			f.mu.Lock()
			m.slotted = time.Now()
			f.mu.Unlock()
			tried = stampOf(path)
			started := f.startTurn(mctx)
			err = f.serve(mctx, path, m, func() {
				f.fleetM.Starts.Observe(time.Since(m.queued).Seconds())
				started()
			})
			started()
			<-f.slots
		case <-mctx.Done():
		}
		cancel()
		if f.oo.Test != nil && f.oo.Test.Tried != nil {
			f.oo.Test.Tried(path, err)
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.files, path)
		if m.park != nil && ctx.Err() == nil && err == nil {
			// A commit since its relay last looked, up to its close, is
			// seen by this look, notified or not.
			delete(f.said, path)
			f.park(path, m.park, false)
			f.probe(ctx, path, m.park)
			return
		}
		f.forget(path) // gone, replaced or in trouble: its figures are not known
		replaced := errors.Is(err, event.ErrDatabaseReplaced)
		if replaced {
			// Found by the relay before the scan.
			f.log.Info("database file replaced; serving the new one", zap.String("tenant", m.tenant), zap.String("database", path))
			err = nil
		}
		if (replaced || m.leaving) && ctx.Err() == nil {
			// The scan that saw it replaced (or gone) skipped the path
			// while it was still served: a file there now is taken up at
			// once, not at the next periodic scan.
			f.askScan()
		}
		if err == nil || ctx.Err() != nil {
			delete(f.trouble, path)
			delete(f.said, path)
			return
		}
		t := &fileTrouble{err: err, retry: time.Now().Add(f.rescanEvery(fleetRetry)), as: stampOf(path)}
		if !m.retried && tried.changed(t.as) {
			// Once only: a file its own tries change (creating its -wal)
			// would be tried again and again.
			t.retry, t.quick = time.Now(), true
			f.askScan()
		}
		f.trouble[path] = t
		if f.said[path] != err.Error() {
			f.said[path] = err.Error()
			f.log.Error("cannot serve this database file; the others are served, and it is tried again every "+fleetRetry.String(),
				zap.String("tenant", m.tenant), zap.String("database", path), zap.Error(err))
		}
	}()
}

// startTurn waits for a turn to start a file, and returns the function
// that gives it back: when the file's relay has started (its first claim,
// or it stands by, or finds the broker out) or its start failed, or
// after fleetStartHold, whichever comes first. Files that an hour's first
// commits wake at once thus start a few at a time, each in milliseconds,
// rather than all together, each taking as long as all of them: their
// first rows wait half as long on average. A file whose start waits
// (for its application's lock, a long reconciliation) holds its turn for
// fleetStartHold at most.
func (f *Fleet) startTurn(ctx context.Context) (started func()) {
	select {
	case f.starting <- struct{}{}:
	case <-ctx.Done():
		return func() {}
	}
	give := sync.OnceFunc(func() { <-f.starting })
	hold := time.AfterFunc(fleetStartHold, give)
	return func() {
		hold.Stop()
		give()
	}
}

// serve opens the file's App and runs it until ctx ends (nil) or it
// fails; started is called once its relay has started.
func (f *Fleet) serve(ctx context.Context, path string, m *member, started func()) error {
	cfg := f.cfg
	cfg.Database.Path = path
	cfg.Metrics.Listen = "" // the fleet serves HTTP
	log := f.log.With(zap.String("tenant", m.tenant))
	if m.quiet {
		log = log.WithOptions(zap.IncreaseLevel(zap.WarnLevel))
	}
	oo := Options{
		Version: f.oo.Version, Commit: f.oo.Commit, Metrics: f.fileMetrics, Conn: f.conn, Tenant: m.tenant,
		Gauges: f.gaugesOf(path, m.tenant), Budget: f.budget, Procs: f.oo.Procs, Started: started, Test: f.oo.Test, sync: f.sync,
		Locked: func(err error) { f.mu.Lock(); m.locked = err; f.count(); f.mu.Unlock() },
	}
	f.mu.Lock()
	if f.parks {
		oo.notifications = f.routes.Follow
	}
	oo.sweeps = f.sweepsOf(path)
	f.mu.Unlock()
	app, err := Open(ctx, cfg, log, oo)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer app.Close()
	f.mu.Lock()
	m.app = app
	delete(f.trouble, path) // served: whatever kept it from being is over
	f.mu.Unlock()
	err = app.Run(ctx)
	switch {
	case ctx.Err() != nil: // let go of
		f.lookLast(ctx, app, m)
		return nil
	case err == nil:
		return errors.New("its relay stopped")
	}
	return err
}

// lookLast is the first look at a file closed as idle, made on its
// relay's connections before they close: the look that follows the close
// then finds the same without opening the file, unless a commit came
// meanwhile (see lookOnce). The mark is read before the rows, so that
// what the look finds covers every commit the mark does; a mark that the
// close changes (its checkpoint) only costs the look it would have
// spared.
func (f *Fleet) lookLast(ctx context.Context, app *App, m *member) {
	f.mu.Lock()
	p := m.park
	f.mu.Unlock()
	if p == nil {
		return // not closed as idle: gone, replaced, or the fleet stops
	}
	mark, marked := app.db.CommitMark()
	if !marked {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), fleetLastLookWait)
	defer cancel()
	next, any, err := claim.NextDue(ctx, app.db, f.cfg.Ordering.Parks())
	if err != nil {
		return
	}
	if !any {
		next = time.Time{}
	}
	f.mu.Lock()
	p.mark, p.marked, p.found = mark, true, next
	f.mu.Unlock()
}

// gaugesOf returns the file's shares of the backlog gauges.
func (f *Fleet) gaugesOf(path, tenant string) *housekeeping.Gauges {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gaugesLocked(path, tenant)
}

// show sets the gauges of a file looked at while closed, unless the fleet
// has let go of it since (removed, replaced: forgotten).
func (f *Fleet) show(path string, b event.Backlog) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.parked[path] != nil || f.files[path] != nil {
		f.gaugesLocked(path, fleet.Tenant(path)).Show(b)
	}
}

// gaugesLocked is gaugesOf with f.mu held.
func (f *Fleet) gaugesLocked(path, tenant string) *housekeeping.Gauges {
	g := f.gauges[path]
	if g == nil {
		g = housekeeping.NewGauges(f.metrics, tenant)
		f.gauges[path] = g
	}
	return g
}

// sweepsOf returns where the file's retention stands. Called with f.mu
// held.
func (f *Fleet) sweepsOf(path string) *housekeeping.Sweeps {
	sw := f.sweeps[path]
	if sw == nil {
		sw = &housekeeping.Sweeps{}
		f.sweeps[path] = sw
	}
	return sw
}

// forget takes a file that is no longer served out of the gauges, and
// forgets where its retention stands. Called
// with f.mu held.
func (f *Fleet) forget(path string) {
	if g := f.gauges[path]; g != nil {
		g.Forget()
		delete(f.gauges, path)
	}
	delete(f.sweeps, path)
}

// count sets the fleet_files gauge. Called with f.mu held.
func (f *Fleet) count() {
	waiting, failing, troubled := f.waiting(), 0, 0
	for _, m := range f.files {
		if m.failing() != nil {
			failing++
		}
	}
	for path := range f.trouble {
		if f.files[path] == nil { // else tried again, and counted as it is now
			troubled++
		}
	}
	f.fleetM.Files.WithLabelValues("open").Set(float64(len(f.files) - waiting - failing))
	f.fleetM.Files.WithLabelValues("waiting").Set(float64(waiting))
	f.fleetM.Files.WithLabelValues("idle").Set(float64(len(f.parked)))
	f.fleetM.Files.WithLabelValues("trouble").Set(float64(troubled + failing))
}

// failing returns the error of an open file whose database keeps failing
// (its table gone, a lock its application holds for long), if any.
func (m *member) failing() error {
	if m.app == nil {
		return m.locked
	}
	return m.app.relay.DatabaseError()
}

// waiting counts the files waiting for a slot. Called with f.mu held.
func (f *Fleet) waiting() int {
	n := 0
	for _, m := range f.files {
		if m.slotted.IsZero() {
			n++
		}
	}
	return n
}

// stopAll stops every file's relay and waits for them.
func (f *Fleet) stopAll() {
	f.mu.Lock()
	for _, m := range f.files {
		m.stop()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// Ready is the fleet's /readyz: the broker answers. The files in trouble
// are said by role, not made a reason: the healthy files are served.
func (f *Fleet) Ready(context.Context) error {
	if err := f.conn.Ready(); err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	return nil
}

// Live is the fleet's /healthz.
func (f *Fleet) Live(context.Context) error { return nil }

// role says how many files are served and led, and which are in trouble.
func (f *Fleet) role() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	leading, waiting := 0, f.waiting()
	var troubled, held []string
	for path, m := range f.files {
		if m.app != nil && m.app.relay.Leads() {
			leading++
		}
		if err := m.failing(); err != nil {
			troubled = append(troubled, fmt.Sprintf("%s (%s): %v", m.tenant, path, err))
		}
		if m.app != nil {
			if err := m.app.relay.Held(); err != nil {
				held = append(held, fmt.Sprintf("%s: %v", m.tenant, err))
			}
		}
	}
	for path, t := range f.trouble {
		if f.files[path] == nil { // else tried again: said as it is now
			troubled = append(troubled, fmt.Sprintf("%s (%s): %v", fleet.Tenant(path), path, t.err))
		}
	}
	sort.Strings(troubled)
	open := fmt.Sprintf("%d open (leading %d)", len(f.files)-waiting, leading)
	if waiting > 0 {
		open += fmt.Sprintf(", %d waiting their turn", waiting)
	}
	s := fmt.Sprintf("serving %d database files of %s: %s, %d idle", len(f.files)+len(f.parked), f.cfg.Database.Path, open, len(f.parked))
	if len(troubled) > 0 {
		s += fmt.Sprintf("; %d in trouble: %s", len(troubled), strings.Join(troubled, "; "))
	}
	if len(held) > 0 {
		sort.Strings(held)
		s += fmt.Sprintf("; %d with subjects the stream refuses at its max_msgs_per_subject: %s", len(held), strings.Join(held, "; "))
	}
	if f.away != nil {
		s += "; " + f.away.Error()
	}
	return s
}

// serveHTTP is App.serveHTTP for the fleet.
func (f *Fleet) serveHTTP() (stop func(), err error) {
	return serveHTTP(f.oo.Listener, f.cfg.Metrics.Listen, f.log, f.metrics.Handler(f.Live, f.Ready, f.role))
}

// Close closes the broker connection and the embedded server.
func (f *Fleet) Close() {
	if f.oo.Listener != nil {
		f.oo.Listener.Close()
	}
	if f.conn != nil {
		f.conn.Close()
	}
	if f.embedded != nil {
		f.embedded.Shutdown()
	}
}
