package ledger_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/ledger"
)

// counter counts handler runs per event id.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) add(id string) { c.mu.Lock(); c.n[id]++; c.mu.Unlock() }
func (c *counter) get(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

// TestWorkerResumesAfterBrokerRestart: the server is stopped and
// restarted on the same port and store while a Worker runs; events
// published before and after are each handled once, without restarting
// the worker.
func TestWorkerResumesAfterBrokerRestart(t *testing.T) {
	n, js := stream(t)
	durable(t, js, 2*time.Second, -1)
	db := appDB(t)
	runs := &counter{n: map[string]int{}}
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.Handle("T", "h", func(_ context.Context, ev ledger.Event) error { runs.add(ev.ID); return nil })
	// The worker's own connection, reconnecting forever.
	wcons := reconnectingConsumer(t, n.URL())
	core, logs := observer.New(zapcore.InfoLevel)
	runWorker(t, wcons, h, ledger.WorkerOptions{Log: zap.New(core)})
	before := event.NewID()
	publish(t, js, before, "T")
	testenv.Eventually(t, 20*time.Second, "the first event handled", func() bool { return runs.get(before) == 1 })

	n.Stop()
	// Away for a while: longer than the pull's expiry and heartbeat.
	time.Sleep(12 * time.Second)
	warnDuringOutage := logs.Len()
	n.Restart()

	js2 := n.JetStream(t)
	after := event.NewID()
	publish(t, js2, after, "T")
	testenv.Eventually(t, 60*time.Second, "the event published after the restart handled", func() bool { return runs.get(after) == 1 })
	t.Logf("log lines during the outage: %d", warnDuringOutage)
	for _, e := range logs.All() {
		t.Logf("%s %s %v", e.Level, e.Message, e.ContextMap())
	}
	if runs.get(before) != 1 {
		t.Fatalf("the first event ran %d times", runs.get(before))
	}
}

// TestWorkerReturnsWhenItsStreamIsDeleted: deleting the stream
// deletes its consumers; Run returns an error when the
// consumer was deleted (noticed within about 10 s).
func TestWorkerReturnsWhenItsStreamIsDeleted(t *testing.T) {
	_, js := stream(t)
	testenv.BystanderStream(t, js)
	cons := durable(t, js, time.Minute, -1)
	h := handlersWith(t, appDB(t), ledger.Options{}, nil)
	core, logs := observer.New(zapcore.InfoLevel)
	w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events", Log: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	testenv.Eventually(t, 20*time.Second, "the worker's pull waiting at the server", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumWaiting > 0
	})
	if err := js.DeleteStream(context.Background(), "EVENTS"); err != nil {
		t.Fatal(err)
	}
	runFails(t, done, 40*time.Second, "its stream (and consumer) was deleted", logs)
}

// TestWorkerReturnsWhenItsConnectionCloses: Run returns an error when
// the connection closed for good.
func TestWorkerReturnsWhenItsConnectionCloses(t *testing.T) {
	n, js := stream(t)
	durable(t, js, time.Minute, -1)
	nc, err := nats.Connect(n.URL())
	if err != nil {
		t.Fatal(err)
	}
	wjs, _ := jetstream.New(nc)
	cons, err := wjs.Consumer(context.Background(), "EVENTS", "workers")
	if err != nil {
		t.Fatal(err)
	}
	h := handlersWith(t, appDB(t), ledger.Options{}, nil)
	w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(context.Background()) }()
	testenv.Eventually(t, 20*time.Second, "the worker's pull waiting at the server", func() bool {
		info, err := js.Consumer(context.Background(), "EVENTS", "workers")
		if err != nil {
			return false
		}
		return info.CachedInfo().NumWaiting > 0
	})
	nc.Close()
	runFails(t, done, 30*time.Second, "its connection closed", nil)
}

// TestWorkerReturnsWhenItsStreamIsDeletedBeforeItPulls: as the
// consumer-deleted case "before the first pull", with the whole stream
// deleted (an operator recreating the stream, say).
func TestWorkerReturnsWhenItsStreamIsDeletedBeforeItPulls(t *testing.T) {
	_, js := stream(t)
	testenv.BystanderStream(t, js)
	cons := durable(t, js, time.Minute, -1)
	h := handlersWith(t, appDB(t), ledger.Options{}, nil)
	core, logs := observer.New(zapcore.InfoLevel)
	w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events", Log: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteStream(context.Background(), "EVENTS"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	runFails(t, done, 45*time.Second, "its stream (and so its consumer) was deleted", logs)
}

// runFails waits up to within for Run's result on done and fails the test
// unless it is an error; logs, when set, are shown if it does not come.
func runFails(t *testing.T, done <-chan error, within time.Duration, after string, logs *observer.ObservedLogs) {
	t.Helper()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Run returned nil")
		}
		t.Logf("Run: %v", err)
	case <-time.After(within):
		if logs != nil {
			for _, e := range logs.All() {
				t.Logf("%s %s %v", e.Level, e.Message, e.ContextMap())
			}
		}
		t.Fatalf("Run went on %v after %s", within, after)
	}
}

// TestBrokerRestartsUnderARunningHandler: the server stops while a
// handler runs and comes back after it returned; the message is not lost
// and the handler does not run again.
func TestBrokerRestartsUnderARunningHandler(t *testing.T) {
	n, js := stream(t)
	durable(t, js, 2*time.Second, -1)
	db := appDB(t)
	runs := &counter{n: map[string]int{}}
	started, release := make(chan struct{}), make(chan struct{})
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.HandleTx("T", "h", func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		runs.add(ev.ID)
		if runs.get(ev.ID) == 1 {
			close(started)
			<-release
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO effects (event_id, handler) VALUES (?, 'h')`, ev.ID)
		return err
	})
	wcons := reconnectingConsumer(t, n.URL())
	runWorker(t, wcons, h, ledger.WorkerOptions{Concurrency: 2})
	id := event.NewID()
	publish(t, js, id, "T")
	<-started
	n.Stop()
	close(release)
	time.Sleep(3 * time.Second) // past ack_wait while away
	n.Restart()
	js2 := n.JetStream(t)
	cons2, _ := js2.Consumer(context.Background(), "EVENTS", "workers")
	testenv.Eventually(t, 30*time.Second, "the message acknowledged", func() bool {
		info, err := cons2.Info(context.Background())
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream == 1
	})
	var effects int
	db.QueryRow(`SELECT count(*) FROM effects WHERE event_id = ?`, id).Scan(&effects)
	if effects != 1 || runs.get(id) != 1 {
		t.Fatalf("%d effects, %d runs", effects, runs.get(id))
	}
}

// reconnectingConsumer binds the durable "workers" on a connection of its
// own to the server at url, reconnecting forever (as a worker's is).
func reconnectingConsumer(t *testing.T, url string) jetstream.Consumer {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.Consumer(context.Background(), "EVENTS", "workers")
	if err != nil {
		t.Fatal(err)
	}
	return cons
}
