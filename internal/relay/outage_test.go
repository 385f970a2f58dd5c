package relay

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// trialPublisher answers probes once up is set, and resolves every publish
// with result after delay.
type trialPublisher struct {
	up     atomic.Bool
	delay  time.Duration
	result publish.Result

	mu        sync.Mutex
	published int
}

type trialAck struct {
	delay  time.Duration
	result publish.Result
}

func (a trialAck) Wait(ctx context.Context) publish.Result {
	select {
	case <-time.After(a.delay):
		return a.result
	case <-ctx.Done():
		return publish.Result{Kind: publish.Transport, Err: ctx.Err()}
	}
}

func (p *trialPublisher) Publish(_ context.Context, msgs []publish.Message) []publish.Ack {
	p.mu.Lock()
	p.published += len(msgs)
	p.mu.Unlock()
	acks := make([]publish.Ack, len(msgs))
	for i := range acks {
		acks[i] = trialAck{p.delay, p.result}
	}
	return acks
}

func (p *trialPublisher) Ready(context.Context) error {
	if p.up.Load() {
		return nil
	}
	return errors.New("nats: no servers available")
}

func (p *trialPublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.published
}

func runRelay(t *testing.T, store *testenv.MemStore, pub Publisher) *Relay {
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 100, MaxInFlight: 500, PollInterval: 20 * time.Millisecond, MaxAttempts: 3, ShutdownTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

// TestHalfOpenTriesOneRow: after a probe succeeds, one row goes out and the
// relay waits for its answer before claiming more, so a broker that answers
// probes but not publishes costs one row a try, not a window of them.
func TestHalfOpenTriesOneRow(t *testing.T) {
	store := &testenv.MemStore{}
	store.AddN(1000, "T", nil)
	pub := &trialPublisher{delay: 300 * time.Millisecond, result: publish.Result{Kind: publish.Transport, Err: errors.New("timeout waiting for ack")}}
	r := runRelay(t, store, pub)
	testenv.Eventually(t, 10*time.Second, "paused", func() bool { return r.Paused() != nil })
	pub.up.Store(true) // probes succeed, publishes still time out
	testenv.Eventually(t, 10*time.Second, "a row on trial", func() bool { return pub.count() >= 1 })
	time.Sleep(150 * time.Millisecond) // its answer takes 300 ms
	if n := pub.count(); n != 1 {
		t.Fatalf("published %d rows while the first trial was unanswered; want 1", n)
	}
}

// TestHalfOpenEndsOnARejection: a broker that refuses the trial row on its
// merits (too large, say) is up: the outage ends, and the rejection spends
// the row's attempt as any rejection does.
func TestHalfOpenEndsOnARejection(t *testing.T) {
	store := &testenv.MemStore{}
	store.AddN(50, "T", nil)
	pub := &trialPublisher{result: publish.Result{Kind: publish.Rejected, Err: errors.New("nats: API error: code=400 err_code=10054 description=message size exceeds maximum allowed")}}
	r := runRelay(t, store, pub)
	testenv.Eventually(t, 10*time.Second, "paused", func() bool { return r.Paused() != nil })
	pub.up.Store(true)
	testenv.Eventually(t, 10*time.Second, "all settled", func() bool { return len(store.Outcomes()) >= 50 })
	if err := r.Paused(); err != nil {
		t.Fatalf("the broker answered every publish, yet the relay reports an outage: %v", err)
	}
}

// TestStartedOnce: Options.Started is called once, when the relay's start
// is over: at its first claim, or as it finds the broker out, before it
// can publish anything.
func TestStartedOnce(t *testing.T) {
	for _, up := range []bool{true, false} {
		t.Run(map[bool]string{true: "broker up", false: "broker out"}[up], func(t *testing.T) {
			store := &testenv.MemStore{}
			store.AddN(300, "T", nil)
			pub := &trialPublisher{result: publish.Result{Kind: publish.Stored}}
			pub.up.Store(up)
			var calls atomic.Int32
			r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 100, MaxInFlight: 500, PollInterval: 20 * time.Millisecond,
				MaxAttempts: 3, ShutdownTimeout: time.Second, Started: func() { calls.Add(1) }})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); r.Run(ctx) }()
			defer func() { cancel(); <-done }()
			testenv.Eventually(t, 10*time.Second, "started", func() bool { return calls.Load() > 0 })
			pub.up.Store(true)
			testenv.Eventually(t, 10*time.Second, "all settled", func() bool { return len(store.Outcomes()) >= 300 })
			if n := calls.Load(); n != 1 {
				t.Fatalf("Started called %d times, want once", n)
			}
		})
	}
}
