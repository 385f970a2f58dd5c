// Command worker is the consumer half of the outbox-relay demo: it handles
// the events the relay publishes with the ledger package (docs/ledger.md),
// which skips the events a handler has handled and commits a handler's
// writes to the application's SQLite file with that record.
//
// Run it beside the demo, in a second terminal:
//
//	go run ./cmd/outbox-relay demo --dir /tmp/outbox-relay-demo --nats-embedded-listen 127.0.0.1:4222 --consumer-durable worker --consumer-create
//	go run ./examples/worker
//
// It registers two handlers: movie-stats counts each ReviewLogged event
// into the movie_stats table, in the transaction that marks the event done
// (exactly once), and watchlist-mailer stands in for an email on each
// WatchlistItemAdded event (at least once: it only logs). Events of other
// types have no handler and are acknowledged as they come.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	_ "github.com/mattn/go-sqlite3"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/ledger"
)

// options are the worker's flags; the defaults match the demo started as
// in the package comment.
type options struct {
	NATSURL       string
	DB            string
	Stream        string
	Durable       string
	SubjectPrefix string
	MetricsListen string
	Concurrency   int
}

var defaults = options{
	NATSURL:       "nats://127.0.0.1:4222",
	DB:            "/tmp/outbox-relay-demo/app.db",
	Stream:        "EVENTS",
	Durable:       "worker",
	SubjectPrefix: "events",
	MetricsListen: "127.0.0.1:9109",
	Concurrency:   4,
}

// The settings outbox-relay gives the consumer by default: max_deliver is
// relay.max_attempts, ack_wait is consumer.ack_wait.
const (
	maxDeliver = 10
	ackWait    = 30 * time.Second
)

func main() {
	var o options
	flag.StringVar(&o.NATSURL, "nats-url", defaults.NATSURL, "NATS server (the demo's, with --nats-embedded-listen 127.0.0.1:4222)")
	flag.StringVar(&o.DB, "db", defaults.DB, "the application's SQLite file (the demo's is <--dir>/app.db)")
	flag.StringVar(&o.Stream, "stream", defaults.Stream, "the relay's stream (stream.name)")
	flag.StringVar(&o.Durable, "durable", defaults.Durable, "durable pull consumer on the stream (consumer.durable)")
	flag.StringVar(&o.SubjectPrefix, "subject-prefix", defaults.SubjectPrefix, "the relay's stream.subject_prefix")
	flag.StringVar(&o.MetricsListen, "metrics-listen", defaults.MetricsListen, "serve Prometheus /metrics on this address; empty disables")
	flag.IntVar(&o.Concurrency, "concurrency", defaults.Concurrency, "messages handled at once")
	flag.Parse()

	log := newLogger()
	defer log.Sync()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o, prometheus.NewRegistry(), log); err != nil {
		log.Error("worker stopped", zap.Error(err))
		os.Exit(1)
	}
}

// run handles events until ctx ends, then lets the handlers that are
// running finish and returns nil.
func run(ctx context.Context, o options, reg *prometheus.Registry, log *zap.Logger) error {
	// The ledger's claims are short writes beside the application's own:
	// a busy timeout, WAL, and immediate transactions for HandleTx.
	db, err := sql.Open("sqlite3", "file:"+o.DB+"?mode=rw&_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close()
	// The relay creates processed_events with the outbox table (the demo,
	// or outbox-relay migrate); wait for it rather than create the file.
	err = waitFor(ctx, log, "the ledger table in "+o.DB+" (start the demo, or run outbox-relay migrate)", func() error {
		_, err := db.ExecContext(ctx, `SELECT 1 FROM `+ledger.Table+` LIMIT 1`)
		return err
	})
	if err != nil {
		return nil // stopped while waiting
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS movie_stats (
	movie       TEXT PRIMARY KEY,
	reviews     INTEGER NOT NULL,
	stars_total INTEGER NOT NULL
)`); err != nil {
		return fmt.Errorf("create movie_stats: %w", err)
	}

	h, err := ledger.NewHandlers(ledger.New(db, ledger.Options{}), reg)
	if err != nil {
		return err
	}
	register(h, log)

	nc, err := nats.Connect(o.NATSURL, nats.Name("outbox-relay example worker"),
		nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: closed by the worker
				log.Warn("nats disconnected; reconnecting", zap.Error(err))
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("nats reconnected", zap.String("url", nc.ConnectedUrlRedacted())) }))
	if err != nil {
		return fmt.Errorf("connect to %s: %w", o.NATSURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	var cons jetstream.Consumer
	err = waitFor(ctx, log, "stream "+o.Stream+" on "+o.NATSURL, func() error {
		cons, err = consumer(ctx, js, o)
		return err
	})
	if err != nil {
		return nil // stopped while waiting
	}

	if o.MetricsListen != "" {
		stopMetrics, err := serveMetrics(o.MetricsListen, reg, log)
		if err != nil {
			return err
		}
		defer stopMetrics()
	}

	w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{
		SubjectPrefix: o.SubjectPrefix,
		Concurrency:   o.Concurrency,
		Log:           log,
	})
	if err != nil {
		return err
	}
	log.Info("worker running", zap.String("stream", o.Stream), zap.String("consumer", o.Durable),
		zap.Strings("event_types", h.Types()), zap.String("database", o.DB))
	if err := w.Run(ctx); err != nil {
		return err // the consumer was deleted, or the connection closed for good
	}
	// Send the last acknowledgements before the connection closes; those
	// that do not arrive are redelivered after ack_wait, and skipped.
	if nc.IsConnected() {
		if err := nc.FlushTimeout(5 * time.Second); err != nil {
			log.Warn("flush the last acknowledgements", zap.Error(err))
		}
	}
	log.Info("worker stopped: every handler that was running has finished")
	return nil
}

// review is the payload of the demo's review events.
type review struct {
	Movie string `json:"movie"`
	Stars int    `json:"stars"`
}

// register adds the example's handlers. A handler's name keys its ledger
// rows: keep it stable across releases.
func register(h *ledger.Handlers, log *zap.Logger) {
	// Exactly once: the row written through tx commits with the done mark,
	// or neither does. Write only through tx here (never through the
	// *sql.DB), and keep it short: tx holds the file's write lock.
	h.HandleTx("ReviewLogged", "movie-stats", func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		var r review
		if err := json.Unmarshal(ev.Data, &r); err != nil {
			return fmt.Errorf("payload is not a review: %w", err)
		}
		if r.Movie == "" {
			return fmt.Errorf("review of no movie: %s", ev.Data)
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO movie_stats (movie, reviews, stars_total) VALUES (?, 1, ?)
ON CONFLICT (movie) DO UPDATE SET reviews = reviews + 1, stars_total = stars_total + excluded.stars_total`, r.Movie, r.Stars)
		return err
	})
	// At least once: an effect outside the file (an email, an HTTP call)
	// runs again if the process dies before the done mark, so the
	// receiving end must tolerate a repeat (pass ev.ID as its
	// idempotency key).
	h.Handle("WatchlistItemAdded", "watchlist-mailer", func(ctx context.Context, ev ledger.Event) error {
		log.Info("would email the watchlist owner", zap.String("event_id", ev.ID), zap.ByteString("payload", ev.Data))
		return nil
	})
}

// consumer binds the durable pull consumer, creating it if it is missing.
//
// In production outbox-relay manages this consumer: with consumer.durable
// (and consumer.create to create it) it keeps max_deliver at
// relay.max_attempts and ack_wait at consumer.ack_wait, and records the
// messages the consumer gives up on. Creating it here only lets the
// example run beside a demo started without those flags; the settings
// are the ones the relay would choose by default.
func consumer(ctx context.Context, js jetstream.JetStream, o options) (jetstream.Consumer, error) {
	s, err := js.Stream(ctx, o.Stream)
	if err != nil {
		return nil, err
	}
	c, err := s.Consumer(ctx, o.Durable)
	if !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return c, err
	}
	return s.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:       o.Durable,
		AckPolicy:     jetstream.AckExplicitPolicy,
		FilterSubject: o.SubjectPrefix + ".>",
		MaxDeliver:    maxDeliver,
		AckWait:       ackWait,
	})
}

// waitFor calls try every second until it succeeds, logging each new
// reason it fails for; it returns ctx's error if ctx ends first.
func waitFor(ctx context.Context, log *zap.Logger, what string, try func() error) error {
	for last := ""; ; {
		err := try()
		if err == nil {
			return nil
		}
		if err.Error() != last {
			last = err.Error()
			log.Info("waiting for "+what, zap.Error(err))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// serveMetrics serves reg on addr until the returned function is called.
func serveMetrics(addr string, reg *prometheus.Registry, log *zap.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listen %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	log.Info("serving metrics", zap.String("url", "http://"+ln.Addr().String()+"/metrics"))
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	}, nil
}

func newLogger() *zap.Logger {
	enc := zap.NewDevelopmentEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	return zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(os.Stderr), zapcore.InfoLevel))
}
