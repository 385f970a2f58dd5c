package housekeeping

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestPruneReadsNoPendingPayload: a sweep over a backlog of large pending
// rows does not read their payloads (status comes after the payload in
// the record, so reading it would read the whole row); it still prunes
// the old done rows among them. What the process reads from files
// (rchar) is the measure: 300 rows of 64 KiB are 19.7 MB.
func TestPruneReadsNoPendingPayload(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	old := time.Now().Add(-9 * 24 * time.Hour).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) VALUES ('old', 'T', randomblob(65536), 'done', ?1, ?1)`, old)
	if err := benchkit.Seed(ctx, db, "event_queue", 300, 64<<10, "pending"); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, db, `PRAGMA wal_checkpoint(TRUNCATE)`)
	before := testenv.ProcIO(t, "rchar")
	r, err := Prune(ctx, s, event.PruneOutbox, time.Now().Add(-7*24*time.Hour), time.Millisecond, Sweep{Rows: pruneBudget})
	read := testenv.ProcIO(t, "rchar") - before
	if err != nil || r.Deleted != 1 {
		t.Fatalf("pruned %d rows, %v; want the old done row", r.Deleted, err)
	}
	if read > 2<<20 {
		t.Errorf("a sweep of 300 pending rows of 64 KiB read %d bytes: it reads their payloads", read)
	}
}

// TestPruneStopsAtRowsWrittenSinceTheCutoff: a sweep ends at the first row
// written after the retention's cutoff, since every row after it was
// settled after the cutoff too: with 300 done rows of 64 KiB written since,
// behind an old one, it prunes the old row and reads little more than
// the row it stopped at, and the next sweep starts over at the table's
// start. A row written in the future (a wrong clock) ends no sweep.
func TestPruneStopsAtRowsWrittenSinceTheCutoff(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	old, future := time.Now().Add(-9*24*time.Hour).UnixMilli(), time.Now().Add(24*time.Hour).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) VALUES ('ahead', 'T', 'x', 'done', ?2, ?2), ('old', 'T', 'x', 'done', ?1, ?1)`, old, future)
	if err := benchkit.Seed(ctx, db, "event_queue", 300, 64<<10, "done"); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) VALUES ('old-behind', 'T', 'x', 'done', ?1, ?1)`, old)
	testenv.MustExec(t, db, `PRAGMA wal_checkpoint(TRUNCATE)`)
	before := testenv.ProcIO(t, "rchar")
	r, err := Prune(ctx, s, event.PruneOutbox, time.Now().Add(-7*24*time.Hour), time.Millisecond, Sweep{Rows: pruneBudget, New: true})
	read := testenv.ProcIO(t, "rchar") - before
	if err != nil || r.Deleted != 1 || r.Next != 0 {
		t.Fatalf("pruned %d rows, %v, next sweep from row %d; want the old row before the new ones, and the next sweep from the start", r.Deleted, err, r.Next)
	}
	if read > 2<<20 {
		t.Errorf("a sweep that met 300 rows of 64 KiB written since the cutoff read %d bytes: it read past the first", read)
	}
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id IN ('ahead', 'old-behind')`).Scan(&left); err != nil || left != 2 {
		t.Fatalf("%d of the row ahead and the row behind the new ones left (%v); want both", left, err)
	}
}

// TestBacklogReadsFewPayloads: the backlog's oldest due row is found
// from the pending index and the created_at of one row, not of every row
// in its window (created_at comes after the payload in the record), and
// it is still the later of the two times.
func TestBacklogReadsFewPayloads(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	if err := benchkit.Seed(ctx, db, "event_queue", 300, 64<<10, "pending"); err != nil {
		t.Fatal(err)
	}
	// The row due first was created after it became due (a clock step,
	// or an application that writes both): its created_at counts.
	due, created := time.Now().Add(-time.Hour).UnixMilli(), time.Now().Add(-30*time.Minute).UnixMilli()
	testenv.MustExec(t, db, `UPDATE event_queue SET available_at = ?, created_at = ? WHERE id = 7`, due, created)
	testenv.MustExec(t, db, `UPDATE event_queue SET available_at = ?1, created_at = ?1 WHERE id = 9`, created+1000)
	testenv.MustExec(t, db, `PRAGMA wal_checkpoint(TRUNCATE)`)
	before := testenv.ProcIO(t, "rchar")
	b, err := Backlog(ctx, s, false)
	read := testenv.ProcIO(t, "rchar") - before
	if err != nil || b.Pending != 300 || b.OldestPending.UnixMilli() != created {
		t.Fatalf("backlog %+v, %v; want 300 pending, the oldest due at %d", b, err, created)
	}
	if read > 2<<20 {
		t.Errorf("reading the backlog of 300 rows of 64 KiB read %d bytes: it reads their payloads", read)
	}
}

// settleBetween is a Querier that runs after (a settle) right after each
// query, as a relay settling rows beside a reader outside a transaction
// would.
type settleBetween struct {
	*sql.DB
	after func()
}

func (q settleBetween) QueryContext(ctx context.Context, s string, args ...any) (*sql.Rows, error) {
	rows, err := q.DB.QueryContext(ctx, s, args...)
	q.after()
	return rows, err
}

// TestOldestDueSkipsARowSettledMeanwhile: a due row deleted between
// OldestDue's read of the due rows and its read of the row's created_at
// (retention.done_rows: delete) is skipped, not an error.
func TestOldestDueSkipsARowSettledMeanwhile(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.InsertRows(t, db, 3, "pending")
	q := settleBetween{DB: s.Reader(), after: func() { testenv.MustExec(t, db, `DELETE FROM event_queue WHERE id = 1`) }}
	oldest, err := schema.OldestDue(ctx, q, "event_queue", time.Now().UnixMilli())
	if err != nil || !oldest.Valid {
		t.Fatalf("OldestDue: %v, %v; want the oldest of the rows left", oldest, err)
	}
}

// BenchmarkPruneKept: a retention pass (Keeper.Retain) over a table of
// 10,000 done rows of BENCH_SIZE bytes (256 unless set), all settled
// within retention, with nothing to delete (ns/op is per pass): what a
// relay pays every minute to keep a week of rows.
func BenchmarkPruneKept(b *testing.B) {
	ctx := context.Background()
	s := testenv.MigratedDB(b)
	db := testenv.AppDB(b, s.Path())
	if err := benchkit.Seed(ctx, db, "event_queue", 10_000, benchkit.EnvInt("BENCH_SIZE", 256), "done"); err != nil {
		b.Fatal(err)
	}
	testenv.MustExec(b, db, `PRAGMA wal_checkpoint(TRUNCATE)`)
	m := metrics.New("", "")
	k := New(OnFile(s, false), Options{RetainDone: 7 * 24 * time.Hour, RetainProcessedEvents: 30 * 24 * time.Hour, Metrics: m})
	b.ResetTimer()
	for range b.N {
		k.Retain(ctx)
	}
	b.StopTimer()
	if n := metrics.Value(m.PrunedRows.WithLabelValues(event.PruneOutbox)); n != 0 {
		b.Fatalf("pruned %v rows; want none", n)
	}
}
