// Package relay is the relay loop: claim due rows, publish them pipelined,
// settle them by outcome, pause during broker outages, and drain on
// shutdown. It takes the SQLite and NATS sides as small interfaces so its
// state machine can be driven by fakes as well as by the real parts.
package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/episode"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// Store is the SQLite side: the rows in flight (*claim.Store).
type Store interface {
	// Claim claims due rows: up to limit, and past the first row up to
	// maxBytes of payload (0: no byte limit).
	Claim(ctx context.Context, limit int, maxBytes int64) ([]event.Row, error)
	// Settle writes outcomes; stale lists those whose claim was lost.
	Settle(ctx context.Context, outs []event.Outcome) (stale []int, err error)
	// Waiting reports whether due rows were left unclaimed for lack of
	// room in their ordering key: claim again as rows settle.
	Waiting() bool
	// Rescan makes the next claim look at every pending row: rows went
	// back to pending (a heartbeat reclaimed them).
	Rescan()
	// Quiet returns until when a claim would find nothing unless the
	// database changes (a commit, a settle): the next time a pending row
	// comes due, after a claim that found nothing; zero when unknown.
	Quiet() time.Time
}

// Lead is this relay's heartbeat row and the lead (*lead.Lease): one relay
// per database file claims, the others stand by.
type Lead interface {
	// Heartbeat says this relay is alive with inFlight rows, and takes
	// back rows left processing by dead claimers (how many it returns).
	Heartbeat(ctx context.Context, version string, inFlight int, lease, staleAfter time.Duration) (reclaimed int64, err error)
	// Leads reports whether this relay led at its latest heartbeat.
	Leads() bool
	// Leave removes this relay's heartbeat row, and with it the lead.
	Leave(ctx context.Context) error
}

// Publisher is the NATS side (implemented by *publish.JetStream and *publish.Core).
type Publisher interface {
	Publish(ctx context.Context, msgs []publish.Message) []publish.Ack
	// Ready reports why the broker cannot take publishes, or nil.
	Ready(ctx context.Context) error
}

// Options tune the loop. Zero intervals disable the corresponding timer so
// tests can drive the loop by hand.
type Options struct {
	SubjectPrefix string
	// Format adds a message format's headers (CloudEvents); a row's own
	// headers may not set them.
	Format           publish.Format
	BatchSize        int
	MaxInFlight      int
	MaxInFlightBytes int           // payload bytes in flight at most (large payloads); 0: no limit
	PollInterval     time.Duration // fallback claim timer when no wake-up comes
	WatchInterval    time.Duration // commit detection: the fallback poll of PRAGMA data_version
	// Watch announces commits to the database (sqlitedb.DB.Watch) until
	// ctx ends: on foreign those of other connections than the relay's own
	// writer, on any every commit. Without it, or with a zero
	// WatchInterval, the relay polls.
	Watch func(ctx context.Context, interval time.Duration, foreign chan<- struct{}, any ...chan<- struct{}) error
	// Lead keeps the heartbeat and says whether this relay leads; without
	// it, or with a zero HeartbeatInterval, the relay is alone on its file:
	// it always leads and keeps no heartbeat.
	Lead              Lead
	HeartbeatInterval time.Duration // instance heartbeat and reclaim period
	StaleAfter        time.Duration // a relay silent this long is dead; its claims are reclaimed
	Lease             time.Duration
	MaxAttempts       int
	ShutdownTimeout   time.Duration
	Version           string
	// SettleWindow: batches acknowledged within it are settled in one
	// transaction; 0: one transaction a batch.
	SettleWindow time.Duration
	// Ready, when set, replaces Publisher.Ready as the outage probe (the
	// daemon adds reconciling the stream once the broker answers).
	Ready func(ctx context.Context) error
	// Clock gives the times of retries and deferrals; share the store's.
	Clock   *event.Clock
	Metrics *metrics.Metrics
	Log     *zap.Logger
}

// Relay moves outbox rows to the broker.
type Relay struct {
	store Store
	pub   Publisher
	o     Options
	log   *zap.Logger
	m     *metrics.Metrics

	wake     chan struct{} // a commit or a reclaim happened: claim now
	commits  chan struct{} // a commit happened (for Commits)
	settled  chan struct{} // in-flight rows were settled: room to claim
	led      chan struct{} // this relay became the leader
	leading  atomic.Bool
	roleSaid atomic.Bool   // the role was logged once
	pipeline chan *batch   // claimer -> settler, in publish order
	lanes    *lanes        // rows with an ordering key
	claimSeq atomic.Uint64 // claims begun, for lanes
	inflight atomic.Int64
	// inflightBytes is the payload held by rows in flight.
	inflightBytes atomic.Int64
	running       atomic.Bool
	watching      atomic.Bool // the commit watch runs: commits are announced
	outage        outageState
	// One trouble log per database operation, so that one that keeps
	// failing is logged once while the others succeed.
	claimTrouble, settleTrouble, beatTrouble *episode.Log
	// halt ends the claim loop with a cause that Run returns (set by Run).
	halt context.CancelCauseFunc
	// reserved are the header names a row may not set beyond Nats-* and
	// Outbox-* (Options.Format's).
	reserved []string
}

// batch is one claim's rows on their way to settlement.
type batch struct {
	msgs      []publish.Message
	acks      []publish.Ack
	published time.Time
	outcomes  []event.Outcome // rows settled without publishing (invalid)
}

// New returns a relay; Run starts it.
func New(store Store, pub Publisher, o Options) *Relay {
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	if o.Metrics == nil {
		o.Metrics = metrics.New("", "")
	}
	if o.Ready == nil {
		o.Ready = pub.Ready
	}
	if o.Clock == nil {
		o.Clock = event.NewClock(nil)
	}
	if o.MaxInFlight < o.BatchSize {
		o.MaxInFlight = o.BatchSize
	}
	if o.Lead == nil {
		o.HeartbeatInterval = 0 // alone on the file: nothing to beat for
	}
	r := &Relay{
		store:    store,
		pub:      pub,
		o:        o,
		log:      o.Log,
		m:        o.Metrics,
		wake:     make(chan struct{}, 1),
		commits:  make(chan struct{}, 1),
		settled:  make(chan struct{}, 1),
		led:      make(chan struct{}, 1),
		pipeline: make(chan *batch, o.MaxInFlight), // a batch may be one row: never the bound
		lanes:    newLanes(),
		reserved: o.Format.Reserved(),
	}
	trouble := func(op string) *episode.Log {
		return episode.New(o.Log.With(zap.String("operation", op)), zap.WarnLevel, "database unavailable; retrying", "database available again")
	}
	r.claimTrouble, r.settleTrouble, r.beatTrouble = trouble("claim"), trouble("settle"), trouble("heartbeat")
	r.m.BrokerConnected.Set(0) // until the first probe answers
	return r
}

// Running reports whether the loops run (for /healthz).
func (r *Relay) Running() bool { return r.running.Load() }

// Role says whether this relay leads and how many rows it has in flight
// (for /readyz).
func (r *Relay) Role() string {
	if r.o.HeartbeatInterval > 0 && !r.leading.Load() {
		return "standing by: another relay of this outbox table leads"
	}
	return fmt.Sprintf("leading, %d rows in flight", r.inflight.Load())
}

// Paused reports the current broker outage, if any (for /readyz).
func (r *Relay) Paused() error { return r.outage.err() }

// DatabaseError reports the error of a database operation that keeps
// failing (claiming or settling rows), if any, for /readyz.
// An error that only says the application held the lock (event.ErrBusy)
// comes last, so that it cannot hide another.
func (r *Relay) DatabaseError() error {
	claimErr, settleErr := r.claimTrouble.Err(), r.settleTrouble.Err()
	for _, err := range []error{claimErr, settleErr} {
		if err != nil && !errors.Is(err, event.ErrBusy) {
			return err
		}
	}
	if claimErr != nil {
		return claimErr
	}
	return settleErr
}

// Commits announces the commits the commit watch sees (coalesced, never
// blocking the watch), for housekeeping that follows them.
func (r *Relay) Commits() <-chan struct{} { return r.commits }

// Watching reports whether the commit watch runs, so that Commits
// announces commits.
func (r *Relay) Watching() bool { return r.watching.Load() }

// wakeClaimer makes the claimer look for due rows now.
func (r *Relay) wakeClaimer() { signal(r.wake) }

// writeGrace is how long, past ShutdownTimeout, shutdown may spend writing
// the final settlements (the database may be locked by the application).
const writeGrace = 5 * time.Second

// Run runs until ctx ends, then stops claiming, waits up to
// ShutdownTimeout for outstanding acknowledgements, releases what is left
// without spending attempts, and returns nil; it returns within
// ShutdownTimeout plus a few seconds. It returns an error only when the
// relay cannot go on: the NATS connection was closed for good (the process
// should exit and be restarted).
func (r *Relay) Run(ctx context.Context) error {
	// Acknowledgements are awaited until ShutdownTimeout after ctx ends;
	// settlements, heartbeats and the goodbye are written until writeGrace
	// after that.
	ackCtx, cancelAcks := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelAcks()
	writeCtx, cancelWrites := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWrites()
	stopTimers := context.AfterFunc(ctx, func() {
		time.AfterFunc(r.o.ShutdownTimeout, cancelAcks)
		time.AfterFunc(r.o.ShutdownTimeout+writeGrace, cancelWrites)
	})
	defer stopTimers()

	if r.o.HeartbeatInterval > 0 {
		// Be visibly alive before the first claim, or another relay would
		// take this one's claims for a dead relay's. A locked database is
		// waited out (logged once); /healthz fails meanwhile.
		if err := r.firstHeartbeat(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
	r.running.Store(true)
	defer r.running.Store(false)

	// claimCtx ends the claim loop and every helper loop: at shutdown, or
	// when the relay cannot go on.
	claimCtx, stopClaiming := context.WithCancelCause(ctx)
	defer stopClaiming(nil)
	r.halt = stopClaiming
	var loops, heartbeat sync.WaitGroup
	hbCtx, stopHeartbeat := context.WithCancel(writeCtx)
	defer stopHeartbeat()
	if r.o.HeartbeatInterval > 0 {
		heartbeat.Add(1)
		go func() { defer heartbeat.Done(); r.heartbeatLoop(hbCtx) }()
	}
	if r.o.WatchInterval > 0 && r.o.Watch != nil {
		loops.Add(1)
		r.watching.Store(true)
		go func() {
			defer loops.Done()
			defer r.watching.Store(false)
			if err := r.o.Watch(claimCtx, r.o.WatchInterval, r.wake, r.commits); err != nil {
				r.log.Warn("commit watch stopped; falling back to polling", zap.Error(err))
			}
		}()
	}
	settlerDone := make(chan struct{})
	go func() { defer close(settlerDone); r.settleLoop(ctx, ackCtx, writeCtx) }()

	fatal := r.claimLoop(claimCtx)
	if fatal == nil && ctx.Err() == nil {
		fatal = context.Cause(claimCtx) // from stopIfReplaced, or nil
	}
	if fatal != nil {
		stopClaiming(fatal)
		cancelAcks()
		if errors.Is(fatal, event.ErrDatabaseReplaced) {
			// Write nothing more: the rows in flight belong to the old file.
			r.log.Error("relay cannot go on; exiting without writing to the old file", zap.Error(fatal))
			cancelWrites()
		} else {
			// Nothing more can be published: release what is in flight now,
			// writing for writeGrace at most (a locked database would
			// otherwise hold the exit up for as long as it is locked).
			r.log.Error("relay cannot go on; settling what was acknowledged and exiting", zap.Error(fatal))
			time.AfterFunc(writeGrace, cancelWrites)
		}
	}
	close(r.pipeline)
	<-settlerDone
	stopClaiming(nil)
	loops.Wait()
	stopHeartbeat()
	heartbeat.Wait()
	if r.o.HeartbeatInterval > 0 {
		if err := r.o.Lead.Leave(writeCtx); err != nil {
			r.log.Warn("remove instance heartbeat", zap.Error(err))
		}
	}
	r.log.Info("relay stopped")
	return fatal
}

// firstHeartbeat registers this relay, retrying database errors until it
// succeeds (nil) or ctx ends; a file this process cannot write, or one
// replaced since it was opened, is returned at once. Rows it reclaims
// from dead claimers are counted like every later reclaim.
func (r *Relay) firstHeartbeat(ctx context.Context) error {
	retry := backoff{min: 100 * time.Millisecond, max: 5 * time.Second}
	for {
		n, err := r.beat(ctx)
		if err == nil {
			r.beatTrouble.OK()
			r.reclaimed(n)
			r.lead()
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, event.ErrNotWritable) || errors.Is(err, event.ErrDatabaseReplaced) {
			return err // waiting will not make the file writable, or bring the old one back
		}
		r.beatTrouble.Fail(err)
		sleep(ctx, retry.next())
	}
}

// beat heartbeats with the rows in flight.
func (r *Relay) beat(ctx context.Context) (reclaimed int64, err error) {
	return r.o.Lead.Heartbeat(ctx, r.o.Version, int(r.inflight.Load()), r.o.Lease, r.o.StaleAfter)
}

// reclaimed counts and logs rows a heartbeat made claimable again, and
// has the next claim look for them.
func (r *Relay) reclaimed(n int64) {
	if n > 0 {
		r.log.Info("took back processing rows of an expired lease or a stopped claimer", zap.Int64("rows", n))
		r.m.LeasesReclaimed.Add(float64(n))
		r.store.Rescan()
		r.wakeClaimer()
	}
}

// claimLoop claims and publishes until ctx ends or the broker connection is
// gone for good (returned).
func (r *Relay) claimLoop(ctx context.Context) error {
	retry := backoff{min: 100 * time.Millisecond, max: 5 * time.Second}
	// Claim nothing before the broker can take it: a missing stream or a
	// broker down at startup is an outage, not a reason to spend attempts.
	if err := r.probe(ctx); err != nil && ctx.Err() == nil {
		if errors.Is(err, publish.ErrClosed) {
			return err
		}
		r.outage.begin(err, r.log, r.m)
	} else if err == nil {
		r.m.BrokerConnected.Set(1)
	}
	for ctx.Err() == nil {
		if r.outage.active() {
			if err := r.waitBroker(ctx); err != nil {
				return err
			}
			continue
		}
		if !r.leading.Load() && r.o.HeartbeatInterval > 0 {
			wait(ctx, r.led, nil) // a standby claims nothing
			continue
		}
		if r.outage.halfOpen() && r.inflight.Load() > 0 {
			wait(ctx, r.settled, nil) // the row on trial decides first
			continue
		}
		free := int64(r.o.MaxInFlight) - r.inflight.Load()
		freeBytes := int64(r.o.MaxInFlightBytes) - r.inflightBytes.Load()
		if free <= 0 || (r.o.MaxInFlightBytes > 0 && freeBytes <= 0) {
			wait(ctx, r.settled, nil)
			continue
		}
		limit := min(int64(r.o.BatchSize), free)
		if r.outage.halfOpen() {
			limit = 1 // one row tells whether the broker takes publishes again
		}
		var maxBytes int64 // the claim reads no payload past the budget
		if r.o.MaxInFlightBytes > 0 {
			maxBytes = freeBytes
		}
		seq := r.claimSeq.Add(1)
		rows, err := r.store.Claim(ctx, int(limit), maxBytes)
		if r.stopIfReplaced(err) {
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			r.claimTrouble.Fail(err)
			sleep(ctx, retry.next())
			continue
		}
		retry.reset()
		if len(rows) == 0 {
			// An empty claim may not have written (it looks first): it
			// proves nothing about the lock, but the database answered.
			r.claimTrouble.OKUnlessBusy()
			r.outage.nothingToTry(r.log, r.m)
			r.idle(ctx)
			continue
		}
		r.claimTrouble.OK()
		r.m.InFlight.Set(float64(r.inflight.Add(int64(len(rows)))))
		bytes := event.PayloadBytes(rows)
		r.inflightBytes.Add(bytes)
		r.pipeline <- r.publish(ctx, rows, seq)
		if int64(len(rows)) < limit && (maxBytes == 0 || bytes < maxBytes) {
			// Caught up: wait for the next commit rather than spinning.
			r.idle(ctx)
		}
	}
	return nil
}

// maxQuiet bounds how long an idle relay with a commit watch goes without
// claiming: the watch announces every commit, so the poll only has to find
// rows that came due, but a claim at least this often is cheap insurance.
const maxQuiet = time.Minute

// idle waits for a wake-up, the poll timer or the end; and for rows to
// settle when due rows wait for room in their ordering key. While the
// commit watch announces commits, the poll waits until a row comes due
// (Store.Quiet; at least PollInterval, at most maxQuiet): an idle claim
// walks every pending row, thousands where keys are parked.
func (r *Relay) idle(ctx context.Context) {
	var timer <-chan time.Time
	if r.o.PollInterval > 0 {
		d := r.o.PollInterval
		if r.watching.Load() {
			d = min(max(d, time.Until(r.store.Quiet())), max(d, maxQuiet))
		}
		t := time.NewTimer(d)
		defer t.Stop()
		timer = t.C
	}
	var settled chan struct{}
	if r.store.Waiting() {
		settled = r.settled
	}
	select {
	case <-ctx.Done():
	case <-r.wake:
	case <-settled:
	case <-timer:
	}
}

// publish starts publishing rows of claim seq: those without an ordering
// key in one go, those with one through their key's lane. A row that cannot be
// published (an event type that cannot form a subject, say) is
// dead-lettered without publishing, and stops its key's lane.
func (r *Relay) publish(ctx context.Context, rows []event.Row, seq uint64) *batch {
	b := &batch{msgs: make([]publish.Message, 0, len(rows)), published: time.Now()}
	b.acks = make([]publish.Ack, 0, len(rows))
	var now []publish.Message // sent in one go
	var nowAt []int           // indexes in b.acks of now
	var keyed []*laneAck      // of now, the rows with a key; nil for others
	for _, row := range rows {
		m, invalid := r.message(row)
		if invalid != nil && row.OrderingKey == "" {
			b.outcomes = append(b.outcomes, r.invalid(row, invalid))
			continue
		}
		// A keyed row that is invalid waits for its turn in its lane.
		b.msgs = append(b.msgs, m)
		var lane *laneAck
		if row.OrderingKey != "" {
			a, send := r.lanes.add(m, invalid, seq)
			if send == nil {
				b.acks = append(b.acks, a)
				continue
			}
			lane = a
		}
		nowAt = append(nowAt, len(b.acks))
		now = append(now, m)
		keyed = append(keyed, lane)
		b.acks = append(b.acks, lane)
	}
	if len(now) > 0 {
		for i, a := range r.pub.Publish(ctx, now) {
			if keyed[i] != nil {
				r.lanes.sent(keyed[i], a)
				continue
			}
			b.acks[nowAt[i]] = a
		}
	}
	return b
}

// invalid returns the outcome of a row that can never be published as it
// is, and logs it.
func (r *Relay) invalid(row event.Row, why error) event.Outcome {
	r.log.Warn("dead-lettered invalid row", zap.Int64("row_id", row.ID), zap.String("event_id", row.EventID), zap.String("reason", why.Error()))
	o := event.Invalid(row, why.Error())
	if errors.Is(why, publish.ErrTooLarge) {
		o.Reason = event.DeadLetterTooLarge
	}
	return o
}

// message returns the message to publish for row, or why the row cannot
// be published as it is.
// (A row too large for the broker is found by the publisher, which knows
// the limits.)
func (r *Relay) message(row event.Row) (publish.Message, error) {
	m := publish.Message{Row: row}
	if row.Problem != "" {
		return m, errors.New(row.Problem)
	}
	subject, err := event.Subject(r.o.SubjectPrefix, row.EventType)
	if err != nil {
		return m, err
	}
	if err := event.ValidateEventID(row.EventID); err != nil {
		return m, err
	}
	if err := event.ValidateCreatedAt(row.CreatedAt); err != nil {
		return m, err
	}
	if row.OrderingKey != "" {
		if err := event.ValidateOrderingKey(row.OrderingKey); err != nil {
			return m, err
		}
	}
	headers, err := event.ParseHeaders(row.Headers, r.reserved...)
	if err != nil {
		return m, err
	}
	m.Subject, m.Headers, m.Format = subject, headers, r.o.Format
	return m, nil
}

// settleLoop waits for each batch's acknowledgements in order (until
// ackCtx ends) and settles them (retried until writeCtx ends): every batch
// resolved within SettleWindow after the first in one transaction, or a
// quarter of MaxInFlight rows as soon as they are resolved (with no
// window, each batch in its own). At a steady trickle of small batches
// that halves the relay's write transactions, so it takes the
// application's write lock half as often.
func (r *Relay) settleLoop(ctx, ackCtx, writeCtx context.Context) {
	// Acks are awaited apart from the window, so that a batch whose acks
	// are slow (up to relay.ack_timeout) does not hold back the settling
	// of the batches before it.
	resolved := make(chan []event.Outcome)
	go func() {
		defer close(resolved)
		for b := range r.pipeline {
			resolved <- r.resolve(ctx, ackCtx, b)
		}
	}()
	var outs []event.Outcome
	var first time.Time
	window := time.NewTimer(time.Hour)
	defer window.Stop()
	flush := func() {
		r.settle(writeCtx, outs)
		outs = nil
	}
	for {
		select {
		case o, ok := <-resolved:
			if !ok {
				flush()
				return
			}
			if len(outs) == 0 {
				first = time.Now()
				window.Reset(r.o.SettleWindow)
			}
			outs = append(outs, o...)
			// A quarter of MaxInFlight goes at once: during a drain, rows
			// waiting for the window would hold back claims.
			if time.Since(first) >= r.o.SettleWindow || len(outs) >= r.o.MaxInFlight/4 {
				flush()
			}
		case <-window.C:
			flush()
		}
	}
}

// resolve turns a batch's acknowledgements into outcomes.
func (r *Relay) resolve(ctx, waitCtx context.Context, b *batch) []event.Outcome {
	outs := b.outcomes
	for i, ack := range b.acks {
		row := b.msgs[i].Row
		res := ack.Wait(waitCtx)
		if a, ok := ack.(*laneAck); ok {
			r.sendNext(ctx, a, res)
		}
		now := r.o.Clock.Now()
		switch res.Kind {
		case publish.Stored, publish.Duplicate:
			if res.Kind == publish.Duplicate {
				r.m.Duplicates.Inc()
				if res.Err != nil {
					// Another event with this id went out within the
					// duplicate window: this one is not in the stream.
					r.log.Warn("broker dropped an event as a duplicate of another row's event with the same id",
						zap.Int64("row_id", row.ID), zap.String("event_id", row.EventID), zap.Error(res.Err))
				}
			}
			r.m.PublishDuration.Observe(time.Since(b.published).Seconds())
			r.m.DeliveryLag.Observe(max(0, time.Since(row.Created()).Seconds()))
			r.outage.answered(b.published, r.log, r.m)
			outs = append(outs, event.Outcome{Row: row, Settlement: event.Done, StreamSeq: res.Seq})
		case publish.Rejected:
			// The broker answered about this message: it is up.
			r.outage.answered(b.published, r.log, r.m)
			o := event.Reject(row, res.Err.Error(), r.o.MaxAttempts, now)
			level := zap.WarnLevel
			if publish.PermissionDenied(res.Err) && o.Settlement == event.Retry {
				level = zap.DebugLevel // the connection logs a denied subject once, not once a row
			}
			r.log.Log(level, "broker rejected event", zap.Int64("row_id", row.ID), zap.String("event_id", row.EventID),
				zap.String("subject", b.msgs[i].Subject), zap.Int("attempts", o.Attempts), zap.Stringer("next", o.Settlement), zap.Error(res.Err))
			outs = append(outs, o)
		case publish.Transport:
			if ctx.Err() != nil || waitCtx.Err() != nil {
				// Shutting down: hand the row back at once, for whoever runs next.
				outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now, Reason: metrics.DeferShutdown})
				continue
			}
			delay := r.outage.deferRow(res.Err, r.log, r.m)
			r.wakeClaimer() // the claimer may be idle: let it see the outage now
			outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now.Add(delay), Reason: metrics.DeferOutage})
		case publish.Invalid:
			outs = append(outs, r.invalid(row, res.Err))
		case publish.Withheld:
			// It waits behind its key's row that was not stored; the claim
			// takes it again once that row is published (or skipped).
			r.log.Debug("row withheld", zap.Int64("row_id", row.ID), zap.Error(res.Err))
			outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now, Reason: metrics.DeferOrdering})
		default:
			panic(fmt.Sprintf("unknown publish result %v", res.Kind))
		}
	}
	return outs
}

// sendNext sends the row of a's key after it, if a was stored and the
// next row waits for it (see lanes); after shutdown began it is not sent.
func (r *Relay) sendNext(ctx context.Context, a *laneAck, res publish.Result) {
	next, m := r.lanes.resolved(a, res, ctx.Err())
	if m != nil {
		r.lanes.sent(next, r.pub.Publish(ctx, []publish.Message{*m})[0])
	}
}

// settle writes outcomes, retrying database errors until it succeeds or
// writeCtx ends (only after shutdown began).
func (r *Relay) settle(writeCtx context.Context, outs []event.Outcome) {
	if len(outs) == 0 {
		return
	}
	retry := backoff{min: 50 * time.Millisecond, max: 2 * time.Second}
	for {
		stale, err := r.store.Settle(writeCtx, outs)
		if err == nil {
			r.settleTrouble.OK()
			r.count(outs, stale)
			break
		}
		if writeCtx.Err() != nil || r.stopIfReplaced(err) {
			r.log.Error("could not settle rows before exiting; they stay pending, and the next leader publishes them again",
				zap.Int("rows", len(outs)), zap.Error(err))
			break
		}
		r.settleTrouble.Fail(err)
		sleep(writeCtx, retry.next())
	}
	r.lanes.settled(outs, r.claimSeq.Load())
	r.m.InFlight.Set(float64(r.inflight.Add(-int64(len(outs)))))
	var bytes int64
	for _, o := range outs {
		bytes += int64(len(o.Row.Payload))
	}
	r.inflightBytes.Add(-bytes)
	signal(r.settled)
}

// count updates the metrics for the outcomes that were written; stale ones
// changed nothing.
func (r *Relay) count(outs []event.Outcome, stale []int) {
	if len(stale) > 0 {
		r.log.Warn("rows not settled: this relay lost the lead, or the rows changed meanwhile; the leader publishes what is still pending", zap.Int("rows", len(stale)))
	}
	for i, o := range outs {
		if len(stale) > 0 && stale[0] == i {
			stale = stale[1:]
			continue
		}
		switch o.Settlement {
		case event.Done:
			r.m.Published.Inc()
		case event.Retry:
			r.m.Retries.Inc()
		case event.DeadLetter:
			r.m.DeadLettered.WithLabelValues(o.Reason).Inc()
		case event.Release:
			r.m.Deferred.WithLabelValues(o.Reason).Inc()
		}
	}
}

// waitBroker waits until every in-flight row is settled, then probes the
// broker with a growing interval until it answers, and ends the outage. A
// connection closed for good is returned: no probe can succeed.
func (r *Relay) waitBroker(ctx context.Context) error {
	for r.inflight.Load() > 0 {
		// The settles may wait for a long time (the application holds the
		// lock); a connection closed for good ends the relay meanwhile, and
		// Run bounds the writes still to come (the rows stay pending).
		if err := r.pub.Ready(ctx); errors.Is(err, publish.ErrClosed) {
			return err
		}
		t := time.NewTimer(time.Second)
		ok := wait(ctx, r.settled, t.C)
		t.Stop()
		if !ok {
			return nil
		}
	}
	for ctx.Err() == nil {
		sleep(ctx, r.outage.probeDelay())
		err := r.probe(ctx)
		if err == nil {
			// Not over yet: the next publish tells (a full stream, say,
			// answers every probe and refuses every message).
			r.outage.probeOK()
			return nil
		}
		if errors.Is(err, publish.ErrClosed) {
			return err
		}
		r.outage.update(err)
	}
	return nil
}

// probe asks the broker whether it takes publishes.
func (r *Relay) probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return r.o.Ready(ctx)
}

// heartbeatLoop keeps this instance visibly alive and reclaims the claims
// of dead relays and expired leases.
func (r *Relay) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(r.o.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := r.beat(ctx)
		if r.stopIfReplaced(err) {
			continue
		}
		if err != nil {
			if ctx.Err() == nil {
				r.beatTrouble.Fail(err)
			}
			continue
		}
		r.beatTrouble.OK()
		r.reclaimed(n)
		r.lead()
	}
}

// lead follows the store's answer to who leads, logging changes.
func (r *Relay) lead() {
	leads := r.o.Lead.Leads()
	said := r.roleSaid.Swap(true)
	if r.leading.Swap(leads) == leads && said {
		return
	}
	if leads {
		r.m.Leader.Set(1)
		r.log.Info("leading: this relay claims and publishes the rows")
		signal(r.led)
		return
	}
	r.m.Leader.Set(0)
	r.log.Info("standing by: another relay of this outbox table leads")
}

// outageState tracks a broker outage; it is shared by the settler (which
// detects outages and their end) and the claimer (which waits them out).
// When a probe succeeds the outage is half open: the claimer publishes one
// row, and only a publish made after that which succeeds ends the outage.
type outageState struct {
	mu       sync.Mutex
	since    time.Time
	last     error
	repeats  int       // outages since the last successful publish
	open     time.Time // when the outage became half open; zero: closed
	probes   int       // probes since the outage began
	deferred int       // rows deferred since the outage began
}

// maxDefer is the longest an outage defers a row (see begin).
const maxDefer = time.Minute

// active reports an outage that is not half open: nothing may be claimed.
func (o *outageState) active() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return !o.since.IsZero() && o.open.IsZero()
}

// halfOpen reports an outage whose probe succeeded: one row may go.
func (o *outageState) halfOpen() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return !o.since.IsZero() && !o.open.IsZero()
}

func (o *outageState) err() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.since.IsZero() {
		return nil
	}
	return fmt.Errorf("broker unavailable for %s: %v", time.Since(o.since).Round(time.Second), o.last)
}

// begin records a transport failure and returns how long the row waits
// before it may be claimed again: 1 s, doubling with every outage that
// follows without a successful publish in between, capped at one minute.
// A failure while half open closes the outage again, silently.
func (o *outageState) begin(err error, log *zap.Logger, m *metrics.Metrics) time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.last = err
	o.open = time.Time{}
	if o.since.IsZero() {
		o.since = time.Now()
		o.repeats++
		o.probes, o.deferred = 0, 0
		m.BrokerConnected.Set(0)
		log.Warn("broker unavailable; pausing without spending attempts", zap.Error(err))
	}
	return min(time.Second<<min(o.repeats-1, 6), maxDefer)
}

// deferRow records a row put back because of the outage and returns how
// long it waits (see begin).
func (o *outageState) deferRow(err error, log *zap.Logger, m *metrics.Metrics) time.Duration {
	d := o.begin(err, log, m)
	o.mu.Lock()
	o.deferred++
	o.mu.Unlock()
	return d
}

// nothingToTry ends a half-open outage when there is no row to try: none
// was deferred (the outage began with a probe, at startup say), or every
// deferred row would have been due by now (another relay took them).
func (o *outageState) nothingToTry(log *zap.Logger, m *metrics.Metrics) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.since.IsZero() || o.open.IsZero() || (o.deferred > 0 && time.Since(o.open) < maxDefer) {
		return
	}
	o.endLocked(log, m)
}

func (o *outageState) endLocked(log *zap.Logger, m *metrics.Metrics) {
	log.Info("broker recovered; resuming", zap.Duration("outage", time.Since(o.since).Round(time.Millisecond)))
	o.since, o.open, o.repeats = time.Time{}, time.Time{}, 0
	m.BrokerConnected.Set(1)
}

func (o *outageState) update(err error) {
	o.mu.Lock()
	o.last = err
	o.mu.Unlock()
}

// probeDelay is how long to wait before the next probe: none before the
// first of an outage, then 250 ms doubling to 5 s, also across half-open
// tries that failed.
func (o *outageState) probeDelay() time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.probes++
	if o.probes == 1 {
		return 0
	}
	return min(250*time.Millisecond<<min(o.probes-2, 5), 5*time.Second)
}

func (o *outageState) probeOK() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.since.IsZero() && o.open.IsZero() {
		o.open = time.Now()
	}
}

// answered records a publish made at published that the broker took or
// refused on its merits. It ends a half-open outage when the publish was
// made after it opened.
func (o *outageState) answered(published time.Time, log *zap.Logger, m *metrics.Metrics) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.since.IsZero() {
		o.repeats = 0
		return
	}
	if o.open.IsZero() || published.Before(o.open) {
		return
	}
	o.endLocked(log, m)
}

// stopIfReplaced ends the claim loop when err says the database file was
// replaced (Run then returns it and writes nothing more), and reports it.
func (r *Relay) stopIfReplaced(err error) bool {
	if !errors.Is(err, event.ErrDatabaseReplaced) {
		return false
	}
	r.halt(err)
	return true
}

// backoff doubles from min to max.
type backoff struct {
	min, max, cur time.Duration
}

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.min
	} else {
		b.cur = min(2*b.cur, b.max)
	}
	return b.cur
}

func (b *backoff) reset() { b.cur = 0 }

// signal sends on a one-slot channel without blocking.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// wait blocks until ch or timer fires (true) or ctx ends (false).
func wait(ctx context.Context, ch <-chan struct{}, timer <-chan time.Time) bool {
	select {
	case <-ctx.Done():
		return false
	case <-ch:
	case <-timer:
	}
	return true
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
