package main

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestWorkerBesideTheRelay runs the example as the README does, beside a
// relay configured like the demo (stream EVENTS, prefix events, consumer
// worker created by the relay): events the application commits reach the
// handlers, movie_stats counts each review once, and a replay of the whole
// stream (the consumer deleted and created again by the worker) runs no
// handler a second time.
func TestWorkerBesideTheRelay(t *testing.T) {
	n := testenv.StartNATS(t)
	path := filepath.Join(t.TempDir(), "app.db")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	cfg := config.Default()
	cfg.Database.Path = path
	cfg.NATS.URL = n.URL()
	cfg.Metrics.Listen = ""
	cfg.Consumer.Durable, cfg.Consumer.Create = "worker", true
	a, err := daemon.Open(ctx, cfg, zaptest.NewLogger(t).Named("relay"), daemon.Options{CreateDB: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- a.Run(relayCtx) }()
	defer func() { stopRelay(); <-relayDone }()

	// The application: reviews of two movies, watchlist items, an event
	// no handler takes, and one review without an id (the relay gives it
	// one).
	app := testenv.AppDB(t, path)
	var evs []testenv.Event
	want := map[string][2]int{} // movie: reviews, stars
	for i := range 20 {
		movie, stars := []string{"Heat", "Ran"}[i%2], 1+i%5
		evs = append(evs, testenv.NewEvent("ReviewLogged", fmt.Appendf(nil, `{"movie":%q,"stars":%d}`, movie, stars)))
		want[movie] = [2]int{want[movie][0] + 1, want[movie][1] + stars}
	}
	evs = append(evs, testenv.Event{EventType: "ReviewLogged", Payload: []byte(`{"movie":"Heat","stars":5}`)})
	want["Heat"] = [2]int{want["Heat"][0] + 1, want["Heat"][1] + 5}
	for range 3 {
		evs = append(evs, testenv.NewEvent("WatchlistItemAdded", []byte(`{"movie":"Alien"}`)))
	}
	evs = append(evs, testenv.NewEvent("MovieDiscovered", []byte(`{"movie":"Brazil"}`)))
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}

	o := options{NATSURL: n.URL(), DB: path, Stream: "EVENTS", Durable: "worker", SubjectPrefix: "events", Concurrency: 4}
	js := n.JetStream(t)
	runWorker := func(reg *prometheus.Registry) {
		t.Helper()
		wctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- run(wctx, o, reg, zaptest.NewLogger(t).Named("worker")) }()
		testenv.Eventually(t, 20*time.Second, "the consumer to hand out and see acknowledged every event", func() bool {
			c, err := js.Consumer(ctx, "EVENTS", "worker")
			if err != nil {
				return false
			}
			info, err := c.Info(ctx)
			return err == nil && info.Delivered.Stream == uint64(len(evs)) && info.NumPending == 0 && info.NumAckPending == 0
		})
		stop()
		if err := <-done; err != nil {
			t.Fatalf("worker: %v", err)
		}
	}

	reg := prometheus.NewRegistry()
	runWorker(reg)
	checkStats(t, app, want)
	checkHandled(t, reg, map[string]float64{"movie-stats/handled": 21, "watchlist-mailer/handled": 3})
	var done int
	if err := app.QueryRow(`SELECT count(*) FROM processed_events WHERE status = 'done'`).Scan(&done); err != nil || done != 24 {
		t.Fatalf("processed_events: %d rows done (%v); want 24", done, err)
	}

	// A replay delivers every event again: the ledger skips them all.
	if err := js.DeleteConsumer(ctx, "EVENTS", "worker"); err != nil {
		t.Fatal(err)
	}
	reg = prometheus.NewRegistry()
	runWorker(reg)
	checkStats(t, app, want)
	checkHandled(t, reg, map[string]float64{"movie-stats/skipped": 21, "watchlist-mailer/skipped": 3})
}

// checkStats compares movie_stats with want (movie: reviews, stars).
func checkStats(t *testing.T, db *sql.DB, want map[string][2]int) {
	t.Helper()
	rows, err := db.Query(`SELECT movie, reviews, stars_total FROM movie_stats`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := map[string][2]int{}
	for rows.Next() {
		var movie string
		var reviews, stars int
		if err := rows.Scan(&movie, &reviews, &stars); err != nil {
			t.Fatal(err)
		}
		got[movie] = [2]int{reviews, stars}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("movie_stats %v; want %v", got, want)
	}
}

// checkHandled compares the nonzero outbox_ledger_handled_total series
// (handler/outcome) with want.
func checkHandled(t *testing.T, reg *prometheus.Registry, want map[string]float64) {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != "outbox_ledger_handled_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			if v := m.GetCounter().GetValue(); v != 0 {
				labels := map[string]string{}
				for _, l := range m.GetLabel() {
					labels[l.GetName()] = l.GetValue()
				}
				got[labels["handler"]+"/"+labels["outcome"]] = v
			}
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("outbox_ledger_handled_total %v; want %v", got, want)
	}
}

// TestDefaultsMatchTheDemo: the worker's defaults are the relay's defaults
// (stream, prefix, the consumer's settings), and the demo command in the
// README and docs/ledger.md starts the demo where the worker looks for it.
func TestDefaultsMatchTheDemo(t *testing.T) {
	cfg := config.Default()
	if defaults.Stream != cfg.Stream.Name || defaults.SubjectPrefix != cfg.Stream.SubjectPrefix {
		t.Errorf("stream %s, prefix %s; the relay's defaults are %s, %s", defaults.Stream, defaults.SubjectPrefix, cfg.Stream.Name, cfg.Stream.SubjectPrefix)
	}
	if maxDeliver != cfg.Relay.MaxAttempts || ackWait != cfg.Consumer.AckWait {
		t.Errorf("max_deliver %d, ack_wait %s; the relay's defaults are %d, %s", maxDeliver, ackWait, cfg.Relay.MaxAttempts, cfg.Consumer.AckWait)
	}
	u, err := url.Parse(defaults.NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	demo := fmt.Sprintf("go run ./cmd/outbox-relay demo --dir %s --nats-embedded-listen %s --consumer-durable %s --consumer-create",
		filepath.Dir(defaults.DB), u.Host, defaults.Durable)
	for _, page := range []string{"../../README.md", "../../docs/ledger.md"} {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), demo) || !strings.Contains(string(b), "go run ./examples/worker") {
			t.Errorf("%s does not start the demo and the worker with\n%s\ngo run ./examples/worker", page, demo)
		}
	}
}
