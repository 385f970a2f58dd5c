// Package daemon is the relay's composition root: it opens the database,
// the broker connection (or an embedded server), the publisher, the relay
// loop and its housekeeping, and serves /metrics, /healthz and /readyz, with
// the policies that tie them together: reconciling the stream when the
// broker first answers and whenever the stream disappears, what readiness
// means, and recording messages a consumer gave up on.
package daemon

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/claim"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/lead"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/natsname"
	"github.com/outbox-relay/outbox-relay/internal/procs"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// Internal timings that are not worth a config key.
const (
	watchInterval      = 100 * time.Millisecond // commit detection: file notifications do the work; this is the fallback poll
	heartbeatInterval  = time.Second
	statsInterval      = 5 * time.Second // backlog gauges
	retentionInterval  = time.Minute
	checkpointInterval = 2 * time.Millisecond   // WAL checkpoints follow commits, at most one per interval (relay.Options)
	settleWindow       = 200 * time.Millisecond // batches acknowledged within it share a settle transaction
	// maxInFlightBytes bounds the payload in memory: with large payloads
	// the row count alone (relay.max_in_flight) would hold hundreds of MB.
	maxInFlightBytes = 8 << 20
)

// staleAfter is how long a relay may go without a heartbeat before its
// claims are taken for a dead relay's: a crash is recovered in about this
// long. A heartbeat held up by the application's lock does not count (see
// lead.Lease.Heartbeat), so it need not cover database.busy_timeout.
const staleAfter = 6 * time.Second

// App is a wired relay: database, broker, publisher, loop and HTTP.
type App struct {
	cfg      config.Config
	log      *zap.Logger
	metrics  *metrics.Metrics
	embedded *publish.Embedded
	natsURL  string
	db       *sqlitedb.DB
	claims   *claim.Store
	store    relay.Store // claims, as the relay sees it (Options.Test)
	lease    *lead.Lease
	// origin is the outbox table's Outbox-Origin (JetStream mode).
	origin string
	recon  reconciliation
	// readFilter is the subjects the reconciliation reads: the file's
	// own when its subjects begin with its tenant.
	readFilter string
	// remaining is this file's share of the reconcile_remaining gauge.
	remaining *metrics.Part
	// unreadableSaid: the stream's refusal of the reconciliation's
	// consumer was logged.
	unreadableSaid atomic.Bool
	conn           *publish.Conn
	sharedConn     bool               // Options.Conn: the fleet's, not closed by Close
	opened         time.Time          // when Open returned (see Idle)
	js             *publish.JetStream // nil in core mode
	pub            relay.Publisher
	relay          *relay.Relay
	keeper         *housekeeping.Keeper
	synced         atomic.Bool // the stream was reconciled since start, by this relay or before it (sync)
	// sync is what the process knows of the stream's reconciliation:
	// the fleet's, shared by its files, or this relay's own.
	sync *streamSync
	// atomicSaid: the atomic batch mode was logged (see noteAtomic).
	atomicSaid atomic.Bool
	stream     streamState
	version    string
	listener   net.Listener // Options.Listener
}

// Options vary what Open does for the commands that share it.
type Options struct {
	CreateDB        bool   // create a missing database file (demo)
	Version, Commit string // of the build, for metrics and heartbeats
	// Metrics are recorded on, when set; else a new set of its own.
	Metrics *metrics.Metrics
	// Listener, when set, serves /metrics, /healthz and /readyz instead of
	// metrics.listen (the caller chose the address); Run closes it.
	Listener net.Listener
	// Conn, when set, is the broker connection to publish on (a fleet's,
	// shared by its files): Open neither connects nor starts an embedded
	// server, and Close leaves it open.
	Conn *publish.Conn
	// Tenant, when set, is the tenant of a fleet's file: its messages
	// carry it (Outbox-Tenant) and stream.subject_template's {tenant}
	// is it.
	Tenant string
	// Gauges, when set, are the file's shares of the backlog gauges,
	// kept by a fleet while the file is closed (housekeeping.NewGauges).
	Gauges *housekeeping.Gauges
	// Budget, when set, is the room in flight the file's relay shares
	// with the fleet's other files (relay.max_in_flight and the payload
	// budget are the fleet's, not each file's).
	Budget *relay.Budget
	// Procs, when set, is told of the claims that find a backlog (the
	// process's GOMAXPROCS follows them).
	Procs *procs.Governor
	// Started, when set, is called once the relay's start is over (see
	// relay.Options.Started).
	Started func()
	// Locked is told what holds the database file while Open waits for
	// it to be free (nil once it is).
	Locked func(error)
	// Test reaches into the wiring; nil in production.
	Test *TestHooks
	// sync, when set, is the fleet's: its files share the stream's
	// reconciliation.
	sync *streamSync
	// notifications, when set, are the fleet's notifications of the
	// file's commits (sqlitedb.Options.Notifications).
	notifications func(wal string) (<-chan fsnotify.Event, func())
	// sweeps, when set, is where the file's retention stands, which a
	// fleet keeps while the file is closed (housekeeping.Options.Sweeps).
	sweeps *housekeeping.Sweeps
}

// TestHooks are for tests of the whole wiring, as outbox-relay run wires
// it: they shorten its timings, inject faults and follow the relay's
// state. Production leaves Options.Test nil; each nil hook changes nothing.
type TestHooks struct {
	// Tune adjusts the options Open derived from the configuration
	// (shorter heartbeats, say).
	Tune func(*relay.Options, *housekeeping.Options)
	// The wrappers stand between the relay and its store, lead or
	// publisher (injected faults).
	WrapStore     func(relay.Store) relay.Store
	WrapLead      func(relay.Lead) relay.Lead
	WrapPublisher func(relay.Publisher) relay.Publisher
	// Clock replaces the clock the database and the relay share.
	Clock *event.Clock
	// IdleAfter, when set, replaces how long a fleet's file stays open
	// idle.
	IdleAfter time.Duration
	// MaxOpen, when set, replaces how many of a fleet's files are open
	// at once.
	MaxOpen int
	// Rescan, when set, replaces a fleet's periodic fallbacks to its
	// notifications: how often it matches its pattern again, and how
	// long a file it could not serve waits, unchanged, to be tried again.
	Rescan time.Duration
	// Tried, when set, is called as a fleet's try to serve a file ends,
	// with how it ended, before the fleet takes note.
	Tried func(path string, err error)
	// Looked, when set, is called as a fleet opens a closed file to look
	// at its rows.
	Looked func(path string)
	// KeepClosed, when set, replaces how often a fleet's file closed
	// while idle has its housekeeping.
	KeepClosed time.Duration
	// Rewatch, when set, is called as a fleet begins to watch a directory
	// that replaced the watched one.
	Rewatch func()
	// Scanning, when set, is called as a fleet begins to match its
	// pattern, after it looked at the directory and moved its watch.
	Scanning func()
	// Relay is given the relay Open built, whose state tests follow.
	Relay func(*relay.Relay)
}

// newMetrics returns the process's metrics, with the stream patches' series
// at 0 before the first patch (a fleet's before its first file opens).
func newMetrics(oo Options) *metrics.Metrics {
	m := metrics.New(oo.Version, oo.Commit)
	for _, field := range streamsync.ManagedFields {
		m.StreamConfigPatched.WithLabelValues(field)
	}
	return m
}

// Open wires everything the daemon needs; on error it closes what it opened.
func Open(ctx context.Context, cfg config.Config, log *zap.Logger, oo Options) (_ *App, err error) {
	a := &App{cfg: cfg, log: log, metrics: oo.Metrics, natsURL: cfg.NATS.URL, version: oo.Version, listener: oo.Listener, sync: oo.sync}
	if a.sync == nil {
		a.sync = newStreamSync()
	}
	if a.metrics == nil {
		a.metrics = newMetrics(oo)
	}
	defer func() {
		if err != nil {
			a.Close()
		}
	}()
	if oo.Conn != nil {
		a.conn, a.sharedConn, a.natsURL = oo.Conn, true, oo.Conn.NC.ConnectedUrlRedacted()
	} else if a.embedded, a.natsURL, err = startEmbedded(cfg, cfg.Database.Path+".nats", log); err != nil {
		return nil, err
	}
	hooks := oo.Test
	if hooks == nil {
		hooks = &TestHooks{}
	}
	// The store and the loop share one clock that never steps back.
	clock := hooks.Clock
	if clock == nil {
		clock = event.NewClock(nil)
	}
	if a.db, err = sqlitedb.Open(ctx, sqlitedb.Options{
		Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout, Create: oo.CreateDB,
		OwnCheckpoints: true, Clock: clock,
		// A fleet's other files keep the process busy while a commit's
		// notification waits for the rest of its writes.
		GatherCommitWrites: oo.Budget != nil,
		Notifications:      oo.notifications,
		// A file held locked against readers (an application in
		// locking_mode=EXCLUSIVE) is waited out, saying who holds it, as a
		// busy writer is.
		LockWait: -1, Log: log.Named("database"), Locked: oo.Locked,
	}); err != nil {
		return nil, err
	}
	if err = applySchema(ctx, a.db, cfg.Schema.Mode, log); err != nil {
		return nil, sqlitedb.NotWritable(a.db.Path(), err)
	}
	deleteDone := cfg.Retention.DoneRows == config.DoneRowsDelete
	if deleteDone {
		switch problem, err := schema.DeleteDoneProblem(ctx, a.db); {
		case err != nil:
			return nil, err
		case problem != "":
			return nil, &config.Error{Err: fmt.Errorf("retention.done_rows: delete: %s", problem)}
		}
	}
	a.lease = lead.New(a.db)
	a.claims = claim.New(a.db, claim.Options{
		DeleteDone:      deleteDone,
		Fence:           a.lease,
		Rescan:          cfg.Relay.PollInterval,
		SkipDeadLetters: !cfg.Ordering.Parks(),
		// A busy key may fill half the pipeline; the other keys share the rest.
		KeyDepth: max(1, cfg.Relay.MaxInFlight/2),
		Stream:   cfg.Stream.Name,
	})
	subjects, err := subjectsOf(cfg, oo.Tenant)
	if err != nil {
		return nil, err
	}
	a.readFilter = subjects.ReadFilter(cfg.Stream.SubjectPrefix)
	if a.conn == nil {
		if a.conn, err = connectBroker(ctx, cfg, a.natsURL, log); err != nil {
			return nil, err
		}
	}
	if cfg.NATS.Mode == config.ModeCore {
		log.Warn("nats.mode is core: fire-and-forget publishing with no broker dedup and no redelivery")
		a.pub = publish.NewCore(a.conn, cfg.Relay.AckTimeout)
	} else {
		if a.js, err = publish.NewJetStream(a.conn, cfg.Stream.Name, cfg.Relay.MaxInFlight, cfg.Relay.AckTimeout); err != nil {
			return nil, err
		}
		a.pub = a.js
		if a.origin, err = reconcile.Origin(ctx, a.db); err != nil {
			return nil, sqlitedb.NotWritable(a.db.Path(), err)
		}
		a.lease.ReportBatches(a.js.BatchLimit)
		a.js.OnFallback = func(reason string) { a.metrics.AtomicBatchFallbacks.WithLabelValues(reason).Inc() }
	}
	ro := relay.Options{
		SubjectPrefix: subjects.Prefix, SubjectSuffix: subjects.Suffix,
		Format: publish.Format{CloudEvents: cfg.Message.Format == config.FormatCloudEvents,
			Source: cfg.Message.Source, ContentType: cfg.Message.ContentType, Origin: a.origin, Tenant: oo.Tenant},
		BatchSize:         cfg.Relay.BatchSize,
		MaxInFlight:       cfg.Relay.MaxInFlight,
		MaxInFlightBytes:  maxInFlightBytes,
		Budget:            oo.Budget,
		PollInterval:      cfg.Relay.PollInterval,
		WatchInterval:     watchInterval,
		Watch:             a.db.Watch,
		Lead:              a.lease,
		HeartbeatInterval: heartbeatInterval,
		StaleAfter:        staleAfter,
		Lease:             cfg.Relay.Lease,
		MaxAttempts:       cfg.Relay.MaxAttempts,
		ShutdownTimeout:   cfg.Relay.ShutdownTimeout,
		Version:           oo.Version,
		SettleWindow:      settleWindow,
		Ready:             a.brokerReady,
		Clock:             clock,
		Backlog:           oo.Procs.Backlog,
		Started:           oo.Started,
		Metrics:           a.metrics,
		Log:               log.Named("relay"),
	}
	ko := housekeeping.Options{
		StatsInterval:         statsInterval,
		RetentionInterval:     retentionInterval,
		RetainDone:            cfg.Retention.Done,
		RetainProcessedEvents: cfg.Retention.ProcessedEvents,
		Gauges:                oo.Gauges,
		Sweeps:                oo.sweeps,
		CheckpointInterval:    checkpointInterval,
		Metrics:               a.metrics,
		Log:                   log.Named("relay"),
	}
	if a.js != nil {
		ro.Reconcile = a.reconcile
	}
	if hooks.Tune != nil {
		hooks.Tune(&ro, &ko)
	}
	a.store = a.claims
	if hooks.WrapStore != nil {
		a.store = hooks.WrapStore(a.store)
	}
	if hooks.WrapLead != nil {
		ro.Lead = hooks.WrapLead(ro.Lead)
	}
	pub := a.pub
	if hooks.WrapPublisher != nil {
		pub = hooks.WrapPublisher(pub)
	}
	a.remaining = metrics.NewPart(a.metrics.ReconcileRemaining)
	a.relay = relay.New(a.store, pub, ro)
	if hooks.Relay != nil {
		hooks.Relay(a.relay)
	}
	ko.Commits, ko.Watching, ko.LastClaim = a.relay.Commits(), a.relay.Watching, a.relay.LastClaim
	a.keeper = housekeeping.New(housekeeping.OnFile(a.db, cfg.Ordering.Parks()), ko)
	a.opened = time.Now()
	return a, nil
}

// startEmbedded starts the in-process server when nats.url is embedded,
// its store in nats.embedded.store_dir or else defaultDir; it returns the
// URL to connect to (nats.url when no server is started).
func startEmbedded(cfg config.Config, defaultDir string, log *zap.Logger) (*publish.Embedded, string, error) {
	if cfg.NATS.URL != config.EmbeddedURL {
		return nil, cfg.NATS.URL, nil
	}
	dir := cmp.Or(cfg.NATS.Embedded.StoreDir, defaultDir)
	e, err := publish.StartEmbedded(cfg.NATS.Embedded.Listen, dir)
	if err != nil {
		return nil, "", err
	}
	log.Info("started embedded jetstream server", zap.String("url", e.URL()), zap.String("store_dir", dir))
	return e, e.URL(), nil
}

// connectBroker connects to the broker at url (nats.url, or the embedded
// server's) with cfg's settings.
func connectBroker(ctx context.Context, cfg config.Config, url string, log *zap.Logger) (*publish.Conn, error) {
	o := ConnectOptions(cfg.NATS, "outbox-relay")
	o.URLs = url
	return publish.Connect(ctx, o, log.Named("nats"))
}

// subjectsOf returns the subjects of the rows of cfg's database file,
// tenant's when it is a fleet's (else the file's name is, for {tenant}).
func subjectsOf(cfg config.Config, tenant string) (natsname.Subjects, error) {
	tmpl, err := natsname.ParseTemplate(cfg.Stream.SubjectTemplate)
	if err != nil {
		return natsname.Subjects{}, &config.Error{Err: fmt.Errorf("stream.subject_template: %w", err)}
	}
	if tenant == "" {
		tenant = fleet.Tenant(cfg.Database.Path)
	}
	subjects, err := tmpl.Subjects(cfg.Stream.SubjectPrefix, tenant)
	if err != nil {
		return subjects, &config.Error{Err: fmt.Errorf("%s: stream.subject_template %s: %w (rename the file)", cfg.Database.Path, cfg.Stream.SubjectTemplate, err)}
	}
	return subjects, nil
}

// applySchema does what schema.mode says.
func applySchema(ctx context.Context, s *sqlitedb.DB, mode string, log *zap.Logger) error {
	switch mode {
	case config.SchemaAuto:
		applied, err := schema.Migrate(ctx, s)
		if err != nil {
			return err
		}
		if len(applied) > 0 {
			log.Info("applied schema migrations", zap.Ints("versions", applied), zap.String("table", s.Table()))
		}
	case config.SchemaVerify:
		return schema.Verify(ctx, s)
	case config.SchemaOff:
		// Nothing is changed, but a schema the relay cannot run on would
		// never heal by waiting: its rows would only fail, or never be
		// claimed.
		if err := schema.TableExists(ctx, s); err != nil {
			return fmt.Errorf("%w (schema.mode is off, so the relay does not create it: create it, or use schema.mode auto)", err)
		}
		return checkSchemaOff(ctx, s, log)
	}
	return nil
}

// Ready is /readyz: the database answers, the broker is connected and the
// stream takes the relay's subjects. The reason names the part that is not.
func (a *App) Ready(ctx context.Context) error {
	if err := a.db.Ping(ctx); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	if err := a.relay.DatabaseError(); err != nil && !errors.Is(err, event.ErrBusy) {
		// A lock held by the application passes; anything else (a dropped
		// table, a file that turned read-only) does not heal by waiting.
		return fmt.Errorf("database: %w", err)
	}
	if a.js != nil {
		// Before the pause it causes, which would read as an outage.
		if err := a.streamConfigError(); err != nil {
			return fmt.Errorf("stream: %w", err)
		}
	}
	if err := a.relay.Paused(); err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	if err := a.relay.Held(); err != nil {
		return fmt.Errorf("stream: %w", err)
	}
	if err := a.reconcileStatus(); err != nil {
		return err
	}
	if err := a.pub.Ready(ctx); err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	if denied := a.conn.DeniedSubjects(); len(denied) > 0 {
		return fmt.Errorf("broker: permission denied on subject %s: rows on it are rejected (grant this user publish on %s.>)",
			strings.Join(denied, ", "), a.cfg.Stream.SubjectPrefix)
	}
	if a.js != nil {
		if err := a.examineStream(ctx); err != nil {
			return fmt.Errorf("broker: %w", err)
		}
	}
	return nil
}

// Live is /healthz: the relay's loops run.
func (a *App) Live(context.Context) error {
	if !a.relay.Running() {
		return errors.New("relay loops are not running")
	}
	return nil
}

// serveHTTP starts /metrics, /healthz and /readyz on Options.Listener or
// metrics.listen (none if neither is set) until stop is called; stop
// waits for the server to end.
func (a *App) serveHTTP() (stop func(), err error) {
	return serveHTTP(a.listener, a.cfg.Metrics.Listen, a.log, a.metrics.Handler(a.Live, a.Ready, a.role))
}

// serveHTTP serves h on ln, or else on listen (nothing if it is empty),
// until stop is called; stop waits for the server to end.
func serveHTTP(ln net.Listener, listen string, log *zap.Logger, h http.Handler) (stop func(), err error) {
	if ln == nil {
		if listen == "" {
			return func() {}, nil
		}
		if ln, err = net.Listen("tcp", listen); err != nil {
			return nil, fmt.Errorf("metrics.listen %s: %w", listen, err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	wait := metrics.Serve(ctx, ln, h)
	log.Info("serving metrics", zap.Stringer("listen", ln.Addr()))
	return func() { cancel(); wait() }, nil
}

// Run serves HTTP, follows the consumer's advisories and runs the relay
// and its housekeeping until ctx ends (see relay.Relay.Run).
func (a *App) Run(ctx context.Context) error {
	stop, err := a.serveHTTP()
	if err != nil {
		return err
	}
	defer stop()
	if a.js != nil && a.cfg.Consumer.Durable != "" && !a.sharedConn {
		defer beside(ctx, func(ctx context.Context) {
			watchExhausted(ctx, a.conn.NC, a.js.API(), a.cfg, a.onExhausted, a.log)
		})()
	}
	if a.js != nil {
		defer beside(ctx, a.watchStream)()
	}
	a.log.Info("relay starting", zap.String("database", a.cfg.Database.Path), zap.String("table", a.cfg.Database.Table),
		zap.String("nats", natsname.RedactURLs(a.natsURL)), zap.String("mode", a.cfg.NATS.Mode), zap.String("stream", a.cfg.Stream.Name),
		zap.String("instance", a.lease.Instance()), zap.String("version", a.version))
	// Housekeeping runs as long as the relay does.
	defer beside(ctx, a.keeper.Run)()
	return a.relay.Run(ctx)
}

// beside runs fn in a goroutine of its own until ctx ends or the returned
// stop is called; stop returns once fn has.
func beside(ctx context.Context, fn func(context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); fn(ctx) }()
	return func() { cancel(); <-done }
}

// onExhausted records a message the consumer gave up on (see
// recordExhausted) in the file.
func (a *App) onExhausted(e streamsync.Exhausted) { recordExhausted(a.db, a.metrics, a.log, e) }

// Close releases everything Open opened, in reverse order, and
// Options.Listener.
func (a *App) Close() {
	if a.listener != nil {
		a.listener.Close() // closed already if Run served it
	}
	if a.js != nil {
		a.js.Close() // a fleet's connection lives on
	}
	if a.conn != nil && !a.sharedConn {
		a.conn.Close()
	}
	if a.db != nil {
		a.db.Close()
	}
	if a.embedded != nil {
		a.embedded.Shutdown()
	}
}
