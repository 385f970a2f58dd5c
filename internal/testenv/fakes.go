package testenv

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// NopStore is the part of the relay's store that a fake outbox in memory
// has no use for. A fake embeds it and writes Claim and Settle (and
// overrides what a test needs).
type NopStore struct{}

// Waiting reports false: a fake holds no ordering keys back.
func (NopStore) Waiting() bool { return false }

// Rescan does nothing.
func (NopStore) Rescan() {}

// Quiet reports no time: a fake's rows may come at any moment.
func (NopStore) Quiet() time.Time { return time.Time{} }

// MemStore is an outbox in memory, for driving the relay without SQLite:
// Claim hands out the rows added, in order, and Settle records their
// outcomes.
type MemStore struct {
	NopStore
	mu      sync.Mutex
	pending []event.Row
	settled []event.Outcome
	settles int   // Settle calls: transactions
	lastID  int64 // the highest id given
}

// Add adds rows to the outbox; a row without an id gets the next one, and
// a row without an event id a fresh one.
func (s *MemStore) Add(rows ...event.Row) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range rows {
		if r.ID == 0 {
			r.ID = s.lastID + 1
		}
		if r.EventID == "" {
			r.EventID = event.NewID()
		}
		s.lastID = max(s.lastID, r.ID)
		s.pending = append(s.pending, r)
	}
}

// AddN adds n rows of eventType with payload, created now.
func (s *MemStore) AddN(n int, eventType string, payload []byte) {
	rows := make([]event.Row, n)
	for i := range rows {
		rows[i] = event.Row{EventType: eventType, Payload: payload, CreatedAt: time.Now().UnixMilli()}
	}
	s.Add(rows...)
}

// Claim hands out up to limit of the rows added and not yet claimed.
func (s *MemStore) Claim(_ context.Context, limit int, _ int64) ([]event.Row, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := min(limit, len(s.pending))
	rows := append([]event.Row(nil), s.pending[:n]...)
	s.pending = s.pending[n:]
	return rows, nil
}

// Settle records outs, in one transaction; scanFrom is ignored.
func (s *MemStore) Settle(_ context.Context, outs []event.Outcome, _ uint64) ([]int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.settled = append(s.settled, outs...)
	s.settles++
	return nil, nil
}

// Outcomes returns the outcomes settled so far, in settle order.
func (s *MemStore) Outcomes() []event.Outcome {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]event.Outcome(nil), s.settled...)
}

// Settled returns how many outcomes were settled, and in how many
// transactions.
func (s *MemStore) Settled() (rows, transactions int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.settled), s.settles
}

// InsertN inserts n events of eventType in one transaction, the way an
// application does; each payload names its type and index.
func InsertN(t testing.TB, db *sql.DB, n int, eventType string) {
	t.Helper()
	evs := make([]Event, n)
	for i := range evs {
		evs[i] = NewEvent(eventType, []byte(fmt.Sprint(eventType, " ", i)))
	}
	if err := Insert(db, evs...); err != nil {
		t.Fatal(err)
	}
}
