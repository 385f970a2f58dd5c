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
	// Settle writes outcomes, and scanFrom when above 0 (see
	// claim.Store.Settle); stale lists those whose claim was lost.
	Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) (stale []int, err error)
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
	// StillLeads reports whether this relay leads now, read without the
	// write lock (see Relay.leadSure).
	StillLeads(ctx context.Context) (bool, error)
	// Leave removes this relay's heartbeat row, and with it the lead.
	Leave(ctx context.Context) error
}

// Publisher is the NATS side (implemented by *publish.JetStream and *publish.Core).
type Publisher interface {
	Publish(ctx context.Context, msgs []publish.Message) []publish.Ack
	// Ready reports why the broker cannot take publishes, or nil.
	Ready(ctx context.Context) error
}

// Batcher publishes several rows of one ordering key as one atomic batch,
// all or none and in order (*publish.JetStream). A Publisher that is one
// sends a key's rows in batches where many wait (see lanes).
type Batcher interface {
	// BatchRoom is how many messages a batch sent now may hold; 0: send
	// one at a time.
	BatchRoom() int
	// PublishBatch starts publishing msgs as one batch, one Ack each.
	PublishBatch(ctx context.Context, msgs []publish.Message) []publish.Ack
	// PublishGroup starts publishing msgs, an atomic group's rows, as one
	// batch or not at all, one Ack each (see publish.JetStream.PublishGroup).
	PublishGroup(ctx context.Context, msgs []publish.Message) []publish.Ack
}

// Options tune the loop. Zero intervals disable the corresponding timer so
// tests can drive the loop by hand.
type Options struct {
	// A row's subject is SubjectPrefix, its event type, then
	// SubjectSuffix ("" or starting with "."): see natsname.Subjects.
	SubjectPrefix, SubjectSuffix string
	// Format adds a message format's headers (CloudEvents); a row's own
	// headers may not set them.
	Format           publish.Format
	BatchSize        int
	MaxInFlight      int
	MaxInFlightBytes int           // payload bytes claimed and not yet acknowledged at most (large payloads); 0: no limit
	PollInterval     time.Duration // fallback claim timer when no wake-up comes
	WatchInterval    time.Duration // commit detection: the fallback poll of PRAGMA data_version
	// Watch announces commits to the database (sqlitedb.DB.Watch) until
	// ctx ends: on foreign those of other connections than the relay's own
	// writer, on any every commit. Without it, or with a zero
	// WatchInterval, the relay polls.
	Watch func(ctx context.Context, interval time.Duration, foreign chan<- struct{}, any ...chan<- struct{}) error
	// Budget, when set, is room in flight shared with other relays (a
	// fleet's files): a claim waits its turn for it, within this relay's
	// own MaxInFlight and MaxInFlightBytes.
	Budget *Budget
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
	// Reconcile, when set, runs each time this relay begins to lead,
	// before it claims a row: it settles the rows whose messages the
	// stream holds already (package reconcile). From then on settles
	// write where the messages of the rows not settled can begin
	// (Store.Settle's scanFrom). An error is an outage when the broker
	// does not answer, else retried.
	Reconcile func(ctx context.Context) (Reconciled, error)
	// Backlog, when set, is called when a claim finds more due rows than
	// it takes (procs.Governor.Backlog).
	Backlog func()
	// Started, when set, is called once, when the relay's start is over:
	// its first claim is made (it leads, reached the broker and
	// reconciled), or it stands by, or the broker is out.
	Started func()
	// Clock gives the times of retries and deferrals; share the store's.
	Clock   *event.Clock
	Metrics *metrics.Metrics
	Log     *zap.Logger
}

// Relay moves outbox rows to the broker.
type Relay struct {
	store     Store
	pub       Publisher
	batcher   Batcher // pub, when it publishes atomic batches; else nil
	o         Options
	log       *zap.Logger
	m         *metrics.Metrics
	lastClaim atomic.Int64 // when a claim last took rows (Unix ns)
	// This file's shares of the gauges a fleet's files sum.
	inFlightGauge, leaderGauge *metrics.Part

	wake     chan struct{} // a commit or a reclaim happened: claim now
	commits  chan struct{} // a commit happened (for Commits)
	settled  chan struct{} // in-flight rows were settled: room to claim
	room     chan struct{} // payload in flight went below its budget's three quarters
	led      chan struct{} // this relay became the leader
	leading  atomic.Bool
	beaten   atomic.Int64  // the latest heartbeat that committed, since monoBase (see leadSure)
	roleSaid atomic.Bool   // the role was logged once
	heldSaid atomic.Bool   // held atomic groups were logged once
	pipeline *fifo[*batch] // claimer -> settler, in publish order
	lanes    *lanes        // rows with an ordering key
	claimSeq atomic.Uint64 // claims begun, for lanes
	// Reconciliations asked for (at start, on losing the lead, ...) and
	// the latest one done: Options.Reconcile ran since the latest ask when
	// they are equal (see reconcile).
	reconcileAsked, reconcileDone atomic.Uint64
	// rowsBefore is the highest row id when the latest reconciliation
	// began: a row above it was not published by an earlier relay.
	rowsBefore atomic.Int64
	// maxSeq is the highest stream sequence of a message found stored:
	// every message sent after it was found is stored above it.
	maxSeq   atomic.Uint64
	pins     pins // rows whose message may be stored, though not settled done
	held     heldSubjects
	markAt   time.Time // when a settle last wrote the stream position (settle loop)
	inflight atomic.Int64
	// inflightBytes is the payload held by rows claimed and not yet
	// acknowledged (see release).
	inflightBytes atomic.Int64
	running       atomic.Bool
	watching      atomic.Bool // the commit watch runs: commits are announced
	outage        outageState
	// One trouble log per database operation, so that one that keeps
	// failing is logged once while the others succeed.
	claimTrouble, settleTrouble, beatTrouble, reconcileTrouble *episode.Log
	// halt ends the claim loop with a cause that Run returns (set by Run).
	halt context.CancelCauseFunc
	// started calls Options.Started, once.
	started func()
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
	// floor is maxSeq when the batch was claimed: its messages, however
	// late they are sent (a key's next row), are stored above it.
	floor uint64
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
		room:     make(chan struct{}, 1),
		led:      make(chan struct{}, 1),
		pipeline: newFIFO[*batch](),
		lanes:    newLanes(),
		reserved: o.Format.Reserved(),
	}
	r.batcher, _ = pub.(Batcher)
	r.started = func() {}
	if o.Started != nil {
		r.started = sync.OnceFunc(o.Started)
	}
	r.inFlightGauge, r.leaderGauge = metrics.NewPart(r.m.InFlight), metrics.NewPart(r.m.Leader)
	trouble := func(op string) *episode.Log {
		return episode.New(o.Log.With(zap.String("operation", op)), zap.WarnLevel, "database unavailable; retrying", "database available again")
	}
	r.claimTrouble, r.settleTrouble, r.beatTrouble = trouble("claim"), trouble("settle"), trouble("heartbeat")
	r.reconcileTrouble = episode.New(o.Log, zap.WarnLevel, "cannot reconcile the stream with the outbox; publishing nothing until it can, retrying", "reconciling again")
	r.pins.rows = map[int64]uint64{}
	r.reconcileAsked.Store(1)
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

// LastClaim returns when a claim last took rows (zero: never).
func (r *Relay) LastClaim() time.Time {
	if ns := r.lastClaim.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// InFlight returns how many rows are claimed and not yet settled.
func (r *Relay) InFlight() int64 { return r.inflight.Load() }

// Leads reports whether this relay leads on its file.
func (r *Relay) Leads() bool { return r.o.HeartbeatInterval == 0 || r.leading.Load() }

// Paused reports the current broker outage, if any (for /readyz).
func (r *Relay) Paused() error { return r.outage.err() }

// Held reports the subjects the stream refuses at its
// max_msgs_per_subject, whose rows wait, if any, for /readyz.
func (r *Relay) Held() error { return r.held.err() }

// DatabaseError reports the error of a database operation that keeps
// failing (claiming or settling rows, heartbeating), if any, for /readyz.
// An error that only says the application held the lock (event.ErrBusy)
// comes last, so that it cannot hide another.
func (r *Relay) DatabaseError() error {
	claimErr, settleErr := r.claimTrouble.Err(), r.settleTrouble.Err()
	// The heartbeat is a standby's only write: a table gone shows there.
	for _, err := range []error{claimErr, settleErr, r.beatTrouble.Err()} {
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
	defer r.leaderGauge.Set(0) // it left the lead, if it had it

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
	r.pipeline.close()
	<-settlerDone
	// Whatever the settler did not give back (nothing, as it settles
	// every row claimed) is not held by this relay any more.
	r.o.Budget.give(room{rows: r.inflight.Load(), bytes: r.inflightBytes.Load()})
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
