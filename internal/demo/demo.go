// Package demo is the quickstart: an application that writes its own data
// and an event in one transaction at a steady rate, beside a running
// relay, with a live progress line. It is also the compose file's example
// application (WriteEvents).
package demo

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
)

// eventTypes are what the demo application emits.
var eventTypes = []string{"ReviewLogged", "ReviewEdited", "WatchlistItemAdded", "MovieDiscovered", "movie.enrichment.requested"}

// Run serves a's HTTP endpoints, prints where to look, and runs the
// application (rate events a second) and the relay until ctx ends; then
// the relay drains what the application wrote (for 5 s at most) and a
// summary is printed. The database and the JetStream data stay in dir.
func Run(ctx context.Context, a *daemon.App, cfg config.Config, rate int, dir string, out io.Writer, log *zap.Logger) error {
	httpAddr, stopHTTP, err := a.ServeHTTP()
	if err != nil {
		return err
	}
	defer stopHTTP()

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
		written, err = WriteEvents(ctx, cfg.Database.Path, cfg.Database.Table, rate, func(err error) {
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
		if b, err := housekeeping.Backlog(context.Background(), a.DB(), false); err == nil && b.Pending+b.Processing == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	stopRelay()
	err = <-relayErr
	fmt.Fprintln(out)
	b, _ := housekeeping.Backlog(context.Background(), a.DB(), false)
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
		b, err := housekeeping.Backlog(ctx, a.DB(), false)
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
