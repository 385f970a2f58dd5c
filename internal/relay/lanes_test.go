package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// scriptedPublisher records the rows it is given and holds each ack until
// the test answers it.
type scriptedPublisher struct {
	mu      sync.Mutex
	sent    []int64
	answers map[int64]chan publish.Result
}

type scriptedAck chan publish.Result

func (a scriptedAck) Wait(ctx context.Context) publish.Result {
	select {
	case r := <-a:
		return r
	case <-ctx.Done():
		return publish.Result{Kind: publish.Transport, Err: ctx.Err()}
	}
}

func (p *scriptedPublisher) Publish(_ context.Context, msgs []publish.Message) []publish.Ack {
	p.mu.Lock()
	defer p.mu.Unlock()
	acks := make([]publish.Ack, len(msgs))
	for i, m := range msgs {
		p.sent = append(p.sent, m.Row.ID)
		ch := make(chan publish.Result, 1)
		p.answers[m.Row.ID] = ch
		acks[i] = scriptedAck(ch)
	}
	return acks
}

func (p *scriptedPublisher) Ready(context.Context) error { return nil }

func (p *scriptedPublisher) sentIDs() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.sent)
}

func (p *scriptedPublisher) answer(id int64, r publish.Result) {
	p.mu.Lock()
	ch := p.answers[id]
	p.mu.Unlock()
	ch <- r
}

// TestKeyRowsGoOneAtATime: a key's next row is sent only after the broker
// stored the one before it; rows of other keys and unordered rows go at
// once. When a key's row is refused, the rows behind it are not sent but
// released (no attempt spent, deferred for ordering); once they are all
// settled the key sends again.
func TestKeyRowsGoOneAtATime(t *testing.T) {
	store := &testenv.MemStore{}
	for i, key := range []string{"a", "b", "a", "a", ""} {
		store.Add(event.Row{ID: int64(i + 1), EventType: "T", OrderingKey: key})
	}
	pub := &scriptedPublisher{answers: map[int64]chan publish.Result{}}
	m := metrics.New("", "")
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 10, MaxInFlight: 10, PollInterval: 10 * time.Millisecond,
		MaxAttempts: 3, ShutdownTimeout: time.Second, Metrics: m})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	sent := func(want ...int64) {
		t.Helper()
		testenv.Eventually(t, 5*time.Second, fmt.Sprintf("rows %v sent", want), func() bool {
			got := pub.sentIDs()
			slices.Sort(got)
			return slices.Equal(got, want)
		})
	}
	sent(1, 2, 5)
	time.Sleep(50 * time.Millisecond) // row 3 must wait for row 1's ack
	sent(1, 2, 5)
	pub.answer(2, publish.Result{Kind: publish.Stored})
	pub.answer(5, publish.Result{Kind: publish.Stored})
	pub.answer(1, publish.Result{Kind: publish.Stored})
	sent(1, 2, 3, 5)
	pub.answer(3, publish.Result{Kind: publish.Rejected, Err: errors.New("message size exceeds maximum allowed")})
	testenv.Eventually(t, 5*time.Second, "five rows settled", func() bool { return len(store.Outcomes()) == 5 })
	got := map[int64]event.Outcome{}
	for _, o := range store.Outcomes() {
		got[o.Row.ID] = o
	}
	if got[3].Settlement != event.Retry || got[4].Settlement != event.Release || got[4].Reason != metrics.DeferOrdering {
		t.Fatalf("row 3 %v, row 4 %v (%s): want retry, and release for ordering", got[3].Settlement, got[4].Settlement, got[4].Reason)
	}
	if slices.Contains(pub.sentIDs(), 4) {
		t.Fatal("row 4 was sent although row 3 before it was refused")
	}
	// Counted right after the settle.
	testenv.Eventually(t, 5*time.Second, "deferred_total{reason=ordering} 1", func() bool {
		return metrics.Value(m.Deferred.WithLabelValues(metrics.DeferOrdering)) == 1
	})
	// Everything of key a is settled: a new row of it is sent (in the
	// relay, the claim decides whether it may come).
	store.Add(event.Row{ID: 6, EventType: "T", OrderingKey: "a"})
	r.wakeClaimer()
	sent(1, 2, 3, 5, 6)
}

// TestInvalidRowWaitsForItsTurn: a row of a key that can never be published
// is dead-lettered only when it is its key's next row. Behind a row the
// broker refused it is released with the rest of the key, so that a dead
// letter never passes an earlier row still to go (with
// ordering.on_dead_letter: skip, the rows behind it would go next).
func TestInvalidRowWaitsForItsTurn(t *testing.T) {
	store := &testenv.MemStore{}
	for i, r := range []struct{ key, typ string }{
		{"a", "T"}, {"a", "bad type"}, {"a", "T"}, // behind a refused row
		{"b", "T"}, {"b", "bad type"}, {"b", "T"}, // behind a stored row
		{"c", "bad type"}, {"c", "T"}, // first of its key
	} {
		store.Add(event.Row{ID: int64(i + 1), EventType: r.typ, OrderingKey: r.key})
	}
	pub := &scriptedPublisher{answers: map[int64]chan publish.Result{}}
	runRelay(t, store, pub)
	testenv.Eventually(t, 5*time.Second, "rows 1 and 4 sent", func() bool { return len(pub.sentIDs()) == 2 })
	pub.answer(1, publish.Result{Kind: publish.Rejected, Err: errors.New("refused")})
	pub.answer(4, publish.Result{Kind: publish.Stored})
	testenv.Eventually(t, 5*time.Second, "eight rows settled", func() bool { return len(store.Outcomes()) == 8 })
	got := map[int64]event.Outcome{}
	for _, o := range store.Outcomes() {
		got[o.Row.ID] = o
	}
	want := map[int64]event.Settlement{1: event.Retry, 2: event.Release, 3: event.Release, 4: event.Done, 5: event.DeadLetter, 6: event.Release, 7: event.DeadLetter, 8: event.Release}
	for id, s := range want {
		if got[id].Settlement != s {
			t.Errorf("row %d: %v, want %v", id, got[id].Settlement, s)
		}
	}
	if got[5].Error == "" || got[7].Error == "" {
		t.Errorf("dead letters without a reason: %q, %q", got[5].Error, got[7].Error)
	}
	if sent := pub.sentIDs(); len(sent) != 2 {
		t.Errorf("sent %v; only rows 1 and 4 may go", sent)
	}
}

// TestLaneWaitsForTheClaimsThatSawItsWithheldRows: a claim that began
// before a withheld row of a blocked key was settled may read that row as
// in flight (settled since the claim began) and take the row after it.
// The key must not send that row: the lane sends again only for claims
// that began after every row it withheld was settled, not only the row
// that failed first.
func TestLaneWaitsForTheClaimsThatSawItsWithheldRows(t *testing.T) {
	l := newLanes()
	row := func(id int64) publish.Message {
		return publish.Message{Row: event.Row{ID: id, OrderingKey: "k"}}
	}
	settle := func(a *laneAck, claimSeq uint64) {
		l.settled([]event.Outcome{{Row: a.msg.Row}}, claimSeq)
	}
	// Claim 1 takes row 1, which is sent and refused.
	first, send := l.add(row(1), nil, 1)
	if send == nil {
		t.Fatal("row 1, its key's first, was not sent")
	}
	l.sent(first, scriptedAck(make(chan publish.Result)))
	if next, _ := l.resolved(first, publish.Result{Kind: publish.Rejected}, nil); next != nil {
		t.Fatal("a row was sent after a refused one")
	}
	// Claim 2 has begun when row 1's retry is settled.
	settle(first, 2)
	// Claim 2 read row 1 as settled meanwhile, took row 2 after it, and
	// row 2 is withheld.
	second, send := l.add(row(2), nil, 2)
	if send != nil || second.res.Kind != publish.Withheld {
		t.Fatalf("row 2 of a claim begun before the refusal was settled: sent %v, result %v", send != nil, second.res.Kind)
	}
	// Claim 3 has begun when row 2's release is settled: it may have read
	// row 2 as settled meanwhile, and taken row 3 after it.
	settle(second, 3)
	third, send := l.add(row(3), nil, 3)
	if send != nil || third.res.Kind != publish.Withheld {
		t.Fatalf("row 3 of a claim begun before row 2 was settled: sent %v, result %v", send != nil, third.res.Kind)
	}
	settle(third, 3)
	// Claim 4 began after every row of the key was settled: the table
	// decides what it took, and the key sends.
	if _, send := l.add(row(4), nil, 4); send == nil {
		t.Fatal("row 4 of a claim begun after the key was settled was not sent")
	}
}
