package reconcile

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestOldestPendingReadsOneRow: a first start's scan begins at the
// created_at of the pending row written first (the lowest id, whatever
// the created_at of the rows after it), found without reading the other
// pending rows' payloads: 300 rows of 64 KiB are 19.7 MB.
func TestOldestPendingReadsOneRow(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	app := testenv.AppDB(t, db.Path())
	testenv.InsertRows(t, app, 2, "done")
	if err := benchkit.Seed(ctx, app, "event_queue", 300, 64<<10, "pending"); err != nil {
		t.Fatal(err)
	}
	first := time.Now().Add(-time.Hour).UnixMilli()
	testenv.MustExec(t, app, `UPDATE event_queue SET created_at = ? WHERE id = 3`, first)
	testenv.MustExec(t, app, `UPDATE event_queue SET created_at = ? WHERE id = 9`, first-1000) // written later, dated earlier
	testenv.MustExec(t, app, `PRAGMA wal_checkpoint(TRUNCATE)`)
	before := testenv.ProcIO(t, "rchar")
	got, err := oldestPending(ctx, db)
	read := testenv.ProcIO(t, "rchar") - before
	if err != nil || got != first {
		t.Fatalf("oldest pending %d, %v; want %d, the created_at of the first pending row", got, err, first)
	}
	if read > 2<<20 {
		t.Errorf("finding the first pending row of 300 of 64 KiB read %d bytes: it reads their payloads", read)
	}
}

// TestOldestPendingWithoutCreatedAt: where the first pending row has no
// created_at (an application's nullable column), the oldest created_at of
// the pending rows; none pending, 0.
func TestOldestPendingWithoutCreatedAt(t *testing.T) {
	ctx := context.Background()
	db, app := testenv.NullableCreatedAtDB(t)
	if got, err := oldestPending(ctx, db); err != nil || got != 0 {
		t.Fatalf("with nothing pending: %d, %v; want 0", got, err)
	}
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, created_at) VALUES ('a', 'T', 'x', NULL), ('b', 'T', 'x', 2000), ('c', 'T', 'x', 1000)`)
	if got, err := oldestPending(ctx, db); err != nil || got != 1000 {
		t.Fatalf("oldest pending %d, %v; want 1000", got, err)
	}
}
