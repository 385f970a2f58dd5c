// Package demo is the quickstart: an application that writes its own data
// and an event in one transaction at a steady rate, beside a running
// relay, with a live progress line, on a configuration made the demo's
// (Prepare). It is also the compose file's example application (App,
// WriteEvents).
package demo

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/natsname"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// eventTypes are what the demo application emits.
var eventTypes = []string{"ReviewLogged", "ReviewEdited", "WatchlistItemAdded", "MovieDiscovered", "movie.enrichment.requested"}

// Options say how the demo runs.
type Options struct {
	Rate            int    // events the application writes a second
	Dir             string // where the database and the JetStream data stay
	Out             io.Writer
	Live            bool // Out is a terminal: the progress line is rewritten in place
	Log             *zap.Logger
	Version, Commit string // of the build
	// Metrics are the relay's, whose delivery lag the progress line shows
	// (a new set when nil).
	Metrics *metrics.Metrics
}

// Run starts the relay on cfg (an in-process JetStream server when
// nats.url is "embedded"), prints where to look, and runs the application
// (o.Rate events a second) and the relay until ctx ends; then the relay
// drains what the application wrote (for 5 s at most) and a summary is
// printed. The database and the JetStream data stay in o.Dir.
func Run(ctx context.Context, cfg config.Config, o Options) error {
	if cfg.NATS.URL == config.EmbeddedURL {
		dir := cfg.NATS.Embedded.StoreDir
		if dir == "" {
			dir = cfg.Database.Path + ".nats"
		}
		emb, err := publish.StartEmbedded(cfg.NATS.Embedded.Listen, dir)
		if err != nil {
			return err
		}
		defer emb.Shutdown()
		cfg.NATS.URL = emb.URL()
	}
	var ln net.Listener
	if cfg.Metrics.Listen != "" {
		var err error
		if ln, err = net.Listen("tcp", cfg.Metrics.Listen); err != nil {
			return fmt.Errorf("metrics.listen %s: %w", cfg.Metrics.Listen, err)
		}
	}
	if o.Metrics == nil {
		o.Metrics = metrics.New(o.Version, o.Commit)
	}
	a, err := daemon.Open(ctx, cfg, o.Log, daemon.Options{CreateDB: true, Version: o.Version, Commit: o.Commit, Listener: ln, Metrics: o.Metrics})
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		return err
	}
	defer a.Close()
	// The demo reads the rows it counts from the database, as an operator
	// would, and the lag from the relay's metric, as a dashboard would.
	db, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout, ReadOnly: true})
	if err != nil {
		return err
	}
	defer db.Close()
	m := &meter{db: db, lag: o.Metrics.DeliveryLag}
	if err := m.start(ctx); err != nil {
		return err
	}
	banner(o.Out, cfg, ln, o.Rate)

	// The relay outlives the application by a moment, to drain what it wrote.
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRelay()
	relayErr := make(chan error, 1)
	go func() { relayErr <- a.Run(relayCtx) }()
	var written int64
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		var err error
		written, err = WriteEvents(ctx, cfg.Database.Path, cfg.Database.Table, o.Rate, func(err error) {
			o.Log.Warn("demo application write failed", zap.Error(err))
		})
		if err != nil {
			o.Log.Error("demo application stopped", zap.Error(err))
		}
	}()
	progress(ctx, o.Out, o.Live, a, m)
	<-writerDone
	drain(db)
	stopRelay()
	err = <-relayErr
	fmt.Fprintln(o.Out)
	m.summary(o.Out, written, o.Dir)
	return err
}

// banner prints where the demo's parts are and how to look at them.
func banner(out io.Writer, cfg config.Config, ln net.Listener, rate int) {
	shownURL := natsname.RedactURLs(cfg.NATS.URL) // credentials are never printed
	fmt.Fprintf(out, "outbox-relay demo\n")
	fmt.Fprintf(out, "  database  %s (table %s)\n", cfg.Database.Path, cfg.Database.Table)
	subjects := cfg.Stream.SubjectPrefix + ".<event_type>"
	if tmpl, err := natsname.ParseTemplate(cfg.Stream.SubjectTemplate); err == nil {
		if s, err := tmpl.Subjects(cfg.Stream.SubjectPrefix, fleet.Tenant(cfg.Database.Path)); err == nil {
			subjects = s.Prefix + ".<event_type>" + s.Suffix
		}
	}
	fmt.Fprintf(out, "  nats      %s (stream %s, subjects %s)\n", shownURL, cfg.Stream.Name, subjects)
	if ln != nil {
		fmt.Fprintf(out, "  metrics   http://%s/metrics\n", ln.Addr())
	}
	fmt.Fprintf(out, "Look at the stream with the nats CLI (github.com/nats-io/natscli) while it runs:\n")
	fmt.Fprintf(out, "  nats --server %s stream info %s\n", shownURL, cfg.Stream.Name)
	fmt.Fprintf(out, "  nats --server %s stream view %s\n", shownURL, cfg.Stream.Name)
	fmt.Fprintf(out, "  nats --server %s sub '%s.>'\n", shownURL, cfg.Stream.SubjectPrefix)
	fmt.Fprintf(out, "avg lag is from a row's created_at to the broker's ack, over the last second (%s_delivery_lag_seconds).\n", metrics.Namespace)
	fmt.Fprintf(out, "The application writes %d events/s. Press Ctrl-C to stop.\n", rate)
}

// drain waits, for 5 s at most, until the relay has published every row.
func drain(db *sqlitedb.DB) {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if b, err := housekeeping.Backlog(context.Background(), db, false); err == nil && b.Pending+b.Processing == 0 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// progress prints one line a second until ctx ends: rows published (done)
// and how many in the last second, the backlog, the average delivery lag
// over the last second, and whether the relay is ready.
func progress(ctx context.Context, out io.Writer, tty bool, a *daemon.App, m *meter) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r, err := m.read(ctx)
		if err != nil {
			continue
		}
		state := "flowing"
		if err := a.Ready(ctx); err != nil {
			state = "not ready: " + err.Error()
		}
		line := fmt.Sprintf("published %8d  (%5d/s)  backlog %6d  avg lag %8s  dead-lettered %d  %s",
			r.published, r.rate, r.backlog, lagText(r.lag), r.deadLettered, state)
		if tty {
			fmt.Fprintf(out, "\r%-110s", line)
		} else {
			fmt.Fprintln(out, line)
		}
	}
}

// WriteEvents is the demo application: each "request" writes its own
// data and its event in one transaction, the transactional outbox. One event
// in ten has no event_id, as a foreign writer's might; the relay assigns one.
func WriteEvents(ctx context.Context, path, table string, rate int, onErr func(error)) (written int64, err error) {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		return 0, err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS reviews (id INTEGER PRIMARY KEY, movie TEXT NOT NULL, stars INTEGER NOT NULL)`); err != nil {
		return 0, err
	}
	insertEvent := fmt.Sprintf(`INSERT INTO %s (event_id, event_type, payload) VALUES (?, ?, ?)`, table)
	movies := []string{"Alien", "Heat", "Ran", "Stalker", "Vertigo", "Brazil", "Paprika"}
	t := time.NewTicker(time.Second / time.Duration(min(rate, 1000)))
	defer t.Stop()
	start := time.Now()
	for {
		select {
		case <-ctx.Done():
			return written, nil
		case <-t.C:
		}
		// Pace by elapsed time, so ticker jitter does not lower the rate.
		due := int64(time.Since(start).Seconds()*float64(rate)) - written
		for i := int64(0); i < due; i++ {
			movie, stars := movies[rand.IntN(len(movies))], 1+rand.IntN(5)
			payload, _ := json.Marshal(map[string]any{"movie": movie, "stars": stars, "at": time.Now().UTC()})
			var id any = event.NewID()
			if rand.IntN(10) == 0 {
				id = nil
			}
			err := writeOne(ctx, db, insertEvent, movie, stars, id, eventTypes[rand.IntN(len(eventTypes))], payload)
			if err != nil {
				if ctx.Err() != nil {
					return written, nil
				}
				onErr(err)
				break
			}
			written++
		}
	}
}

// writeOne writes one request's review and its event in one transaction.
func writeOne(ctx context.Context, db *sql.DB, insertEvent, movie string, stars int, id any, eventType string, payload []byte) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT INTO reviews (movie, stars) VALUES (?, ?)`, movie, stars); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, insertEvent, id, eventType, payload); err != nil {
		return err
	}
	return tx.Commit()
}
