package daemon

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// openTest opens an App on a fresh database against n, runs it until the
// test ends, and returns it.
func openTest(t *testing.T, n *testenv.NATS, mutate func(*config.Config)) (*App, config.Config) {
	t.Helper()
	return openTestLog(t, n, zap.NewNop(), mutate)
}

// openTestLog is openTest logging to log.
func openTestLog(t *testing.T, n *testenv.NATS, log *zap.Logger, mutate func(*config.Config)) (*App, config.Config) {
	t.Helper()
	cfg := config.Default()
	cfg.Database.Path = testenv.NewDB(t)
	cfg.NATS.URL = n.URL()
	cfg.Metrics.Listen = ""
	if mutate != nil {
		mutate(&cfg)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a, err := Open(ctx, cfg, log, Options{Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		a.Close()
	})
	return a, cfg
}

// TestStreamReconciledWhenItDisappears: the stream is created when the
// broker first answers; deleted while the relay runs, /readyz says so, and
// the next row's failed publish makes the relay's probe create it again
// and publish the row.
func TestStreamReconciledWhenItDisappears(t *testing.T) {
	n := testenv.StartNATS(t)
	a, cfg := openTest(t, n, nil)
	ctx := context.Background()
	testenv.Eventually(t, 20*time.Second, "ready once the stream is created", func() bool { return a.Ready(ctx) == nil })
	js := n.JetStream(t)
	if err := js.DeleteStream(ctx, cfg.Stream.Name); err != nil {
		t.Fatal(err)
	}
	if err := a.Ready(ctx); err == nil {
		t.Fatal("/readyz passes with the stream deleted")
	}
	app := testenv.AppDB(t, cfg.Database.Path)
	testenv.InsertN(t, app, 1, "AfterDelete")
	testenv.Eventually(t, 30*time.Second, "the row published into a recreated stream", func() bool {
		return testenv.Counts(t, app)["done"] == 1
	})
	if err := a.Ready(ctx); err != nil {
		t.Fatalf("/readyz after the stream came back: %v", err)
	}
	if err := streamsync.Check(ctx, js, Want(cfg)); err != nil {
		t.Fatalf("the recreated stream: %v", err)
	}
}

// TestStandbyNotReadyWithoutTheTable: the outbox table renamed away under
// a leader and its standby: both answer /readyz not ready, the standby too
// (it claims nothing, but its heartbeat finds no table), naming it.
func TestStandbyNotReadyWithoutTheTable(t *testing.T) {
	n := testenv.StartNATS(t)
	ctx := context.Background()
	leader, cfg := openTest(t, n, nil)
	testenv.Eventually(t, 20*time.Second, "the leader ready", func() bool { return leader.Ready(ctx) == nil })
	standby, _ := openTest(t, n, func(c *config.Config) { c.Database.Path = cfg.Database.Path })
	testenv.Eventually(t, 20*time.Second, "the standby standing by", func() bool {
		return standby.Ready(ctx) == nil && strings.Contains(standby.relay.Role(), "standing by")
	})
	testenv.MustExec(t, testenv.AppDB(t, cfg.Database.Path), `ALTER TABLE event_queue RENAME TO event_queue_old`)
	for name, a := range map[string]*App{"leader": leader, "standby": standby} {
		testenv.Eventually(t, 20*time.Second, "the "+name+" not ready, naming the table", func() bool {
			err := a.Ready(ctx)
			return err != nil && strings.Contains(err.Error(), "no such table: event_queue")
		})
	}
}

// TestExhaustedRecordedOnce: a message a consumer gave up on is recorded,
// counted and logged once, however many times its advisory arrives.
func TestExhaustedRecordedOnce(t *testing.T) {
	n := testenv.StartNATS(t)
	a, cfg := openTest(t, n, nil)
	e := streamsync.Exhausted{EventID: "e-1", Stream: cfg.Stream.Name, Consumer: "workers", StreamSeq: 42, Subject: "events.T", Deliveries: 5}
	a.onExhausted(e)
	a.onExhausted(e)
	if got := metrics.Value(a.metrics.ConsumerExhausted); got != 1 {
		t.Fatalf("consumer_exhausted_total %v after the same advisory twice, want 1", got)
	}
	var rows int
	app := testenv.AppDB(t, cfg.Database.Path)
	if err := app.QueryRow(`SELECT count(*) FROM outbox_relay_exhausted WHERE stream_seq = 42`).Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("%d exhausted rows (%v), want 1", rows, err)
	}
}

// TestReconciledWhenTheBrokerFirstAnswers: started while the broker is
// down, the relay is not ready and publishes nothing; once the broker
// answers, the stream it finds (an operator's, with the server's 2-minute
// duplicate window) gets the relay's window, counted and with the
// operator's other fields kept, and the rows go out.
func TestReconciledWhenTheBrokerFirstAnswers(t *testing.T) {
	n := testenv.StartNATS(t)
	ctx := context.Background()
	if _, err := n.JetStream(t).CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"},
		Duplicates: 2 * time.Minute, Description: "the operator's"}); err != nil {
		t.Fatal(err)
	}
	n.Stop()
	a, cfg := openTest(t, n, nil)
	app := testenv.AppDB(t, cfg.Database.Path)
	testenv.InsertN(t, app, 3, "WhileDown")
	testenv.Eventually(t, 20*time.Second, "not ready, saying it is the broker", func() bool {
		err := a.Ready(ctx)
		return err != nil && strings.HasPrefix(err.Error(), "broker: ")
	})
	if c := testenv.Counts(t, app); c["done"] != 0 {
		t.Fatalf("rows published with the broker down: %v", c)
	}
	n.Restart()
	testenv.Eventually(t, 30*time.Second, "the rows published", func() bool { return testenv.Counts(t, app)["done"] == 3 })
	testenv.Eventually(t, 20*time.Second, "ready", func() bool { return a.Ready(ctx) == nil })
	s, err := n.JetStream(t).Stream(ctx, cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.CachedInfo().Config; got.Duplicates != time.Hour || got.Description != "the operator's" {
		t.Fatalf("stream after reconciling: duplicate window %v, description %q; want 1h and the operator's", got.Duplicates, got.Description)
	}
	if got := metrics.Value(a.metrics.StreamConfigPatched.WithLabelValues("duplicate_window")); got != 1 {
		t.Fatalf("stream_config_patched_total{field=duplicate_window} = %v, want 1", got)
	}
}

// TestReadinessSaysWhichPartIsNot: /readyz names the database when the
// outbox table is gone (a claim fails on something waiting cannot heal)
// and the broker when its connection is down.
func TestReadinessSaysWhichPartIsNot(t *testing.T) {
	n := testenv.StartNATS(t)
	a, cfg := openTest(t, n, nil)
	ctx := context.Background()
	testenv.Eventually(t, 20*time.Second, "ready", func() bool { return a.Ready(ctx) == nil })
	app := testenv.AppDB(t, cfg.Database.Path)
	testenv.MustExec(t, app, `ALTER TABLE event_queue RENAME TO event_queue_gone`)
	testenv.Eventually(t, 20*time.Second, "not ready: the database", func() bool {
		err := a.Ready(ctx)
		return err != nil && strings.HasPrefix(err.Error(), "database: ") && strings.Contains(err.Error(), "no such table")
	})
	testenv.MustExec(t, app, `ALTER TABLE event_queue_gone RENAME TO event_queue`)
	testenv.Eventually(t, 20*time.Second, "ready again", func() bool { return a.Ready(ctx) == nil })
	n.Stop()
	testenv.Eventually(t, 20*time.Second, "not ready: the broker", func() bool {
		err := a.Ready(ctx)
		return err != nil && strings.HasPrefix(err.Error(), "broker: ")
	})
	n.Restart()
	testenv.Eventually(t, 30*time.Second, "ready once the broker is back", func() bool { return a.Ready(ctx) == nil })
}

// TestFleetRecordsExhaustedInTheTenantsFile: a fleet records a message
// its consumer gave up on in the file its Outbox-Tenant names, once
// however many times the advisory arrives; one naming no file of the
// fleet is counted and logged, and recorded nowhere.
func TestFleetRecordsExhaustedInTheTenantsFile(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	for _, tenant := range []string{"acme", "globex"} {
		if err := os.Rename(testenv.NewDB(t), filepath.Join(dir, tenant+".db")); err != nil {
			t.Fatal(err)
		}
	}
	cfg := config.Default()
	cfg.Database.Path = filepath.Join(dir, "*.db")
	cfg.NATS.URL = n.URL()
	f, err := OpenFleet(context.Background(), cfg, zap.NewNop(), Options{Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	e := streamsync.Exhausted{EventID: "e-1", Stream: cfg.Stream.Name, Consumer: "workers", StreamSeq: 42, Subject: "events.T", Deliveries: 5,
		Header: nats.Header{publish.HeaderTenant: []string{"globex"}}}
	f.onExhausted(e)
	f.onExhausted(e)
	e.StreamSeq, e.Header = 43, nats.Header{publish.HeaderTenant: []string{"initech"}}
	f.onExhausted(e)
	if got := metrics.Value(f.metrics.ConsumerExhausted); got != 2 {
		t.Fatalf("consumer_exhausted_total %v, want 2 (globex's once, initech's)", got)
	}
	for tenant, want := range map[string]int{"acme": 0, "globex": 1} {
		var rows int
		db := testenv.AppDB(t, filepath.Join(dir, tenant+".db"))
		if err := db.QueryRow(`SELECT count(*) FROM outbox_relay_exhausted`).Scan(&rows); err != nil || rows != want {
			t.Errorf("%s: %d exhausted rows (%v), want %d", tenant, rows, err, want)
		}
	}
}
