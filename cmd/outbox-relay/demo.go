package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
)

func (c *cli) demoCommand() *cobra.Command {
	var (
		dir      string
		rate     int
		duration time.Duration
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Quickstart: embedded JetStream, a demo database, an application writing events, live progress",
		Long: `demo runs the whole job with no NATS installed: an in-process JetStream server,
a demo SQLite database, a writer that inserts events the way an application
does (its data and the outbox row in one transaction), and the relay, with a
live progress line until Ctrl-C.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rate < 1 {
				return usagef("--rate must be at least 1")
			}
			cfg, err := c.loadConfig()
			if err != nil {
				return err
			}
			return c.demo(cmd, cfg, dir, rate, duration)
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory for the demo database and JetStream data (default: a new temporary directory)")
	cmd.Flags().IntVar(&rate, "rate", 200, "events the demo application writes per second")
	cmd.Flags().DurationVar(&duration, "duration", 0, "stop after this long (default: run until Ctrl-C)")
	return cmd
}

// demoEventTypes are what the demo application emits.
var demoEventTypes = []string{"ReviewLogged", "ReviewEdited", "WatchlistItemAdded", "MovieDiscovered", "movie.enrichment.requested"}

func (c *cli) demo(cmd *cobra.Command, cfg config.Config, dir string, rate int, duration time.Duration) error {
	if dir == "" {
		d, err := os.MkdirTemp("", "outbox-relay-demo-")
		if err != nil {
			return err
		}
		dir = d
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	def := config.Default()
	cfg.Database.Path = filepath.Join(dir, "app.db")
	if cfg.NATS.URL == def.NATS.URL {
		cfg.NATS.URL = config.EmbeddedURL
	}
	if cfg.NATS.Embedded.StoreDir == "" {
		cfg.NATS.Embedded.StoreDir = filepath.Join(dir, "nats")
	}
	if cfg.Metrics.Listen == def.Metrics.Listen {
		cfg.Metrics.Listen = "127.0.0.1:0"
	}
	if !cmd.Flags().Changed("log-level") && os.Getenv(config.EnvName("log.level")) == "" {
		cfg.Log.Level = "warn" // keep the progress line readable
	}
	if !cmd.Flags().Changed("log-format") && os.Getenv(config.EnvName("log.format")) == "" {
		cfg.Log.Format = "console"
	}
	log, ctx, stop, err := c.start(cfg)
	if err != nil {
		return err
	}
	defer stop()
	if duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, duration)
		defer cancel()
	}
	a, err := daemon.Open(ctx, cfg, log, daemon.Options{CreateDB: true, Version: version, Commit: buildCommit()})
	if err != nil {
		return err
	}
	defer a.Close()
	httpAddr, stopHTTP, err := a.ServeHTTP()
	if err != nil {
		return err
	}
	defer stopHTTP()

	out := c.stdout
	shownURL := config.RedactURLs(a.NATSURL()) // credentials are never printed
	fmt.Fprintf(out, "outbox-relay demo\n")
	fmt.Fprintf(out, "  database  %s (table %s)\n", cfg.Database.Path, cfg.Database.Table)
	fmt.Fprintf(out, "  nats      %s (stream %s, subjects %s.<event_type>)\n", shownURL, cfg.Stream.Name, cfg.Stream.SubjectPrefix)
	if httpAddr != "" {
		fmt.Fprintf(out, "  metrics   http://%s/metrics\n", httpAddr)
	}
	fmt.Fprintf(out, "Look at the stream with the nats CLI (github.com/nats-io/natscli) while it runs:\n")
	fmt.Fprintf(out, "  nats --server %s stream info %s\n", shownURL, cfg.Stream.Name)
	fmt.Fprintf(out, "  nats --server %s stream view %s\n", shownURL, cfg.Stream.Name)
	fmt.Fprintf(out, "  nats --server %s sub '%s.>'\n", shownURL, cfg.Stream.SubjectPrefix)
	fmt.Fprintf(out, "The application writes %d events/s. Press Ctrl-C to stop.\n", rate)

	// The relay outlives the application by a moment, to drain what it wrote.
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRelay()
	relayErr := make(chan error, 1)
	go func() { relayErr <- a.RunRelay(relayCtx) }()
	var written int64
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		var err error
		written, err = writeDemoEvents(ctx, cfg.Database.Path, cfg.Database.Table, rate, func(err error) {
			log.Warn("demo application write failed", zap.Error(err))
		})
		if err != nil {
			log.Error("demo application stopped", zap.Error(err))
		}
	}()
	progress(ctx, out, a)
	<-writerDone
	drainDeadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(drainDeadline) {
		if b, err := a.Store().Backlog(context.Background()); err == nil && b.Pending+b.Processing == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	stopRelay()
	err = <-relayErr
	fmt.Fprintln(out)
	b, _ := a.Store().Backlog(context.Background())
	fmt.Fprintf(out, "demo stopped: the application wrote %d events, the relay published %.0f, %d not yet published, %d dead-lettered; data kept in %s\n",
		written, metrics.Value(a.Metrics().Published), b.Pending+b.Processing, b.DeadLettered, dir)
	return err
}

// progress prints one live line per second until ctx ends.
func progress(ctx context.Context, out io.Writer, a *daemon.App) {
	tty := isTerminal(out)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	var lastPub, lastLagSum, lastLagCount float64
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pub := metrics.Value(a.Metrics().Published)
		lagSum, lagCount := histogram(a.Metrics())
		lag := "-"
		if n := lagCount - lastLagCount; n > 0 {
			lag = (time.Duration((lagSum - lastLagSum) / n * float64(time.Second))).Round(100 * time.Microsecond).String()
		}
		b, err := a.Store().Backlog(ctx)
		if err != nil {
			continue
		}
		state := "flowing"
		if err := a.Relay().Paused(); err != nil {
			state = "paused: " + err.Error()
		}
		line := fmt.Sprintf("published %8.0f  (%5.0f/s)  backlog %6d  avg lag %8s  dead-lettered %d  %s",
			pub, pub-lastPub, b.Pending+b.Processing, lag, b.DeadLettered, state)
		if tty {
			fmt.Fprintf(out, "\r%-110s", line)
		} else {
			fmt.Fprintln(out, line)
		}
		lastPub, lastLagSum, lastLagCount = pub, lagSum, lagCount
	}
}

func histogram(m *metrics.Metrics) (sum, count float64) {
	return metrics.HistogramSumCount(m.DeliveryLag)
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// writeDemoEvents is the demo application: each "request" writes its own
// data and its event in one transaction, the transactional outbox. One event
// in ten has no event_id, as a foreign writer's might; the relay assigns one.
func writeDemoEvents(ctx context.Context, path, table string, rate int, onErr func(error)) (written int64, err error) {
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
			err := inTx(ctx, db, func(tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, `INSERT INTO reviews (movie, stars) VALUES (?, ?)`, movie, stars); err != nil {
					return err
				}
				_, err := tx.ExecContext(ctx, insertEvent, id, demoEventTypes[rand.IntN(len(demoEventTypes))], payload)
				return err
			})
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

func inTx(ctx context.Context, db *sql.DB, fn func(*sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		tx.Rollback()
		return err
	}
	return tx.Commit()
}
