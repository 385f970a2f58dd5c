package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
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

// waitSent waits until the rows sent are want, in any order.
func (p *scriptedPublisher) waitSent(t *testing.T, want ...int64) {
	t.Helper()
	testenv.Eventually(t, 5*time.Second, fmt.Sprintf("rows %v sent", want), func() bool {
		got := p.sentIDs()
		slices.Sort(got)
		return slices.Equal(got, want)
	})
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
		pub.waitSent(t, want...)
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
	if next := l.resolved(first, publish.Result{Kind: publish.Rejected}, nil, 0); next != nil {
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

// TestShutdownBlocksTheKeyItReleases: at shutdown a stored row's key does
// not send its next row, which is released instead. The key must then
// send nothing more: a claim under way when shutdown began (the claim
// loop publishes what it returns) may have read the released row as in
// flight and taken the row behind it, which would be stored while the
// released row waits in the table.
func TestShutdownBlocksTheKeyItReleases(t *testing.T) {
	l := newLanes()
	row := func(id int64) publish.Message {
		return publish.Message{Row: event.Row{ID: id, OrderingKey: "k"}}
	}
	// Claim 1 takes rows 1 and 2: row 1 is sent, row 2 waits behind it.
	first, send := l.add(row(1), nil, 1)
	if send == nil {
		t.Fatal("row 1, its key's first, was not sent")
	}
	second, send := l.add(row(2), nil, 1)
	if send != nil {
		t.Fatal("row 2 was sent before row 1 was stored")
	}
	l.sent(first, scriptedAck(make(chan publish.Result)))
	// Shutdown begins; row 1 is stored, and row 2 is not sent.
	if next := l.resolved(first, publish.Result{Kind: publish.Stored}, context.Canceled, 0); next != nil {
		t.Fatal("a row was sent after shutdown began")
	}
	if second.ack != nil || (second.res.Kind != publish.Transport && second.res.Kind != publish.Withheld) {
		t.Fatalf("row 2 at shutdown: sent %v, result %v; want released unsent", second.ack != nil, second.res.Kind)
	}
	// Claim 2, under way when shutdown began, read row 2 as in flight and
	// took row 3.
	if _, send := l.add(row(3), nil, 2); send != nil {
		t.Fatal("row 3 was sent while row 2 before it is released at shutdown")
	}
}

// shutdownClaimStore hands out its first claim at once and holds the second until
// proceed is closed, announcing it on entered.
type shutdownClaimStore struct {
	*testenv.MemStore
	claims  int
	second  []event.Row
	entered chan struct{}
	proceed chan struct{}
}

func (s *shutdownClaimStore) Claim(ctx context.Context, limit int, maxBytes int64) ([]event.Row, error) {
	s.claims++
	switch s.claims {
	case 1:
		return s.MemStore.Claim(ctx, limit, maxBytes)
	case 2:
		close(s.entered)
		<-s.proceed
		return s.second, nil
	}
	return nil, nil
}

// TestClaimUnderWayAtShutdownKeepsKeyOrder: the relay is stopped while a
// claim reads the table. Row 1 of a key is stored after that, so row 2,
// queued behind it, is released unsent; the claim under way, which read
// row 2 as in flight, returns row 3 of the key. Row 3 must not be sent:
// it would be stored before row 2, which the next run publishes.
func TestClaimUnderWayAtShutdownKeepsKeyOrder(t *testing.T) {
	mem := &testenv.MemStore{}
	mem.Add(event.Row{ID: 1, EventType: "T", OrderingKey: "a"}, event.Row{ID: 2, EventType: "T", OrderingKey: "a"})
	store := &shutdownClaimStore{MemStore: mem, second: []event.Row{{ID: 3, EventID: event.NewID(), EventType: "T", OrderingKey: "a"}},
		entered: make(chan struct{}), proceed: make(chan struct{})}
	pub := &scriptedPublisher{answers: map[int64]chan publish.Result{}}
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 2, MaxInFlight: 10, PollInterval: 10 * time.Millisecond,
		MaxAttempts: 3, ShutdownTimeout: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-store.entered // claim 2 reads the table: rows 1 and 2 are in flight
	if sent := pub.sentIDs(); !slices.Equal(sent, []int64{1}) {
		t.Fatalf("sent %v before the second claim; want [1]", sent)
	}
	cancel()
	pub.answer(1, publish.Result{Kind: publish.Stored})
	testenv.Eventually(t, 5*time.Second, "rows 1 and 2 settled", func() bool { return len(store.Outcomes()) == 2 })
	got := map[int64]event.Outcome{}
	for _, o := range store.Outcomes() {
		got[o.Row.ID] = o
	}
	if got[1].Settlement != event.Done || got[2].Settlement != event.Release {
		t.Fatalf("row 1 %v, row 2 %v: want done, and released at shutdown", got[1].Settlement, got[2].Settlement)
	}
	close(store.proceed) // claim 2 returns row 3, taken behind row 2
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if slices.Contains(pub.sentIDs(), 3) {
		t.Fatalf("sent %v: row 3 went out while row 2 before it was released pending", pub.sentIDs())
	}
}

// scriptedBatcher is a scriptedPublisher that also takes atomic batches:
// it records each batch's rows, and a batch's messages are answered one
// by one like any other.
type scriptedBatcher struct {
	*scriptedPublisher
	limit   int
	batches [][]int64
	groups  int // of batches, the atomic groups
}

func (p *scriptedBatcher) BatchRoom() int { return p.limit }

func (p *scriptedBatcher) PublishBatch(ctx context.Context, msgs []publish.Message) []publish.Ack {
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		ids[i] = m.Row.ID
	}
	p.mu.Lock()
	p.batches = append(p.batches, ids)
	p.mu.Unlock()
	return p.Publish(ctx, msgs)
}

func (p *scriptedBatcher) batchIDs() [][]int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.batches)
}

// TestKeyRowsGoInAtomicBatches: where many rows of a key wait, they go as
// one atomic batch (up to the publisher's limit) once the rows before them
// are stored; a few go one at a time. A row of a batch that is not stored
// withholds the rest of its key, as a row sent alone does.
func TestKeyRowsGoInAtomicBatches(t *testing.T) {
	store := &testenv.MemStore{}
	const rows = 1 + 50 + 40 + 5
	for i := range rows {
		store.Add(event.Row{ID: int64(i + 1), EventType: "T", OrderingKey: "a"})
	}
	pub := &scriptedBatcher{scriptedPublisher: &scriptedPublisher{answers: map[int64]chan publish.Result{}}, limit: 50}
	runRelay(t, store, pub)
	testenv.Eventually(t, 5*time.Second, "row 1 sent alone", func() bool { return len(pub.sentIDs()) == 1 })
	pub.answer(1, publish.Result{Kind: publish.Stored, Seq: 1})
	testenv.Eventually(t, 5*time.Second, "a batch of 50", func() bool { return len(pub.batchIDs()) == 1 })
	if b := pub.batchIDs()[0]; len(b) != 50 || b[0] != 2 || b[49] != 51 {
		t.Fatalf("first batch %v, want rows 2 to 51", b)
	}
	for id := int64(2); id <= 51; id++ {
		pub.answer(id, publish.Result{Kind: publish.Stored, Seq: uint64(id)})
	}
	testenv.Eventually(t, 5*time.Second, "a second batch", func() bool { return len(pub.batchIDs()) == 2 })
	second := pub.batchIDs()[1]
	if len(second) != rows-51 || second[0] != 52 {
		t.Fatalf("second batch %v, want rows 52 to %d", second, rows)
	}
	// Row 60 of the batch is refused (the batch was published again one
	// message at a time): 52..59 are stored, the rest withheld.
	for _, id := range second {
		switch {
		case id < 60:
			pub.answer(id, publish.Result{Kind: publish.Stored, Seq: uint64(id)})
		case id == 60:
			pub.answer(id, publish.Result{Kind: publish.Rejected, Err: errors.New("permission denied")})
		default:
			pub.answer(id, publish.Result{Kind: publish.Withheld, Err: errors.New("row 60 before it in the batch was not stored")})
		}
	}
	testenv.Eventually(t, 5*time.Second, "every row settled", func() bool { return len(store.Outcomes()) == rows })
	for _, o := range store.Outcomes() {
		want := event.Done
		switch {
		case o.Row.ID == 60:
			want = event.Retry
		case o.Row.ID > 60:
			want = event.Release
		}
		if o.Settlement != want || (want == event.Done && o.StreamSeq != uint64(o.Row.ID)) {
			t.Fatalf("row %d: %v at sequence %d, want %v", o.Row.ID, o.Settlement, o.StreamSeq, want)
		}
	}
	if n := len(pub.sentIDs()); n != rows {
		t.Fatalf("%d messages sent, want each row once", n)
	}
}

// TestFewKeyRowsGoOneAtATime: below minBatch rows waiting, a key's rows go
// one at a time even where batches are taken.
func TestFewKeyRowsGoOneAtATime(t *testing.T) {
	store := &testenv.MemStore{}
	for i := range minBatch {
		store.Add(event.Row{ID: int64(i + 1), EventType: "T", OrderingKey: "a"})
	}
	pub := &scriptedBatcher{scriptedPublisher: &scriptedPublisher{answers: map[int64]chan publish.Result{}}, limit: 1000}
	runRelay(t, store, pub)
	for id := int64(1); id <= minBatch; id++ {
		testenv.Eventually(t, 5*time.Second, fmt.Sprintf("row %d sent", id), func() bool { return len(pub.sentIDs()) == int(id) })
		pub.answer(id, publish.Result{Kind: publish.Stored, Seq: uint64(id)})
	}
	if b := pub.batchIDs(); len(b) != 0 {
		t.Fatalf("batches %v of a key with %d rows waiting behind its first", b, minBatch-1)
	}
}

func (p *scriptedBatcher) PublishGroup(ctx context.Context, msgs []publish.Message) []publish.Ack {
	p.mu.Lock()
	p.groups++
	p.mu.Unlock()
	return p.PublishBatch(ctx, msgs)
}

// groupRows adds rows to store: {key, group} each, ids from 1.
func groupRows(store *testenv.MemStore, rows ...[2]string) {
	for i, r := range rows {
		store.Add(event.Row{ID: int64(i + 1), EventID: fmt.Sprint("e", i+1), EventType: "T", OrderingKey: r[0], Group: r[1]})
	}
}

// outcomesByID waits until n rows are settled and returns their outcomes.
func outcomesByID(t *testing.T, store *testenv.MemStore, n int) map[int64]event.Outcome {
	t.Helper()
	testenv.Eventually(t, 5*time.Second, fmt.Sprintf("%d rows settled", n), func() bool { return len(store.Outcomes()) == n })
	got := map[int64]event.Outcome{}
	for _, o := range store.Outcomes() {
		got[o.Row.ID] = o
	}
	return got
}

// TestGroupWaitsForEachOfItsKeys: an atomic group goes as one batch once
// the rows before it of every key it has rows of are stored, and the rows
// of those keys after it wait for it.
func TestGroupWaitsForEachOfItsKeys(t *testing.T) {
	store := &testenv.MemStore{}
	groupRows(store, [2]string{"a", ""}, [2]string{"b", ""}, [2]string{"a", "g"}, [2]string{"b", "g"}, [2]string{"", "g"}, [2]string{"a", ""}, [2]string{"", ""})
	pub := &scriptedBatcher{scriptedPublisher: &scriptedPublisher{answers: map[int64]chan publish.Result{}}, limit: 1000}
	runRelay(t, store, pub)
	sent := func(want ...int64) {
		t.Helper()
		pub.waitSent(t, want...)
	}
	sent(1, 2, 7)
	pub.answer(1, publish.Result{Kind: publish.Stored, Seq: 1})
	time.Sleep(50 * time.Millisecond) // the group must still wait for row 2, of key b
	sent(1, 2, 7)
	pub.answer(2, publish.Result{Kind: publish.Stored, Seq: 2})
	sent(1, 2, 3, 4, 5, 7)
	if b := pub.batchIDs(); len(b) != 1 || !slices.Equal(b[0], []int64{3, 4, 5}) || pub.groups != 1 {
		t.Fatalf("batches %v (%d groups), want the group's rows 3, 4, 5 as one", b, pub.groups)
	}
	for id := int64(3); id <= 5; id++ {
		pub.answer(id, publish.Result{Kind: publish.Stored, Seq: uint64(id)})
	}
	sent(1, 2, 3, 4, 5, 6, 7)
	pub.answer(6, publish.Result{Kind: publish.Stored, Seq: 6})
	pub.answer(7, publish.Result{Kind: publish.Stored, Seq: 7})
	for id, o := range outcomesByID(t, store, 7) {
		if o.Settlement != event.Done {
			t.Fatalf("row %d %v, want done", id, o.Settlement)
		}
	}
}

// TestRefusedGroupHoldsItsKeys: a group the broker refuses spends an
// attempt on each of its rows alike, and the rows of its keys behind it
// wait (released, no attempt spent).
func TestRefusedGroupHoldsItsKeys(t *testing.T) {
	store := &testenv.MemStore{}
	groupRows(store, [2]string{"a", "g"}, [2]string{"", "g"}, [2]string{"b", "g"}, [2]string{"a", ""}, [2]string{"b", ""}, [2]string{"c", ""})
	pub := &scriptedBatcher{scriptedPublisher: &scriptedPublisher{answers: map[int64]chan publish.Result{}}, limit: 1000}
	runRelay(t, store, pub)
	testenv.Eventually(t, 5*time.Second, "the group and row 6 sent", func() bool { return len(pub.sentIDs()) == 4 })
	refused := publish.Result{Kind: publish.Rejected, Err: errors.New(`atomic group "g" was not stored: its row 3 was refused`)}
	for _, id := range []int64{1, 2, 3} {
		pub.answer(id, refused)
	}
	pub.answer(6, publish.Result{Kind: publish.Stored, Seq: 1})
	got := outcomesByID(t, store, 6)
	for id := int64(1); id <= 3; id++ {
		if o := got[id]; o.Settlement != event.Retry || o.Attempts != 1 {
			t.Errorf("group row %d: %v after %d attempts, want a retry after 1", id, o.Settlement, o.Attempts)
		}
	}
	for _, id := range []int64{4, 5} {
		if o := got[id]; o.Settlement != event.Release || o.Reason != metrics.DeferOrdering {
			t.Errorf("row %d behind the group: %v (%s), want released for ordering", id, o.Settlement, o.Reason)
		}
	}
	if slices.Contains(pub.sentIDs(), 4) || slices.Contains(pub.sentIDs(), 5) {
		t.Fatalf("sent %v: a row behind the refused group went out", pub.sentIDs())
	}
}

// TestGroupBehindAFailedRowIsWithheldWhole: a group one of whose keys
// stops before it (a row refused) is withheld whole, and holds its other
// keys too; an invalid row makes its group a dead letter as a whole.
func TestGroupBehindAFailedRowIsWithheldWhole(t *testing.T) {
	store := &testenv.MemStore{}
	groupRows(store, [2]string{"a", ""}, [2]string{"a", "g"}, [2]string{"b", "g"}, [2]string{"b", ""}, [2]string{"", "bad"}, [2]string{"c", "bad"})
	store.Add(event.Row{ID: 7, EventID: "e7", EventType: "no spaces allowed", Group: "bad"})
	pub := &scriptedBatcher{scriptedPublisher: &scriptedPublisher{answers: map[int64]chan publish.Result{}}, limit: 1000}
	runRelay(t, store, pub)
	testenv.Eventually(t, 5*time.Second, "row 1 sent", func() bool { return len(pub.sentIDs()) == 1 })
	pub.answer(1, publish.Result{Kind: publish.Rejected, Err: errors.New("permission denied")})
	got := outcomesByID(t, store, 7)
	if o := got[1]; o.Settlement != event.Retry {
		t.Errorf("row 1 %v, want a retry", o.Settlement)
	}
	for _, id := range []int64{2, 3, 4} {
		if o := got[id]; o.Settlement != event.Release || o.Attempts != 0 {
			t.Errorf("row %d: %v after %d attempts, want released without an attempt", id, o.Settlement, o.Attempts)
		}
	}
	for _, id := range []int64{5, 6, 7} {
		o := got[id]
		if o.Settlement != event.DeadLetter || !strings.Contains(o.Error, `atomic group "bad" cannot be published: its row 7`) {
			t.Errorf("row %d: %v (%s), want dead-lettered with its group", id, o.Settlement, o.Error)
		}
	}
	if s := pub.sentIDs(); len(s) != 1 {
		t.Fatalf("sent %v, want row 1 only", s)
	}
}

// TestGroupsHeldWithoutAtomicBatches: a publisher that takes no atomic
// batches holds a group's rows (released for later, no attempt spent)
// rather than publishing them in parts; a group of one row goes as any
// row.
func TestGroupsHeldWithoutAtomicBatches(t *testing.T) {
	store := &testenv.MemStore{}
	groupRows(store, [2]string{"", "g"}, [2]string{"a", "g"}, [2]string{"", ""}, [2]string{"a", ""}, [2]string{"", "one"})
	pub := &scriptedPublisher{answers: map[int64]chan publish.Result{}}
	m := metrics.New("", "")
	r := New(store, pub, Options{SubjectPrefix: "events", BatchSize: 100, MaxInFlight: 500, PollInterval: 20 * time.Millisecond, MaxAttempts: 3, ShutdownTimeout: time.Second, Metrics: m})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	testenv.Eventually(t, 5*time.Second, "rows 3 and 5 sent", func() bool { return len(pub.sentIDs()) == 2 })
	pub.answer(3, publish.Result{Kind: publish.Stored, Seq: 1})
	pub.answer(5, publish.Result{Kind: publish.Stored, Seq: 2})
	got := outcomesByID(t, store, 5)
	for _, id := range []int64{1, 2} {
		if o := got[id]; o.Settlement != event.Release || o.Reason != metrics.DeferGroupsHeld || !o.AvailableAt.After(time.Now().Add(10*time.Second)) {
			t.Errorf("group row %d: %v (%s) until %v, want held for later", id, o.Settlement, o.Reason, o.AvailableAt)
		}
	}
	if o := got[4]; o.Settlement != event.Release || o.Reason != metrics.DeferOrdering {
		t.Errorf("row 4 behind the held group: %v (%s), want released for ordering", o.Settlement, o.Reason)
	}
	s := pub.sentIDs()
	slices.Sort(s)
	if !slices.Equal(s, []int64{3, 5}) {
		t.Fatalf("sent %v, want rows 3 and 5 only", s)
	}
}

// TestGroupRowsEndAlike: the rows of an atomic group settle alike even
// when the wait for the first ends (at shutdown) before the group's
// answer, which then comes for the second: both are released, no attempt
// spent on either.
func TestGroupRowsEndAlike(t *testing.T) {
	l := newLanes()
	acks, send := l.addGroup([]publish.Message{{Row: event.Row{ID: 1, Group: "g"}}, {Row: event.Row{ID: 2, Group: "g"}}}, nil, 1)
	if len(send) != 2 {
		t.Fatalf("a group of no key is sent at once; got %d rows to send", len(send))
	}
	answer := make(chan publish.Result, 2)
	for _, a := range acks {
		l.sent(a, scriptedAck(answer))
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	first := acks[0].Wait(ended)
	answer <- publish.Result{Kind: publish.Rejected, Err: errors.New("refused")}
	answer <- publish.Result{Kind: publish.Rejected, Err: errors.New("refused")}
	if second := acks[1].Wait(context.Background()); first.Kind != publish.Transport || second.Kind != first.Kind {
		t.Fatalf("rows of one group: %v and %v; want both the first's (transport)", first.Kind, second.Kind)
	}
}
