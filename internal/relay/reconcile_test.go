package relay

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// markStore is a MemStore that records the stream position each settle
// writes (0: none).
type markStore struct {
	testenv.MemStore
	mu    sync.Mutex
	marks []uint64
}

func (s *markStore) Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) ([]int, error) {
	s.mu.Lock()
	s.marks = append(s.marks, scanFrom)
	s.mu.Unlock()
	return s.MemStore.Settle(ctx, outs, scanFrom)
}

// written returns the positions written so far.
func (s *markStore) written() []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []uint64
	for _, m := range s.marks {
		if m > 0 {
			out = append(out, m)
		}
	}
	return out
}

// seqPublisher stores every message at the next stream sequence.
type seqPublisher struct{ seq atomic.Uint64 }

func (p *seqPublisher) Publish(_ context.Context, msgs []publish.Message) []publish.Ack {
	acks := make([]publish.Ack, len(msgs))
	for i := range acks {
		acks[i] = knownAck{Kind: publish.Stored, Seq: p.seq.Add(1)}
	}
	return acks
}

func (p *seqPublisher) Ready(context.Context) error { return nil }

// TestThePositionIsWrittenAtMostOnceASecond: at a trickle of one-row
// settles the stream position goes into one settle a second (a page of
// WAL each), and into the last one before the relay stops, where, with
// nothing in flight, it is past every message stored.
func TestThePositionIsWrittenAtMostOnceASecond(t *testing.T) {
	var now atomic.Int64
	now.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	store := &markStore{}
	pub := &seqPublisher{}
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 10, PollInterval: 10 * time.Millisecond,
		MaxAttempts: 3, ShutdownTimeout: time.Second, Clock: event.NewClock(func() time.Time { return time.Unix(0, now.Load()) }),
		Reconcile: func(context.Context) (Reconciled, error) { return Reconciled{}, nil }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	trickle := func(rows int) {
		for range rows {
			before, _ := store.Settled()
			store.AddN(1, "T", nil)
			testenv.Eventually(t, 10*time.Second, "the row settled", func() bool { n, _ := store.Settled(); return n == before+1 })
		}
	}
	trickle(5)
	if got := store.written(); len(got) != 1 {
		t.Fatalf("positions written in five one-row settles within a second: %v, want one", got)
	}
	now.Add(int64(time.Second))
	trickle(1)
	if got := store.written(); len(got) != 2 || got[1] != 7 {
		t.Fatalf("positions written: %v, want a second one a second later, past the 6 messages stored", got)
	}
	trickle(2)
	cancel()
	<-done
	if got := store.written(); len(got) != 3 || got[2] != 9 {
		t.Fatalf("positions written: %v, want a last one at shutdown, past the 8 messages stored", got)
	}
}
