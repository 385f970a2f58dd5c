package demo

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestWriteEventsIsTransactional: every event the demo application writes
// comes with its own row of data, in one transaction, and some events have
// no event_id, as a foreign writer's might.
func TestWriteEventsIsTransactional(t *testing.T) {
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int64, 1)
	go func() {
		n, err := WriteEvents(ctx, path, "event_queue", 1000, func(err error) { t.Error(err) })
		if err != nil {
			t.Error(err)
		}
		done <- n
	}()
	testenv.Eventually(t, 30*time.Second, "200 events written", func() bool {
		var n int
		return db.QueryRow(`SELECT count(*) FROM event_queue`).Scan(&n) == nil && n >= 200
	})
	cancel()
	written := <-done
	var events, reviews, noID int64
	db.QueryRow(`SELECT count(*), count(*) - count(event_id) FROM event_queue`).Scan(&events, &noID)
	db.QueryRow(`SELECT count(*) FROM reviews`).Scan(&reviews)
	if events != written || reviews != written {
		t.Fatalf("written %d, events %d, reviews %d: want the same", written, events, reviews)
	}
	if noID == 0 || noID == events {
		t.Fatalf("%d of %d events without an event_id, want some", noID, events)
	}
}
