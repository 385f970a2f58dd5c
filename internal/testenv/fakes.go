package testenv

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// NopStore is the part of the relay's store that a fake outbox in memory
// has no use for: it always leads, watches nothing, and has no
// housekeeping. A fake embeds it and writes Claim and Settle (and
// overrides what a test needs).
type NopStore struct{}

// Leads reports true: a fake is the only relay on its outbox.
func (NopStore) Leads() bool { return true }

// Heartbeat does nothing.
func (NopStore) Heartbeat(context.Context, string, time.Duration, time.Duration) (int64, error) {
	return 0, nil
}

// Leave does nothing.
func (NopStore) Leave(context.Context) error { return nil }

// Watch announces no commit; it returns when ctx ends.
func (NopStore) Watch(ctx context.Context, _ time.Duration, _ ...chan<- struct{}) error {
	<-ctx.Done()
	return nil
}

// Backlog reports an empty outbox.
func (NopStore) Backlog(context.Context) (event.Backlog, error) { return event.Backlog{}, nil }

// Prune deletes nothing.
func (NopStore) Prune(context.Context, string, time.Time, time.Duration) (int64, error) {
	return 0, nil
}

// Checkpoint does nothing.
func (NopStore) Checkpoint(context.Context) (int, int, error) { return 0, 0, nil }

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
