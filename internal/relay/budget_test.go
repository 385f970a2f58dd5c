package relay

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// takeAsync asks b for rows in a goroutine; the room comes on the channel.
func takeAsync(ctx context.Context, b *Budget, rows int64) <-chan room {
	got := make(chan room, 1)
	go func() {
		r, ok := b.take(ctx, rows, trickleRows)
		if ok {
			got <- r
		}
		close(got)
	}()
	return got
}

// queued waits until n relays wait for room.
func queued(t *testing.T, b *Budget, n int) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "relays waiting", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return len(b.queue) == n
	})
}

// stillWaiting fails unless n relays still wait: give serves them before
// it returns.
func stillWaiting(t *testing.T, b *Budget, n int) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.queue) != n {
		t.Fatalf("%d relays waiting, want %d: room was given", len(b.queue), n)
	}
}

func free(b *Budget) room {
	b.mu.Lock()
	defer b.mu.Unlock()
	return room{b.rows, b.bytes}
}

// shareBudget runs relays relays, each on a store of rows rows, with o
// (its MaxInFlight, Budget and SettleWindow) and test timings; stop stops
// them and fails the test if one returned an error.
func shareBudget(t *testing.T, relays, rows int, pub Publisher, o Options) (stores []*testenv.MemStore, stop func()) {
	t.Helper()
	o.SubjectPrefix, o.BatchSize, o.PollInterval, o.MaxAttempts, o.ShutdownTimeout = "events", 50, time.Millisecond, 3, time.Second
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, relays)
	for range relays {
		store := &testenv.MemStore{}
		store.AddN(rows, "T", nil)
		stores = append(stores, store)
		r := New(store, pub, o)
		go func() { done <- r.Run(ctx) }()
	}
	return stores, func() {
		cancel()
		for range relays {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestBudgetTurns: room goes to the relays in the order they asked, once
// there is enough for a worthwhile claim; a relay with few rows in flight
// is given a few at once, past the budget.
func TestBudgetTurns(t *testing.T) {
	ctx := context.Background()
	b := NewBudget(100, 0)
	if r, _ := b.take(ctx, 100, trickleRows); r.rows != 100 {
		t.Fatalf("alone: given %d rows, want 100", r.rows)
	}
	first := takeAsync(ctx, b, 50)
	queued(t, b, 1)
	second := takeAsync(ctx, b, 50)
	queued(t, b, 2)

	b.give(room{rows: 10}) // less than a quarter: no claim worth it
	stillWaiting(t, b, 2)
	b.give(room{rows: 20})
	if r := <-first; r.rows != 30 {
		t.Fatalf("first: given %d rows, want the 30 free", r.rows)
	}
	b.give(room{rows: 70})
	if r := <-second; r.rows != 50 {
		t.Fatalf("second: given %d rows, want the 50 it asked", r.rows)
	}
	// Alone, a relay is given whatever is free, as a relay of its own
	// claims it: the 20 rows left.
	if r, _ := b.take(ctx, 50, trickleRows); r.rows != 20 {
		t.Fatalf("alone: given %d rows, want the 20 free", r.rows)
	}

	// The budget is spent and nobody waits: a relay with 3 rows in
	// flight is still given 13 at once.
	if r, _ := b.take(ctx, 1000, 3); r.rows != trickleRows-3 {
		t.Fatalf("a trickle: given %d rows, want %d", r.rows, trickleRows-3)
	}
	if f := free(b); f.rows != -(trickleRows - 3) {
		t.Fatalf("free rows %d, want %d", f.rows, -(trickleRows - 3))
	}
}

// TestBudgetCancelledAsk: a relay that stops while it waits leaves the
// queue, and the room goes to the next.
func TestBudgetCancelledAsk(t *testing.T) {
	b := NewBudget(40, 0)
	b.take(context.Background(), 40, trickleRows)
	ctx, cancel := context.WithCancel(context.Background())
	gone := takeAsync(ctx, b, 40)
	queued(t, b, 1)
	next := takeAsync(context.Background(), b, 40)
	queued(t, b, 2)
	cancel()
	if _, ok := <-gone; ok {
		t.Fatal("a cancelled ask was given room")
	}
	queued(t, b, 1)
	b.give(room{rows: 40})
	if r := <-next; r.rows != 40 {
		t.Fatalf("given %d rows, want 40", r.rows)
	}
}

// TestBudgetPayload: each claim may read half the payload budget, so two
// read at once; a relay waits while less than a quarter is free.
func TestBudgetPayload(t *testing.T) {
	ctx := context.Background()
	b := NewBudget(1000, 800)
	if r, _ := b.take(ctx, 10, trickleRows); r.bytes != 400 {
		t.Fatalf("given %d bytes, want half the budget", r.bytes)
	}
	b.take(ctx, 10, trickleRows) // the other half
	waiting := takeAsync(ctx, b, 10)
	queued(t, b, 1)
	b.give(room{bytes: 150}) // less than a quarter
	stillWaiting(t, b, 1)
	b.give(room{bytes: 100})
	if r := <-waiting; r.bytes != 250 {
		t.Fatalf("given %d bytes, want the 250 free", r.bytes)
	}
	// With every byte spent, a trickle may still read its first row.
	if r, _ := b.take(ctx, 1, 0); r.bytes != 1 {
		t.Fatalf("a trickle: given %d bytes, want 1 (a claim's first row)", r.bytes)
	}
}

// TestRelaysShareABudget: relays of several files with one budget hold no
// more rows in flight together than the budget (and a few rows each past
// it), publish every row, and give all the room back.
func TestRelaysShareABudget(t *testing.T) {
	const relays, rows, budget = 3, 200, 100
	pub := &heldPublisher{release: make(chan struct{})}
	b := NewBudget(budget, 0)
	stores, stop := shareBudget(t, relays, rows, pub, Options{MaxInFlight: 2 * budget, Budget: b})
	// Each relay is given trickleRows at once and the budget's batches
	// in turn; then all three wait, nothing acknowledged.
	queued(t, b, relays)
	time.Sleep(50 * time.Millisecond) // it must not claim more while the budget is spent
	queued(t, b, relays)
	n, maxOut := pub.state()
	if maxOut > budget+relays*trickleRows {
		t.Fatalf("%d rows in flight at most, want at most %d (without the budget: %d)", maxOut, budget+relays*trickleRows, relays*rows)
	}
	if f := free(b); n != maxOut || f.rows >= budget/4 {
		t.Fatalf("%d rows in flight (%d at most), %d free in the budget: relays wait with room to claim", n, maxOut, f.rows)
	}
	close(pub.release)
	testenv.Eventually(t, 10*time.Second, "all settled", func() bool {
		for _, s := range stores {
			if len(s.Outcomes()) != rows {
				return false
			}
		}
		return true
	})
	stop()
	if f := free(b); f.rows != budget {
		t.Fatalf("the budget's free rows %d after every relay stopped, want %d", f.rows, budget)
	}
}

// TestBudgetWanted: the budget says when a relay waits for room, and
// stops saying so once none does, whether it was served or left.
func TestBudgetWanted(t *testing.T) {
	if (*Budget)(nil).Wanted() != nil {
		t.Fatal("a nil budget's Wanted is not nil")
	}
	b := NewBudget(40, 0)
	b.take(context.Background(), 40, trickleRows)
	if isClosed(b.Wanted()) {
		t.Fatal("wanted with no relay waiting")
	}
	ctx, cancel := context.WithCancel(context.Background())
	gone := takeAsync(ctx, b, 40)
	queued(t, b, 1)
	if !isClosed(b.Wanted()) {
		t.Fatal("not wanted while a relay waits")
	}
	cancel()
	<-gone
	if isClosed(b.Wanted()) {
		t.Fatal("still wanted after the waiting relay left")
	}
	next := takeAsync(context.Background(), b, 40)
	queued(t, b, 1)
	b.give(room{rows: 40})
	<-next
	if isClosed(b.Wanted()) {
		t.Fatal("still wanted after the waiting relay was served")
	}
}

// TestSharedBudgetSettlesAtOnce: relays sharing a budget settle the rows
// they hold while another waits for room, however long their settle
// window: files draining side by side do not wait for each other's
// windows. With an hour's window (and a quarter of MaxInFlight never
// reached) nothing else would give the budget's rows back, and publishing
// would stop at about the budget; the last rows, which no one waits
// behind, are settled as the relays stop.
func TestSharedBudgetSettlesAtOnce(t *testing.T) {
	const relays, rows, budget = 3, 200, 100
	pub := &countingPublisher{}
	b := NewBudget(budget, 0)
	stores, stop := shareBudget(t, relays, rows, pub, Options{MaxInFlight: 100 * budget, Budget: b, SettleWindow: time.Hour})
	testenv.Eventually(t, 10*time.Second, "every row published", func() bool { return pub.count() == relays*rows })
	stop()
	for i, s := range stores {
		if n := len(s.Outcomes()); n != rows {
			t.Fatalf("relay %d settled %d rows, want %d", i, n, rows)
		}
	}
}
