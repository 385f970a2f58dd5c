package testenv

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"
)

// NopStore is the part of the relay's store that a fake outbox in memory
// has no use for: it always leads. A fake embeds it and writes Claim and
// Settle (and overrides what a test needs).
type NopStore struct{}

// Leads reports true: a fake is the only relay on its outbox.
func (NopStore) Leads() bool { return true }

// Heartbeat does nothing.
func (NopStore) Heartbeat(context.Context, string, time.Duration, time.Duration) (int64, error) {
	return 0, nil
}

// Leave does nothing.
func (NopStore) Leave(context.Context) error { return nil }

// Waiting reports false: a fake holds no ordering keys back.
func (NopStore) Waiting() bool { return false }

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
