package ledger_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/ledger"
)

// stream creates the relay's stream on a new in-process server.
func stream(t *testing.T) (*testenv.NATS, jetstream.JetStream) {
	t.Helper()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour}); err != nil {
		t.Fatal(err)
	}
	return n, js
}

// durable creates (or binds) the durable pull consumer "workers".
func durable(t *testing.T, js jetstream.JetStream, ackWait time.Duration, maxDeliver int) jetstream.Consumer {
	t.Helper()
	c, err := js.CreateOrUpdateConsumer(context.Background(), "EVENTS", jetstream.ConsumerConfig{
		Durable: "workers", AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait, MaxDeliver: maxDeliver,
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// publish publishes an event as the relay does.
func publish(t testing.TB, js jetstream.JetStream, id, eventType string) {
	t.Helper()
	publishData(t, js, id, eventType, []byte(`{"id":"`+id+`"}`))
}

// publishData publishes an event with its payload as the relay does.
func publishData(t testing.TB, js jetstream.JetStream, id, eventType string, data []byte) {
	t.Helper()
	msg := &nats.Msg{Subject: "events." + eventType, Header: nats.Header{}, Data: data}
	msg.Header.Set(jetstream.MsgIDHeader, id)
	if _, err := js.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
}

// runWorker runs a Worker until the test ends (or stop is called).
func runWorker(t *testing.T, cons jetstream.Consumer, h *ledger.Handlers, o ledger.WorkerOptions) (stop func()) {
	t.Helper()
	o.SubjectPrefix = "events"
	w, err := ledger.NewWorker(cons, h, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Error(err)
				}
			case <-time.After(30 * time.Second):
				t.Error("the worker did not stop")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func handlersWith(t *testing.T, db *sql.DB, o ledger.Options, reg prometheus.Registerer) *ledger.Handlers {
	t.Helper()
	h, err := ledger.NewHandlers(ledger.New(db, o), reg)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// lostProgress is a consumer whose messages' in-progress notices never
// reach the server, as over a connection that drops them: a message whose
// handler runs past ack_wait is delivered again meanwhile.
type lostProgress struct{ jetstream.Consumer }

func (c lostProgress) Next(opts ...jetstream.FetchOpt) (jetstream.Msg, error) {
	m, err := c.Consumer.Next(opts...)
	if err != nil {
		return m, err
	}
	return progressLost{m}, nil
}

// progressLost is a message whose in-progress notice is lost.
type progressLost struct{ jetstream.Msg }

func (progressLost) InProgress() error { return nil }

// watched is a consumer whose deliveries a test sees as the worker takes
// them.
type watched struct {
	jetstream.Consumer
	seen func(jetstream.Msg)
}

func (c watched) Next(opts ...jetstream.FetchOpt) (jetstream.Msg, error) {
	m, err := c.Consumer.Next(opts...)
	if err == nil {
		c.seen(m)
	}
	return m, err
}

// redeliveries closes a channel per event id once a second delivery of
// its message reaches a worker.
type redeliveries struct {
	mu    sync.Mutex
	again map[string]chan struct{}
}

func (r *redeliveries) of(id string) chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.again[id] == nil {
		r.again[id] = make(chan struct{})
	}
	return r.again[id]
}

func (r *redeliveries) seen(m jetstream.Msg) {
	if md, err := m.Metadata(); err == nil && md.NumDelivered == 2 {
		close(r.of(m.Headers().Get(jetstream.MsgIDHeader)))
	}
}

// TestWorkersHandleEachEventOnce: two workers on one durable consumer and
// one database file (a pool each), whose first handler does not return
// before its message has been delivered again (ack_wait is short, and the
// worker's in-progress notices are lost): every message is delivered at
// least twice, and every (event, handler) effect happens exactly once.
func TestWorkersHandleEachEventOnce(t *testing.T) {
	_, js := stream(t)
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	effectsTable(t, db)
	cons := durable(t, js, 300*time.Millisecond, -1)
	const events = 24
	again := &redeliveries{again: map[string]chan struct{}{}}
	var slowRuns sync.Map        // event id -> *atomic.Int64
	var received [2]atomic.Int64 // deliveries per worker
	for w := range 2 {
		h := handlersWith(t, testenv.AppDB(t, path), ledger.Options{}, nil)
		h.Handle("OrderPlaced", "slow", func(_ context.Context, ev ledger.Event) error {
			n, _ := slowRuns.LoadOrStore(ev.ID, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			select {
			case <-again.of(ev.ID):
				return nil
			case <-time.After(20 * time.Second):
				return errors.New("the message was not delivered again while its handler ran")
			}
		})
		h.HandleTx("OrderPlaced", "record", recordTx("record"))
		h.HandleTx("OrderPlaced", "bill", recordTx("bill"))
		// Room for every message and its second delivery at once between
		// the two, and for no more than one delivery of each in either:
		// a worker whose slots all hold first deliveries (their handlers
		// waiting) leaves the second ones to the other, so both take some.
		runWorker(t, watched{lostProgress{cons}, func(m jetstream.Msg) { received[w].Add(1); again.seen(m) }}, h, ledger.WorkerOptions{Concurrency: events})
	}
	ids := make([]string, events)
	for i := range ids {
		ids[i] = event.NewID()
		publish(t, js, ids[i], "OrderPlaced")
	}
	testenv.Eventually(t, 60*time.Second, "every message acknowledged", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0
	})
	for _, id := range ids {
		select {
		case <-again.of(id):
		default:
			t.Errorf("event %s was delivered once", id)
		}
		if n, ok := slowRuns.Load(id); !ok || n.(*atomic.Int64).Load() != 1 {
			t.Errorf("the slow handler ran %v times for %s; want once", n, id)
		}
	}
	t.Logf("deliveries per worker: %d and %d", received[0].Load(), received[1].Load())
	if received[0].Load() == 0 || received[1].Load() == 0 {
		t.Errorf("deliveries per worker %d and %d: both workers must take messages", received[0].Load(), received[1].Load())
	}
	var total, distinct int
	db.QueryRow(`SELECT count(*), count(DISTINCT event_id || '/' || handler) FROM effects`).Scan(&total, &distinct)
	if total != 2*events || distinct != 2*events {
		t.Fatalf("%d effects, %d distinct; want each of the %d (event, handler) pairs once", total, distinct, 2*events)
	}
}

// TestWorkerExhaustsMaxDeliver: a handler that always fails is delivered
// max_deliver times on the retry schedule (scaled down here), and the last
// failure is logged at error level exactly once, naming the event and the
// handler.
func TestWorkerExhaustsMaxDeliver(t *testing.T) {
	_, js := stream(t)
	db := appDB(t)
	const maxDeliver = 4
	cons := durable(t, js, time.Minute, maxDeliver)
	var mu sync.Mutex
	var at []time.Time
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.Handle("Doomed", "always-fails", func(context.Context, ledger.Event) error {
		mu.Lock()
		at = append(at, time.Now())
		mu.Unlock()
		return errors.New("refused by the payment provider")
	})
	core, logs := observer.New(zapcore.InfoLevel)
	sch := &schedule{div: 25} // 200 ms, 400 ms, 800 ms
	scaled := func(n int) time.Duration { return ledger.Backoff(n) / sch.div }
	runWorker(t, cons, h, ledger.WorkerOptions{Backoff: sch.backoff, Log: zap.New(core)})
	id := event.NewID()
	publish(t, js, id, "Doomed")
	exhausted := func() []observer.LoggedEntry {
		return logs.FilterMessage("event exhausted max deliveries").AllUntimed()
	}
	testenv.Eventually(t, 30*time.Second, "the exhausted line", func() bool { return len(exhausted()) > 0 })
	// Past the longest delay the schedule would have next: no more runs.
	time.Sleep(2 * scaled(maxDeliver))
	mu.Lock()
	defer mu.Unlock()
	if len(at) != maxDeliver {
		t.Fatalf("the handler ran %d times; want max_deliver = %d", len(at), maxDeliver)
	}
	for i := 1; i < len(at); i++ {
		if gap, want := at[i].Sub(at[i-1]), scaled(i); gap < want {
			t.Errorf("delivery %d came %v after delivery %d; the schedule says %v", i+1, gap, i, want)
		}
	}
	// The delays were the schedule's steps 1, 2 and 3: 5 s doubling (scaled).
	if got := sch.steps(); fmt.Sprint(got) != "[1 2 3]" {
		t.Errorf("the retry delays asked for were steps %v of the schedule; want [1 2 3]", got)
	}
	lines := exhausted()
	if len(lines) != 1 || lines[0].Level != zapcore.ErrorLevel {
		t.Fatalf("%d exhausted lines (%+v); want one at error level", len(lines), lines)
	}
	f := lines[0].ContextMap()
	if f["event_id"] != id || f["handler"] != "always-fails" || f["error"] != "refused by the payment provider" {
		t.Fatalf("exhausted line fields %v", f)
	}
}

// TestWorkerWaitsForABusyClaim: a delivery that finds a fresh claim held
// elsewhere, by a holder that does not heartbeat (processed_at NULL), comes
// again when the claim's lease expires, takes it over and runs the handler
// once.
func TestWorkerWaitsForABusyClaim(t *testing.T) {
	_, js := stream(t)
	db := appDB(t)
	const lease = 2 * time.Second
	id := event.NewID()
	claimed := time.Now()
	testenv.MustExec(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at) VALUES (?, 'h', 'in_progress', ?)`, id, claimed.UnixMilli())
	var ran atomic.Int64
	var ranAt atomic.Int64
	h := handlersWith(t, db, ledger.Options{Lease: lease}, nil)
	h.Handle("T", "h", func(context.Context, ledger.Event) error {
		ran.Add(1)
		ranAt.Store(time.Now().UnixMilli())
		return nil
	})
	runWorker(t, durable(t, js, time.Minute, 5), h, ledger.WorkerOptions{Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	publish(t, js, id, "T")
	testenv.Eventually(t, 20*time.Second, "the handler to run", func() bool { return ran.Load() > 0 })
	if waited := time.UnixMilli(ranAt.Load()).Sub(claimed); waited < lease {
		t.Fatalf("the handler ran %v after the other claim began; its lease is %v", waited, lease)
	}
	// The handler has returned; the worker records the claim done after it.
	testenv.Eventually(t, 20*time.Second, "the claim recorded done", func() bool {
		r, _ := readRow(t, db, id, "h")
		return r.Status == "done"
	})
	time.Sleep(200 * time.Millisecond)
	if ran.Load() != 1 {
		t.Fatalf("the handler ran %d times", ran.Load())
	}
}

// TestWorkerNaksWhenTheLedgerIsGone: while the ledger table cannot be
// read, no handler runs and the message comes again; once it is back, the
// handler runs once.
func TestWorkerNaksWhenTheLedgerIsGone(t *testing.T) {
	_, js := stream(t)
	db := appDB(t)
	reg := prometheus.NewRegistry()
	var ran atomic.Int64
	h := handlersWith(t, db, ledger.Options{}, reg)
	h.Handle("T", "h", func(context.Context, ledger.Event) error { ran.Add(1); return nil })
	testenv.MustExec(t, db, `ALTER TABLE processed_events RENAME TO processed_events_away`)
	runWorker(t, durable(t, js, time.Minute, -1), h, ledger.WorkerOptions{Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	publish(t, js, event.NewID(), "T")
	testenv.Eventually(t, 20*time.Second, "two deliveries that found no ledger", func() bool {
		return metricValue(t, reg, "outbox_ledger_handled_total", "outcome", "error") >= 2
	})
	if ran.Load() != 0 {
		t.Fatal("a handler ran without the ledger")
	}
	testenv.MustExec(t, db, `ALTER TABLE processed_events_away RENAME TO processed_events`)
	testenv.Eventually(t, 20*time.Second, "the handler to run", func() bool { return ran.Load() == 1 })
}

// killedStaleAfter is the StaleAfter of TestKilledWorkerIsTakenOver and its
// child: both keep the default lease, 30 minutes.
const killedStaleAfter = time.Second

// TestKilledWorkerIsTakenOver: a worker killed (kill -9) in the middle of
// a handler leaves its claim; its heartbeat stops, and another worker takes
// the claim over once it is stale, long before the lease expires, and the
// effect happens once.
func TestKilledWorkerIsTakenOver(t *testing.T) {
	n, js := stream(t)
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	effectsTable(t, db)
	durable(t, js, time.Second, -1)
	id := event.NewID()
	publish(t, js, id, "OrderPlaced")

	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperHangingWorker$")
	cmd.Env = append(os.Environ(), "LEDGER_HELPER_DB="+path, "LEDGER_HELPER_NATS="+n.URL())
	p, err := child.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.WaitFor("handler started", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	childClaim, _ := readRow(t, db, id, "record")
	if childClaim.Status != "in_progress" {
		t.Fatalf("the child holds no claim: %+v", childClaim)
	}
	p.Kill()
	lastBeat, _ := readRow(t, db, id, "record") // the child writes no more

	h := handlersWith(t, db, ledger.Options{StaleAfter: killedStaleAfter}, nil)
	h.HandleTx("OrderPlaced", "record", recordTx("record"))
	runWorker(t, durable(t, js, time.Second, -1), h, ledger.WorkerOptions{Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	testenv.Eventually(t, 30*time.Second, "the claim taken over and done", func() bool {
		r, _ := readRow(t, db, id, "record")
		return r.Status == "done"
	})
	var effects int
	db.QueryRow(`SELECT count(*) FROM effects WHERE event_id = ?`, id).Scan(&effects)
	if effects != 1 {
		t.Fatalf("%d effects; want 1", effects)
	}
	// Taken over once the dead child's heartbeat was stale, and long
	// before its lease would have let it go.
	r, _ := readRow(t, db, id, "record")
	if r.StartedAt.Int64 <= lastBeat.Processed.Int64+killedStaleAfter.Milliseconds() || r.StartedAt.Int64 >= childClaim.StartedAt.Int64+ledger.DefaultLease.Milliseconds() {
		t.Fatalf("the claim was taken over at %d, %v after the child's last heartbeat; StaleAfter is %v, the lease %v",
			r.StartedAt.Int64, time.Duration(r.StartedAt.Int64-lastBeat.Processed.Int64)*time.Millisecond, killedStaleAfter, ledger.DefaultLease)
	}
}

// TestHelperHangingWorker is the child of TestKilledWorkerIsTakenOver: a
// worker whose handler starts and never returns.
func TestHelperHangingWorker(t *testing.T) {
	path, url := os.Getenv("LEDGER_HELPER_DB"), os.Getenv("LEDGER_HELPER_NATS")
	if path == "" {
		t.Skip("helper process only")
	}
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.Consumer(context.Background(), "EVENTS", "workers")
	if err != nil {
		t.Fatal(err)
	}
	log := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.Lock(os.Stderr), zapcore.InfoLevel))
	h := handlersWith(t, testenv.AppDB(t, path), ledger.Options{StaleAfter: killedStaleAfter}, nil)
	h.HandleTx("OrderPlaced", "record", func(context.Context, *sql.Tx, ledger.Event) error {
		log.Info("handler started")
		syscall.Pause() // until killed
		return nil
	})
	w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events", Log: log})
	if err != nil {
		t.Fatal(err)
	}
	w.Run(context.Background())
}

// TestWorkerStopsGracefully: stopping a worker lets the running handler
// finish and acknowledges its message; it is not delivered again.
func TestWorkerStopsGracefully(t *testing.T) {
	_, js := stream(t)
	db := appDB(t)
	cons := durable(t, js, time.Minute, -1)
	started, release := make(chan struct{}), make(chan struct{})
	var ran atomic.Int64
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.Handle("T", "h", func(context.Context, ledger.Event) error {
		if ran.Add(1) == 1 {
			close(started)
		}
		<-release
		return nil
	})
	stop := runWorker(t, cons, h, ledger.WorkerOptions{})
	publish(t, js, event.NewID(), "T")
	<-started
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	select {
	case <-stopped:
		t.Fatal("the worker stopped before its handler returned")
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	<-stopped
	testenv.Eventually(t, 10*time.Second, "the message acknowledged", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	if ran.Load() != 1 {
		t.Fatalf("the handler ran %d times", ran.Load())
	}
}

// TestWorkerReturnsWhenItsConsumerIsDeleted: messages that stop without
// ctx ending make Run return an error, whether the consumer is deleted
// under a pull the server holds (it says so at once) or before the
// worker's first pull reached it (the missed heartbeats tell).
func TestWorkerReturnsWhenItsConsumerIsDeleted(t *testing.T) {
	for _, c := range []struct {
		name         string
		afterPulling bool
	}{{"under a waiting pull", true}, {"before the first pull", false}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, js := stream(t)
			cons := durable(t, js, time.Minute, -1)
			h := handlersWith(t, appDB(t), ledger.Options{}, nil)
			w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events"})
			if err != nil {
				t.Fatal(err)
			}
			deleteConsumer := func() {
				if err := js.DeleteConsumer(context.Background(), "EVENTS", "workers"); err != nil {
					t.Fatal(err)
				}
			}
			if !c.afterPulling {
				deleteConsumer()
			}
			done := make(chan error, 1)
			go func() { done <- w.Run(context.Background()) }()
			if c.afterPulling {
				testenv.Eventually(t, 20*time.Second, "the worker's pull waiting at the server", func() bool {
					info, err := cons.Info(context.Background())
					return err == nil && info.NumWaiting > 0
				})
				deleteConsumer()
			}
			select {
			case err := <-done:
				if err == nil {
					t.Fatal("Run returned nil after its consumer was deleted")
				}
				t.Logf("Run: %v", err)
			case <-time.After(30 * time.Second):
				t.Fatal("Run went on after its consumer was deleted")
			}
		})
	}
}

// TestWorkerBusyOnTheLastDelivery: a claim held elsewhere on the
// consumer's last delivery is logged as exhausted, naming the handler.
func TestWorkerBusyOnTheLastDelivery(t *testing.T) {
	_, js := stream(t)
	db := appDB(t)
	id := event.NewID()
	testenv.MustExec(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at) VALUES (?, 'h', 'in_progress', ?)`, id, time.Now().UnixMilli())
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.Handle("T", "h", func(context.Context, ledger.Event) error { return nil })
	core, logs := observer.New(zapcore.InfoLevel)
	runWorker(t, durable(t, js, time.Minute, 1), h, ledger.WorkerOptions{Log: zap.New(core)})
	publish(t, js, id, "T")
	testenv.Eventually(t, 20*time.Second, "the exhausted line", func() bool {
		return logs.FilterMessage("event exhausted max deliveries").Len() > 0
	})
	f := logs.FilterMessage("event exhausted max deliveries").AllUntimed()[0].ContextMap()
	if f["event_id"] != id || f["handler"] != "h" {
		t.Fatalf("exhausted line fields %v", f)
	}
}

// TestWorkerTakesTheTypeFromItsHeader: under a subject template (a fleet's
// {tenant}.{event_type}, say) the subject holds more than the event type:
// the worker takes it from the Outbox-Event-Type header the relay sends,
// and the event's handler runs.
func TestWorkerTakesTheTypeFromItsHeader(t *testing.T) {
	_, js := stream(t)
	db := appDB(t)
	h := handlersWith(t, db, ledger.Options{}, nil)
	var ran atomic.Int64
	h.Handle("ReviewLogged", "stats", func(context.Context, ledger.Event) error { ran.Add(1); return nil })
	cons := durable(t, js, 5*time.Second, 5)
	runWorker(t, cons, h, ledger.WorkerOptions{})
	msg := &nats.Msg{Subject: "events.acme.ReviewLogged", Header: nats.Header{}, Data: []byte(`{}`)}
	msg.Header.Set(jetstream.MsgIDHeader, event.NewID())
	msg.Header.Set("Outbox-Event-Type", "ReviewLogged")
	msg.Header.Set("Outbox-Tenant", "acme")
	if _, err := js.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, wait, "the message acknowledged", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.AckFloor.Stream == 1
	})
	if n := ran.Load(); n != 1 {
		t.Errorf("the handler ran %d times, want 1", n)
	}
}
