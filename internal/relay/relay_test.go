package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// heldPublisher keeps every ack pending until release is closed.
type heldPublisher struct {
	mu          sync.Mutex
	outstanding int
	maxOut      int
	release     chan struct{}
}

type heldAck struct{ p *heldPublisher }

func (a heldAck) Wait(ctx context.Context) publish.Result {
	select {
	case <-a.p.release:
	case <-ctx.Done():
		return publish.Result{Kind: publish.Transport, Err: ctx.Err()}
	}
	a.p.mu.Lock()
	a.p.outstanding--
	a.p.mu.Unlock()
	return publish.Result{Kind: publish.Stored}
}

func (p *heldPublisher) Publish(_ context.Context, msgs []publish.Message) []publish.Ack {
	p.mu.Lock()
	defer p.mu.Unlock()
	acks := make([]publish.Ack, len(msgs))
	for i := range msgs {
		p.outstanding++
		p.maxOut = max(p.maxOut, p.outstanding)
		acks[i] = heldAck{p}
	}
	return acks
}

func (p *heldPublisher) Ready(context.Context) error { return nil }

func (p *heldPublisher) state() (outstanding, maxOut int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.outstanding, p.maxOut
}

// TestInFlightBound: the relay keeps at most max_in_flight acks outstanding
// and claims more as soon as they are settled.
func TestInFlightBound(t *testing.T) {
	store := &testenv.MemStore{}
	store.AddN(100, "T", nil)
	pub := &heldPublisher{release: make(chan struct{})}
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 30, PollInterval: time.Millisecond, MaxAttempts: 3, ShutdownTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testenv.Eventually(t, 10*time.Second, "30 outstanding", func() bool { n, _ := pub.state(); return n == 30 })
	time.Sleep(50 * time.Millisecond) // it must not claim more while full
	if n, maxOut := pub.state(); n != 30 || maxOut != 30 {
		t.Fatalf("outstanding %d, max %d; want 30", n, maxOut)
	}
	close(pub.release)
	testenv.Eventually(t, 10*time.Second, "all settled", func() bool { return len(store.Outcomes()) == 100 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, o := range store.Outcomes() {
		if o.Settlement != event.Done {
			t.Fatalf("outcome %+v", o)
		}
	}
	if _, maxOut := pub.state(); maxOut != 30 {
		t.Fatalf("max outstanding %d", maxOut)
	}
}

// TestSettleWindow: ten batches acknowledged together are settled in one
// or two transactions with a settle window, and in ten without one; a lone
// batch is settled when its window ends.
func TestSettleWindow(t *testing.T) {
	for _, tc := range []struct {
		window  time.Duration
		settles func(n int) bool
	}{
		{0, func(n int) bool { return n == 10 }},
		{50 * time.Millisecond, func(n int) bool { return n <= 2 }},
	} {
		store := &testenv.MemStore{}
		store.AddN(100, "T", nil)
		pub := &heldPublisher{release: make(chan struct{})}
		r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 400, PollInterval: time.Millisecond,
			MaxAttempts: 3, ShutdownTimeout: time.Second, SettleWindow: tc.window})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		testenv.Eventually(t, 10*time.Second, "100 outstanding", func() bool { n, _ := pub.state(); return n == 100 })
		close(pub.release)
		testenv.Eventually(t, 10*time.Second, "all settled", func() bool { return len(store.Outcomes()) == 100 })
		_, settles := store.Settled()
		if !tc.settles(settles) {
			t.Errorf("window %v: 10 batches settled in %d transactions", tc.window, settles)
		}
		store.AddN(5, "T", nil) // a lone batch: settled when the window ends
		r.wakeClaimer()
		testenv.Eventually(t, 10*time.Second, "the lone batch settled", func() bool { return len(store.Outcomes()) == 105 })
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// laterHeldPublisher acknowledges its first batch at once and holds the
// acks of every later one until release is closed.
type laterHeldPublisher struct {
	heldPublisher
	calls int
}

func (p *laterHeldPublisher) Publish(ctx context.Context, msgs []publish.Message) []publish.Ack {
	p.mu.Lock()
	p.calls++
	first := p.calls == 1
	p.mu.Unlock()
	if !first {
		return p.heldPublisher.Publish(ctx, msgs)
	}
	acks := make([]publish.Ack, len(msgs))
	for i := range acks {
		acks[i] = storedAck{}
	}
	return acks
}

type storedAck struct{}

func (storedAck) Wait(context.Context) publish.Result { return publish.Result{Kind: publish.Stored} }

// TestSettleWindowDoesNotWaitForLaterAcks: a batch whose acks are in is
// settled when its window ends, while the next batch's acks are still
// outstanding.
func TestSettleWindowDoesNotWaitForLaterAcks(t *testing.T) {
	store := &testenv.MemStore{}
	store.AddN(20, "T", nil)
	pub := &laterHeldPublisher{heldPublisher: heldPublisher{release: make(chan struct{})}}
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 100, PollInterval: time.Millisecond,
		MaxAttempts: 3, ShutdownTimeout: time.Second, SettleWindow: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testenv.Eventually(t, 10*time.Second, "the first batch settled while the second is held", func() bool {
		n, _ := pub.state()
		return n == 10 && len(store.Outcomes()) == 10
	})
	close(pub.release)
	testenv.Eventually(t, 10*time.Second, "all settled", func() bool { return len(store.Outcomes()) == 20 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// closedPublisher fails every publish and reports a connection closed for good.
type closedPublisher struct{}

func (closedPublisher) Publish(_ context.Context, msgs []publish.Message) []publish.Ack {
	acks := make([]publish.Ack, len(msgs))
	for i := range acks {
		acks[i] = failedAck{}
	}
	return acks
}

func (closedPublisher) Ready(context.Context) error {
	return fmt.Errorf("probe: %w", publish.ErrClosed)
}

type failedAck struct{}

func (failedAck) Wait(context.Context) publish.Result {
	return publish.Result{Kind: publish.Transport, Err: publish.ErrClosed}
}

// TestClosedConnectionIsFatal: a connection nats.go closed for good can
// never recover; the relay releases its rows and Run returns the error so
// the process exits and is restarted, instead of pausing forever.
func TestClosedConnectionIsFatal(t *testing.T) {
	store := &testenv.MemStore{}
	store.AddN(5, "T", nil)
	flaky := &flakyReady{closedPublisher: closedPublisher{}}
	// The commit watch and the heartbeat run, as in the daemon: neither may keep Run from returning.
	r := New(store, flaky, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 10, MaxAttempts: 3, ShutdownTimeout: time.Second,
		WatchInterval: time.Millisecond, Lead: aloneLead{}, HeartbeatInterval: 10 * time.Millisecond})
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return after the connection closed for good")
	}
	if !errors.Is(err, publish.ErrClosed) {
		t.Fatalf("Run = %v, want ErrClosed", err)
	}
	outs := store.Outcomes()
	if len(outs) != 5 {
		t.Fatalf("%d outcomes, want 5 released", len(outs))
	}
	for _, o := range outs {
		if o.Settlement != event.Release {
			t.Fatalf("outcome %+v, want a release", o)
		}
	}
}

// flakyReady answers the first probe (so rows get claimed), then reports the
// connection closed.
type flakyReady struct {
	closedPublisher
	probes int
}

func (f *flakyReady) Ready(ctx context.Context) error {
	f.probes++
	if f.probes == 1 {
		return nil
	}
	return f.closedPublisher.Ready(ctx)
}

// aloneLead is the lead of a relay alone on its file: every heartbeat
// succeeds and it always leads.
type aloneLead struct{}

func (aloneLead) Heartbeat(context.Context, string, int, time.Duration, time.Duration) (int64, error) {
	return 0, nil
}
func (aloneLead) Leads() bool                              { return true }
func (aloneLead) StillLeads(context.Context) (bool, error) { return true, nil }
func (aloneLead) Leave(context.Context) error              { return nil }

// replacedLead is the lead on a file that was replaced before the relay's
// first heartbeat: every write says so.
type replacedLead struct{ aloneLead }

func (replacedLead) Heartbeat(context.Context, string, int, time.Duration, time.Duration) (int64, error) {
	return 0, fmt.Errorf("heartbeat: %w", event.ErrDatabaseReplaced)
}

// TestReplacedBeforeTheFirstHeartbeat: a database file replaced before the
// first heartbeat stops the relay with that error instead of a retry that
// can never succeed.
func TestReplacedBeforeTheFirstHeartbeat(t *testing.T) {
	r := New(&testenv.MemStore{}, &heldPublisher{release: make(chan struct{})}, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 10,
		PollInterval: time.Millisecond, Lead: replacedLead{}, HeartbeatInterval: time.Second, StaleAfter: 6 * time.Second, MaxAttempts: 3, ShutdownTimeout: time.Second})
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case err := <-done:
		if !errors.Is(err, event.ErrDatabaseReplaced) {
			t.Fatalf("Run returned %v, want event.ErrDatabaseReplaced", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run still retrying the first heartbeat on a replaced file after 30 s")
	}
}

// lockedStore is an outbox whose file the application keeps locked once
// rows are claimed: every settle waits until its context ends.
type lockedStore struct {
	testenv.MemStore
	gaveUp chan struct{} // closed when a settle's context ended
	once   sync.Once
}

func (s *lockedStore) Settle(ctx context.Context, _ []event.Outcome, _ uint64) ([]int, error) {
	<-ctx.Done()
	s.once.Do(func() { close(s.gaveUp) })
	return nil, fmt.Errorf("settle rows: %w", ctx.Err())
}

// TestClosedConnectionWithTheDatabaseLocked: when the connection closes for
// good while the released rows cannot be written (the application holds
// the lock), the relay still exits: it writes for a bounded time, and the
// rows stay pending in the table for the next relay.
func TestClosedConnectionWithTheDatabaseLocked(t *testing.T) {
	store := &lockedStore{gaveUp: make(chan struct{})}
	store.AddN(5, "T", nil)
	r := New(store, &flakyReady{closedPublisher: closedPublisher{}}, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 10,
		MaxAttempts: 3, ShutdownTimeout: 100 * time.Millisecond})
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case err := <-done:
		if !errors.Is(err, publish.ErrClosed) {
			t.Fatalf("Run = %v, want ErrClosed", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Run still waiting to settle on a locked database after the connection closed for good")
	}
	select {
	case <-store.gaveUp:
	default:
		t.Fatal("Run returned without trying to settle the released rows")
	}
}

// gatedStore is a MemStore whose Settle waits until open is closed.
type gatedStore struct {
	testenv.MemStore
	open chan struct{}
}

func (s *gatedStore) Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) ([]int, error) {
	select {
	case <-s.open:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return s.MemStore.Settle(ctx, outs, scanFrom)
}

// countingPublisher acknowledges every message at once and counts them.
type countingPublisher struct {
	mu   sync.Mutex
	sent int
}

func (p *countingPublisher) Publish(_ context.Context, msgs []publish.Message) []publish.Ack {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sent += len(msgs)
	acks := make([]publish.Ack, len(msgs))
	for i := range acks {
		acks[i] = storedAck{}
	}
	return acks
}

func (p *countingPublisher) Ready(context.Context) error { return nil }

func (p *countingPublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sent
}

// TestPayloadBudgetReturnsAtTheAck: the payload budget bounds what is
// claimed and not yet acknowledged, not what waits for its settle
// transaction: with every settle held up, rows of 1 KiB under a budget of
// 4 KiB are all published, and all settled once the store takes them.
func TestPayloadBudgetReturnsAtTheAck(t *testing.T) {
	store := &gatedStore{open: make(chan struct{})}
	store.AddN(40, "T", make([]byte, 1024))
	pub := &countingPublisher{}
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 2, MaxInFlight: 100, MaxInFlightBytes: 4096,
		PollInterval: time.Millisecond, MaxAttempts: 3, ShutdownTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testenv.Eventually(t, 10*time.Second, "40 rows published while no settle ends", func() bool { return pub.count() == 40 })
	close(store.open)
	testenv.Eventually(t, 10*time.Second, "all settled", func() bool { return len(store.Outcomes()) == 40 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// stalledLead leads, but its heartbeats wait while stalled is set (a
// relay stopped by SIGSTOP, or the application holding the write lock),
// and its row is gone from the table while lost is set (another relay
// judged it dead meanwhile).
type stalledLead struct {
	aloneLead
	stalled, lost atomic.Bool
}

func (l *stalledLead) Heartbeat(ctx context.Context, _ string, _ int, _, _ time.Duration) (int64, error) {
	for l.stalled.Load() && ctx.Err() == nil {
		time.Sleep(time.Millisecond)
	}
	return 0, ctx.Err()
}

func (l *stalledLead) StillLeads(context.Context) (bool, error) { return !l.lost.Load(), nil }

// startLed runs a relay on store and pub with lead, its heartbeats 10 ms
// apart and stale after 200 ms, until the test ends.
func startLed(t *testing.T, store Store, pub Publisher, lead Lead) *Relay {
	t.Helper()
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 10, PollInterval: time.Millisecond,
		Lead: lead, HeartbeatInterval: 10 * time.Millisecond, StaleAfter: 200 * time.Millisecond, MaxAttempts: 3, ShutdownTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return r
}

// oneKey is a store of three rows of one ordering key.
func oneKey() *testenv.MemStore {
	store := &testenv.MemStore{}
	now := time.Now().UnixMilli()
	for range 3 {
		store.Add(event.Row{EventType: "T", OrderingKey: "k", CreatedAt: now})
	}
	return store
}

// TestNoClaimOnALostLead: a relay whose latest heartbeat is older than
// half the staleness reads the lead again before it claims: while its row
// is gone (another relay judged it dead) it claims nothing, although it
// led at that heartbeat; while its row is there and first (the
// application holds the write lock, say) it claims as before.
func TestNoClaimOnALostLead(t *testing.T) {
	store := &testenv.MemStore{}
	store.AddN(1, "T", nil)
	pub := &countingPublisher{}
	lead := &stalledLead{}
	startLed(t, store, pub, lead)
	testenv.Eventually(t, 10*time.Second, "the first row published", func() bool { return pub.count() == 1 })
	lead.lost.Store(true)
	lead.stalled.Store(true)
	time.Sleep(300 * time.Millisecond) // the latest heartbeat is now older than 100 ms
	store.AddN(1, "T", nil)
	time.Sleep(300 * time.Millisecond)
	if n := pub.count(); n != 1 {
		t.Fatalf("%d rows published with the latest heartbeat 300 ms old and the row gone, want 1", n)
	}
	lead.lost.Store(false)
	testenv.Eventually(t, 10*time.Second, "the row published with the heartbeat late and the row there", func() bool { return pub.count() == 2 })
}

// gatedPublisher sends at once and acknowledges every message (as
// stored) once gate is closed.
type gatedPublisher struct {
	countingPublisher
	gate chan struct{}
}

type gatedAck struct{ gate chan struct{} }

func (a gatedAck) Wait(ctx context.Context) publish.Result {
	select {
	case <-a.gate:
		return publish.Result{Kind: publish.Stored, Seq: 1}
	case <-ctx.Done():
		return publish.Result{Kind: publish.Transport, Err: ctx.Err()}
	}
}

func (p *gatedPublisher) Publish(ctx context.Context, msgs []publish.Message) []publish.Ack {
	p.countingPublisher.Publish(ctx, msgs)
	acks := make([]publish.Ack, len(msgs))
	for i := range acks {
		acks[i] = gatedAck{p.gate}
	}
	return acks
}

// TestKeySendsNothingOnALostLead: the rows of a key wait in memory for
// the row before them; its acknowledgement arrives once the relay's
// heartbeat is late and its row gone: they are not sent.
func TestKeySendsNothingOnALostLead(t *testing.T) {
	pub := &gatedPublisher{gate: make(chan struct{})}
	lead := &stalledLead{}
	startLed(t, oneKey(), pub, lead)
	testenv.Eventually(t, 10*time.Second, "the key's first row sent", func() bool { return pub.count() == 1 })
	lead.lost.Store(true)
	lead.stalled.Store(true)
	time.Sleep(300 * time.Millisecond)
	close(pub.gate) // the first row's acknowledgement
	time.Sleep(300 * time.Millisecond)
	if n := pub.count(); n != 1 {
		t.Fatalf("%d messages sent, %d of them after the lead was lost", n, n-1)
	}
}

// deposedLead is a stalledLead whose heartbeats say another relay leads
// while standby is set.
type deposedLead struct {
	stalledLead
	standby atomic.Bool
}

func (l *deposedLead) Leads() bool { return !l.standby.Load() }

// TestKeySendsNothingOnceAHeartbeatSaysStandby: the relay was stopped
// past the staleness and judged dead; resumed, its heartbeat commits and
// says another relay leads. An acknowledgement that comes after it does
// not send the key's next rows, although the heartbeat is fresh.
func TestKeySendsNothingOnceAHeartbeatSaysStandby(t *testing.T) {
	pub := &gatedPublisher{gate: make(chan struct{})}
	lead := &deposedLead{}
	r := startLed(t, oneKey(), pub, lead)
	testenv.Eventually(t, 10*time.Second, "the key's first row sent", func() bool { return pub.count() == 1 })
	lead.standby.Store(true)
	testenv.Eventually(t, 10*time.Second, "the relay stands by", func() bool { return !r.Leads() })
	close(pub.gate) // the first row's acknowledgement, after that heartbeat
	time.Sleep(300 * time.Millisecond)
	if n := pub.count(); n != 1 {
		t.Fatalf("%d messages sent, %d of them by a relay whose heartbeat said it does not lead", n, n-1)
	}
}
