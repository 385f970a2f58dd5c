package ledger_test

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/ledger"
)

// TestHandlersShorterThanAckWaitAreNotRedelivered: Run's comment says
// "nothing is fetched ahead, so a message's ack_wait runs while its
// handler does, not while it waits for a slot". With Concurrency 1 and
// handlers that each take 60% of ack_wait, no message waiting for the
// slot should be delivered twice.
func TestHandlersShorterThanAckWaitAreNotRedelivered(t *testing.T) {
	_, js := stream(t)
	const ackWait = 2 * time.Second
	cons := durable(t, js, ackWait, -1)
	db := appDB(t)
	var mu sync.Mutex
	deliveries := map[string][]uint64{}
	runs := &counter{n: map[string]int{}}
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.Handle("T", "h", func(_ context.Context, ev ledger.Event) error {
		runs.add(ev.ID)
		time.Sleep(ackWait * 6 / 10) // the handler's work, well within ack_wait
		return nil
	})
	runWorker(t, watched{cons, func(m jetstream.Msg) {
		md, _ := m.Metadata()
		mu.Lock()
		id := m.Headers().Get(jetstream.MsgIDHeader)
		deliveries[id] = append(deliveries[id], md.NumDelivered)
		mu.Unlock()
	}}, h, ledger.WorkerOptions{Concurrency: 1, Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	ids := make([]string, 3)
	for i := range ids {
		ids[i] = event.NewID()
		publish(t, js, ids[i], "T")
	}
	testenv.Eventually(t, 60*time.Second, "every message acknowledged", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0
	})
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		t.Logf("%s: deliveries %v, handler runs %d", id, deliveries[id], runs.get(id))
	}
	for _, id := range ids {
		if len(deliveries[id]) != 1 {
			t.Errorf("event %s was delivered %d times (%v) although its handler takes %v of an ack_wait of %v",
				id, len(deliveries[id]), deliveries[id], ackWait*6/10, ackWait)
		}
	}
}

// TestStoppedWorkerFetchesNoMore: after Run has returned, a message
// published is delivered at once to the next worker; it is not taken by a
// pull the stopped worker left at the server (and held there for
// ack_wait).
func TestStoppedWorkerFetchesNoMore(t *testing.T) {
	_, js := stream(t)
	cons := durable(t, js, time.Minute, -1)
	db := appDB(t)
	runs := &counter{n: map[string]int{}}
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.Handle("T", "h", func(_ context.Context, ev ledger.Event) error { runs.add(ev.ID); return nil })
	stop := runWorker(t, cons, h, ledger.WorkerOptions{Concurrency: 4})
	first := event.NewID()
	publish(t, js, first, "T")
	testenv.Eventually(t, 20*time.Second, "the first event handled", func() bool { return runs.get(first) == 1 })
	testenv.Eventually(t, 20*time.Second, "the worker's pull waiting at the server", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumWaiting > 0
	})
	stop()
	second := event.NewID()
	publish(t, js, second, "T")
	runWorker(t, cons, h, ledger.WorkerOptions{Concurrency: 4})
	deadline := time.Now().Add(15 * time.Second)
	for runs.get(second) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if runs.get(second) == 0 {
		info, _ := cons.Info(context.Background())
		t.Fatalf("an event published after the first worker stopped was not handled by the second within 15 s: ack pending %d, redelivered %d, waiting %d",
			info.NumAckPending, info.NumRedelivered, info.NumWaiting)
	}
}

// TestRunLeavesNoGoroutines: once Run has returned (and its claims
// are settled) the goroutines it started are gone.
func TestRunLeavesNoGoroutines(t *testing.T) {
	_, js := stream(t)
	cons := durable(t, js, time.Minute, -1)
	db := appDB(t)
	runs := &counter{n: map[string]int{}}
	h := handlersWith(t, db, ledger.Options{StaleAfter: 500 * time.Millisecond}, nil)
	h.Handle("T", "h", func(_ context.Context, ev ledger.Event) error {
		runs.add(ev.ID)
		time.Sleep(300 * time.Millisecond)
		return nil
	})
	db.Ping()
	time.Sleep(100 * time.Millisecond)
	before := runtime.NumGoroutine()
	w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events", Concurrency: 4})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	id := event.NewID()
	publish(t, js, id, "T")
	testenv.Eventually(t, 20*time.Second, "handled", func() bool { return runs.get(id) == 1 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		buf := make([]byte, 1<<20)
		t.Fatalf("%d goroutines after Run returned, %d before:\n%s", n, before, buf[:runtime.Stack(buf, true)])
	}
}

// TestStoppedWorkerLeavesNoMessageBehind: an event published as the
// worker stops, its pull waiting, is handled by the next worker at once,
// not after ack_wait (a minute here): a message the server sent to the
// stopping worker's pull is Nak'ed, not dropped with the pull. The race
// is narrow: rounds of it.
func TestStoppedWorkerLeavesNoMessageBehind(t *testing.T) {
	_, js := stream(t)
	cons := durable(t, js, time.Minute, -1)
	runs := &counter{n: map[string]int{}}
	h := handlersWith(t, appDB(t), ledger.Options{}, nil)
	h.Handle("T", "h", func(_ context.Context, ev ledger.Event) error { runs.add(ev.ID); return nil })
	run := func() (stop func()) {
		w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events"})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- w.Run(ctx) }()
		return func() {
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
	}
	for round := range 20 {
		stop := run()
		testenv.Eventually(t, 20*time.Second, "the worker's pull waiting", func() bool {
			info, err := cons.Info(context.Background())
			return err == nil && info.NumWaiting > 0 && info.NumAckPending == 0
		})
		id := event.NewID()
		publish(t, js, id, "T")
		stop()
		stop = run()
		deadline := time.Now().Add(5 * time.Second)
		for runs.get(id) == 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		stop()
		if runs.get(id) == 0 {
			t.Fatalf("round %d: an event published as the worker stopped was not handled by the next worker within 5 s (ack_wait 1 min)", round)
		}
	}
}

// TestHandlerLongerThanAckWaitIsNotDeliveredAgain: while a handler runs,
// its message is said to be in progress, so a handler five times as long
// as ack_wait gets its message once, even on a consumer whose second
// delivery is its last.
func TestHandlerLongerThanAckWaitIsNotDeliveredAgain(t *testing.T) {
	_, js := stream(t)
	const ackWait = 500 * time.Millisecond
	cons := durable(t, js, ackWait, 2)
	db := appDB(t)
	var mu sync.Mutex
	var deliveries []uint64
	runs := &counter{n: map[string]int{}}
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.Handle("T", "h", func(_ context.Context, ev ledger.Event) error {
		runs.add(ev.ID)
		time.Sleep(5 * ackWait)
		return nil
	})
	runWorker(t, watched{cons, func(m jetstream.Msg) {
		md, _ := m.Metadata()
		mu.Lock()
		deliveries = append(deliveries, md.NumDelivered)
		mu.Unlock()
	}}, h, ledger.WorkerOptions{Concurrency: 2})
	id := event.NewID()
	publish(t, js, id, "T")
	testenv.Eventually(t, 60*time.Second, "the message acknowledged", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.Delivered.Consumer > 0
	})
	mu.Lock()
	defer mu.Unlock()
	if len(deliveries) != 1 || runs.get(id) != 1 {
		t.Fatalf("deliveries %v, handler runs %d; want one of each for a handler of %v on an ack_wait of %v", deliveries, runs.get(id), 5*ackWait, ackWait)
	}
	info, err := cons.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.NumRedelivered != 0 {
		t.Fatalf("%d messages delivered again", info.NumRedelivered)
	}
}

// TestInProgressEndsWithTheLease: a handler still running after the
// ledger's Lease no longer keeps its message: it is delivered again, so
// that another process may take the claim over, and not before the Lease.
func TestInProgressEndsWithTheLease(t *testing.T) {
	_, js := stream(t)
	const ackWait, lease = 300 * time.Millisecond, 2 * time.Second
	cons := durable(t, js, ackWait, -1)
	db := appDB(t)
	var mu sync.Mutex
	var at []time.Time
	release := make(chan struct{})
	h := handlersWith(t, db, ledger.Options{Lease: lease, StaleAfter: time.Minute}, nil)
	h.Handle("T", "h", func(context.Context, ledger.Event) error {
		<-release
		return nil
	})
	runWorker(t, watched{cons, func(jetstream.Msg) {
		mu.Lock()
		at = append(at, time.Now())
		mu.Unlock()
	}}, h, ledger.WorkerOptions{Concurrency: 2})
	t.Cleanup(func() { close(release) }) // before the worker stops, which waits for the handlers
	publish(t, js, event.NewID(), "T")
	testenv.Eventually(t, 30*time.Second, "the message delivered again", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(at) >= 2
	})
	mu.Lock()
	defer mu.Unlock()
	if gap := at[1].Sub(at[0]); gap < lease {
		t.Fatalf("delivered again %v after the first delivery, before the lease of %v ended", gap, lease)
	}
}

// TestLeaseCountsFromEachHandlersClaim: two handlers of one type each run
// three quarters of the Lease, one after the other, on a consumer whose
// second delivery is its last. Neither outlives its own claim's lease, so
// the message is kept in progress throughout: one delivery, and no
// "exhausted" error for an event whose handlers all succeed.
func TestLeaseCountsFromEachHandlersClaim(t *testing.T) {
	_, js := stream(t)
	const ackWait, lease = 300 * time.Millisecond, 2 * time.Second
	cons := durable(t, js, ackWait, 2)
	db := appDB(t)
	var mu sync.Mutex
	var deliveries []uint64
	h := handlersWith(t, db, ledger.Options{Lease: lease, StaleAfter: time.Minute}, nil)
	for _, name := range []string{"a", "b"} {
		h.Handle("T", name, func(context.Context, ledger.Event) error {
			time.Sleep(lease * 3 / 4)
			return nil
		})
	}
	core, logs := observer.New(zapcore.InfoLevel)
	runWorker(t, watched{cons, func(m jetstream.Msg) {
		md, _ := m.Metadata()
		mu.Lock()
		deliveries = append(deliveries, md.NumDelivered)
		mu.Unlock()
	}}, h, ledger.WorkerOptions{Concurrency: 2, Log: zap.New(core)})
	publish(t, js, event.NewID(), "T")
	testenv.Eventually(t, 30*time.Second, "the message acknowledged", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.Delivered.Consumer > 0
	})
	mu.Lock()
	defer mu.Unlock()
	if len(deliveries) != 1 {
		t.Errorf("deliveries %v; want 1: no handler ran longer than the lease (%v each, lease %v)", deliveries, lease*3/4, lease)
	}
	if n := logs.FilterMessage("event exhausted max deliveries").Len(); n > 0 {
		t.Errorf("%d 'event exhausted max deliveries' errors for an event whose handlers all succeeded", n)
	}
}

// TestRunningHandlerFollowsAShorterAckWait: ack_wait shortened from 2 s to
// 400 ms while a handler runs. Once the worker has read the consumer again
// (every 30 s), the running handler's message is said to be in progress
// often enough for the new ack_wait: it is not delivered again.
func TestRunningHandlerFollowsAShorterAckWait(t *testing.T) {
	_, js := stream(t)
	cons := durable(t, js, 2*time.Second, -1)
	db := appDB(t)
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	h := handlersWith(t, db, ledger.Options{StaleAfter: time.Minute}, nil)
	h.Handle("T", "h", func(context.Context, ledger.Event) error {
		started <- struct{}{}
		<-release
		return nil
	})
	var delivered atomic.Int64
	runWorker(t, watched{cons, func(jetstream.Msg) { delivered.Add(1) }}, h,
		ledger.WorkerOptions{Concurrency: 2, Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	t.Cleanup(func() { close(release) }) // before the worker stops, which waits for the handler
	publish(t, js, event.NewID(), "T")
	<-started
	durable(t, js, 400*time.Millisecond, -1) // ack_wait shortened under the running handler
	time.Sleep(32 * time.Second)             // the worker has read it
	before := delivered.Load()
	time.Sleep(4 * time.Second)
	if after := delivered.Load(); after > before {
		t.Fatalf("%d more deliveries in the 4 s after the worker read the shorter ack_wait; want none", after-before)
	}
}
