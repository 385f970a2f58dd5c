package housekeeping

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestBacklog(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.InsertRows(t, db, 3, "done")
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_type, payload, created_at) VALUES ('T', 'x', 1000)`)
	testenv.InsertRows(t, db, 4, "pending")
	testenv.InsertRows(t, db, 2, "dead_lettered")
	if n := testenv.LegacyClaim(t, db, "an-older-relay", 2); n != 2 {
		t.Fatal(n)
	}
	b, err := Backlog(ctx, s, true)
	if err != nil {
		t.Fatal(err)
	}
	if b.Pending != 3 || b.Processing != 2 || b.DeadLettered != 2 {
		t.Fatalf("backlog %+v", b)
	}
	// The oldest pending row is the 4th inserted (the first two pending were claimed).
	var want int64
	db.QueryRow(`SELECT created_at FROM event_queue WHERE status = 'pending' ORDER BY id LIMIT 1`).Scan(&want)
	if b.OldestPending.UnixMilli() != want {
		t.Fatalf("oldest pending %v, want %d", b.OldestPending, want)
	}
}

// insertDone inserts n done rows, event ids prefix followed by their
// number i from 1, written and settled at (Unix milliseconds), their ids
// the SQL expression id of i ("": SQLite's).
func insertDone(t *testing.T, db *sql.DB, prefix string, n int, at int64, id string) {
	t.Helper()
	if id == "" {
		id = "NULL"
	}
	testenv.MustExec(t, db, fmt.Sprintf(`WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
		INSERT INTO event_queue (id, event_id, event_type, payload, status, created_at, processed_at) SELECT %s, ?2 || i, 'T', 'x', 'done', ?3, ?3 FROM n`, id), n, prefix, at)
}

// TestPruneLeavesTheApplicationAlone deletes 100,000 old done rows while an
// application writes; pruning completes, keeps everything else, and the
// writer's commits go on between the prune's short transactions (its
// longest wait is logged; a test does not judge timing).
func TestPruneLeavesTheApplicationAlone(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	old := time.Now().Add(-8 * 24 * time.Hour).UnixMilli()
	insertDone(t, db, "old-", 100000, old, "")
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at, last_error) VALUES ('old-dead', 'T', 'x', 'dead_lettered', ?1, ?1, 'kept')`, old)
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, created_at) VALUES ('old-pending', 'T', 'x', ?1)`, old)
	testenv.InsertRows(t, db, 100, "done") // recent
	ledgerOld := time.Now().Add(-31 * 24 * time.Hour).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES ('a', 'h', 'done', ?1, ?1), ('b', 'h', 'in_progress', ?1, NULL), ('c', 'h', 'done', ?2, ?2), ('d', 'h', 'done', ?3, ?3)`,
		ledgerOld, time.Now().UnixMilli(), old)

	stop := make(chan struct{})
	waits := make(chan time.Duration, 1)
	var commits atomic.Int64
	writer := testenv.AppDB(t, s.Path())
	go func() {
		var worst time.Duration
		for {
			select {
			case <-stop:
				waits <- worst
				return
			default:
			}
			start := time.Now()
			tx, err := writer.Begin() // BEGIN IMMEDIATE: waits for the lock
			if err != nil {
				t.Error(err)
				waits <- worst
				return
			}
			worst = max(worst, time.Since(start))
			tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'App', 'x')`, event.NewID())
			if tx.Commit() == nil {
				commits.Add(1)
			}
			time.Sleep(time.Millisecond)
		}
	}()
	before := time.Now().Add(-7 * 24 * time.Hour)
	r, err := Prune(ctx, s, event.PruneOutbox, before, 20*time.Millisecond, Sweep{Rows: pruneBudget})
	during := commits.Load()
	close(stop)
	worst := <-waits
	if err != nil || r.Deleted != 100000 {
		t.Fatalf("pruned %d, %v; want 100000", r.Deleted, err)
	}
	var left, kept int
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id LIKE 'old-%'`).Scan(&left)
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id IN ('old-dead', 'old-pending')`).Scan(&kept)
	if left != 2 || kept != 2 {
		t.Fatalf("%d old rows left (want the dead letter and the pending row)", left)
	}
	t.Logf("writer's longest wait for the lock while pruning: %v; %d commits meanwhile", worst, during)
	// One long transaction would have let the writer in once, at its end.
	if during < 5 {
		t.Errorf("the application committed %d times while pruning; the prune held the lock throughout", during)
	}
	r, err = Prune(ctx, s, event.PruneProcessedEvents, time.Now().Add(-30*24*time.Hour), time.Millisecond, Sweep{Rows: pruneBudget})
	if err != nil || r.Deleted != 2 {
		t.Fatalf("pruned %d ledger rows, %v; want the old done one and the abandoned claim", r.Deleted, err)
	}
	// Nothing is old any more: a second pass deletes nothing and stops early.
	if r, err := Prune(ctx, s, event.PruneOutbox, before, time.Millisecond, Sweep{Rows: pruneBudget}); err != nil || r.Deleted != 0 {
		t.Fatalf("second prune %d, %v", r.Deleted, err)
	}
}

// TestPruneFindsRowsOutOfOrder: rows finished out of insertion order (a
// requeued dead letter done yesterday before rows done nine days ago) and
// legacy done rows without processed_at are pruned all the same.
func TestPruneFindsRowsOutOfOrder(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	day := 24 * time.Hour
	yesterday, nineDays := time.Now().Add(-day).UnixMilli(), time.Now().Add(-9*day).UnixMilli()
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 600)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'recent-' || i, 'T', 'x', 'done', ?1, ?2 FROM n`, nineDays, yesterday)
	insertDone(t, db, "old-", 1000, nineDays, "")
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 50)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'legacy-' || i, 'T', 'x', 'done', ?1, NULL FROM n`, nineDays)
	var total, from int64
	for i := 0; i < 3; i++ { // a few sweeps, as the relay makes one a minute
		r, err := Prune(ctx, s, event.PruneOutbox, time.Now().Add(-7*day), time.Millisecond, Sweep{From: from, Rows: pruneBudget})
		from = r.Next
		if err != nil {
			t.Fatal(err)
		}
		total += r.Deleted
	}
	var left, recent int
	db.QueryRow(`SELECT count(*) FROM event_queue`).Scan(&left)
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id LIKE 'recent-%'`).Scan(&recent)
	if total != 1050 || left != 600 || recent != 600 {
		t.Fatalf("pruned %d, left %d (%d recent); want 1050 pruned and the 600 recent rows kept", total, left, recent)
	}
}

// TestRetainFindsOldRowsBeyondNewOnes: the outbox's second sweep finds
// the old rows that lie beyond a row written after the cutoff, where the
// first sweep ends: rows after a dead letter the application wrote with an
// id of its own, and old rows inserted late (merged back from a backup).
func TestRetainFindsOldRowsBeyondNewOnes(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	old := time.Now().Add(-9 * 24 * time.Hour).UnixMilli()
	insertDone(t, db, "old-", 1000, old, "1000 + i")
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, last_error) VALUES (5, 'low-id', 'T', 'x', 'dead_lettered', 'kept')`)
	testenv.InsertRows(t, db, 10, "done")
	insertDone(t, db, "merged-", 100, old, "")
	m := metrics.New("", "")
	k := New(OnFile(s, false), Options{RetainDone: 7 * 24 * time.Hour, Metrics: m})
	for range 3 {
		k.Retain(ctx)
	}
	if n := metrics.Value(m.PrunedRows.WithLabelValues(event.PruneOutbox)); n != 1100 {
		t.Fatalf("pruned %v rows in three passes; want the 1,100 done nine days ago", n)
	}
	if c := testenv.Counts(t, db); c["done"] != 10 || c["dead_lettered"] != 1 {
		t.Fatalf("left %v; want the 10 recent rows and the dead letter", c)
	}
}

// TestRetainGoesOnPastKeptRows: the outbox's first sweep goes on from
// where it stopped when a pass ends at its budget, so a front of more kept
// rows than a pass reads (dead letters, here) does not hide the old rows
// behind it.
func TestRetainGoesOnPastKeptRows(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	old := time.Now().Add(-9 * 24 * time.Hour).UnixMilli()
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?2)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at, last_error) SELECT 'dead-' || i, 'T', 'x', 'dead_lettered', ?1, ?1, 'kept' FROM n`, old, pruneBudget+500)
	insertDone(t, db, "old-", 300, old, "")
	testenv.InsertRows(t, db, 10, "done")
	m := metrics.New("", "")
	k := New(OnFile(s, false), Options{RetainDone: 7 * 24 * time.Hour, Metrics: m})
	k.Retain(ctx)
	k.Retain(ctx)
	if n := metrics.Value(m.PrunedRows.WithLabelValues(event.PruneOutbox)); n != 300 {
		t.Fatalf("pruned %v rows in two passes; want the 300 old done rows", n)
	}
}

// TestSpanOfRowidsFarApart: rowids an application wrote at both ends of
// the integers give a span too large for an integer, read as the largest
// the second sweep needs, not as an error.
func TestSpanOfRowidsFarApart(t *testing.T) {
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (-5, 'low', 'T', 'x'), (9223372036854775807, 'high', 'T', 'x')`)
	if span, err := Span(context.Background(), s); err != nil || span < 1<<62 {
		t.Fatalf("span %d, %v; want at least 2^62", span, err)
	}
}

// TestRetainLearnsHowManyRowsATableHolds: in a table whose rowids an
// application wrote far apart, the span says nothing of how many rows it
// holds. A round of the sweep beyond the new rows counts them, and the
// sweep's passes then shrink to as few rows as that many need, not
// pruneBudget.
func TestRetainLearnsHowManyRowsATableHolds(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	insertDone(t, db, "far-", 3000, time.Now().UnixMilli(), "i * 1000000000000")
	sw := &Sweeps{}
	k := New(OnFile(s, false), Options{RetainDone: 7 * 24 * time.Hour, RetentionInterval: time.Minute, Sweeps: sw})
	span, err := Span(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if rows := k.beyondRows(span, k.o.RetainDone, time.Minute); rows != pruneBudget {
		t.Fatalf("before a round, %d rows a pass on a table spanning %d; want pruneBudget", rows, span)
	}
	for range 8 { // from pruneBudget, halving
		k.Retain(ctx)
	}
	if rows := k.beyondRows(span, k.o.RetainDone, time.Minute); rows != pruneBeyond || sw.Density == 0 {
		t.Fatalf("after rounds of 3,000 rows, %d rows a pass, sweeps at %+v; want pruneBeyond, and the table's density", rows, *sw)
	}
	if c := testenv.Counts(t, db); c["done"] != 3000 {
		t.Fatalf("left %v; want every row, none old", c)
	}
}

// TestPruneTakesRowidsBelowOne: rows an application numbered 0 or below,
// down to the least rowid, are swept like the others, and a sweep that
// stops at row 0 goes on after it, not from the table's start.
func TestPruneTakesRowidsBelowOne(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	old, now := time.Now().Add(-9*24*time.Hour).UnixMilli(), time.Now().UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, created_at, processed_at) VALUES
		(-9223372036854775808, 'old-least', 'T', 'x', 'done', ?1, ?1), (0, 'old-zero', 'T', 'x', 'done', ?1, ?1), (600, 'old-600', 'T', 'x', 'done', ?1, ?1)`, old)
	// Kept rows: the first window ends at row 0, the second holds row 600.
	insertDone(t, db, "kept-", pruneScan-2, now, "-1000 + i")
	insertDone(t, db, "kept-after-", 10, now, "i")
	before := time.Now().Add(-7 * 24 * time.Hour)
	r, err := Prune(ctx, s, event.PruneOutbox, before, time.Millisecond, Sweep{Rows: 1})
	if err != nil || r.Deleted != 2 || r.Read != pruneScan || r.Next != -1 {
		t.Fatalf("a sweep of a window: %+v, %v; want the window's two old rows, its %d rows read, the next after -1", r, err, pruneScan)
	}
	total := r.Deleted
	if r, err = Prune(ctx, s, event.PruneOutbox, before, time.Millisecond, Sweep{From: r.Next, Rows: 1}); err != nil {
		t.Fatal(err)
	}
	total += r.Deleted
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id LIKE 'old-%'`).Scan(&left); err != nil || total != 3 || left != 0 {
		t.Fatalf("pruned %d in two sweeps, %d old rows left (%v); want all 3", total, left, err)
	}
}

// TestPruneReadsForeignTimes: a legacy done row without processed_at is
// aged by its created_at as SQLite text (CURRENT_TIMESTAMP) too: pruned
// when old, kept when recent.
func TestPruneReadsForeignTimes(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) VALUES
		('old-text', 'T', 'x', 'done', datetime('now', '-9 days'), NULL), ('recent-text', 'T', 'x', 'done', datetime('now', '-1 days'), NULL)`)
	r, err := Prune(ctx, s, event.PruneOutbox, time.Now().Add(-7*24*time.Hour), time.Millisecond, Sweep{Rows: pruneBudget})
	var left string
	if err == nil {
		err = db.QueryRow(`SELECT group_concat(event_id) FROM event_queue`).Scan(&left)
	}
	if err != nil || r.Deleted != 1 || left != "recent-text" {
		t.Fatalf("pruned %d, left %q (%v); want the row written nine days ago pruned, the other kept", r.Deleted, left, err)
	}
}

// TestAFailedDeleteIsTriedAgain: a sweep whose delete fails (the
// application holding the write lock past the wait) says where to start
// again before the rows it could not delete, not after them.
func TestAFailedDeleteIsTriedAgain(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	old := time.Now().Add(-9 * 24 * time.Hour).UnixMilli()
	insertDone(t, db, "old-", 600, old, "")
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(`UPDATE event_queue SET last_error = 'held' WHERE id = 0`); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	before := time.Now().Add(-7 * 24 * time.Hour)
	r, err := Prune(short, s, event.PruneOutbox, before, time.Millisecond, Sweep{Rows: pruneBudget})
	tx.Rollback()
	if err == nil || r.Deleted != 0 || r.Next != 0 {
		t.Fatalf("a sweep against a held lock: %+v, %v; want an error, nothing deleted, and the next sweep from the start", r, err)
	}
	if r, err = Prune(ctx, s, event.PruneOutbox, before, time.Millisecond, Sweep{From: r.Next, Rows: pruneBudget}); err != nil || r.Deleted != 600 {
		t.Fatalf("the sweep after it pruned %d, %v; want all 600 old rows", r.Deleted, err)
	}
}

// TestPruneTakesRowsWithoutTimes: in a table whose created_at may be NULL
// (an application's own, migrated), a done row without one is pruned by
// its processed_at, a row with neither time is kept, and neither ends the
// sweep or fails it.
func TestPruneTakesRowsWithoutTimes(t *testing.T) {
	ctx := context.Background()
	s, db := testenv.NullableCreatedAtDB(t)
	old := time.Now().Add(-9 * 24 * time.Hour).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) VALUES
		('timeless', 'T', 'x', 'done', NULL, NULL), ('processed-old', 'T', 'x', 'done', NULL, ?1), ('old', 'T', 'x', 'done', ?1, ?1)`, old)
	r, err := Prune(ctx, s, event.PruneOutbox, time.Now().Add(-7*24*time.Hour), time.Millisecond, Sweep{Rows: pruneBudget, New: true})
	if err != nil || r.Deleted != 2 {
		t.Fatalf("pruned %d, %v; want the two rows processed nine days ago", r.Deleted, err)
	}
	if c := testenv.Counts(t, db); c["done"] != 1 {
		t.Fatalf("%v left; want the row without times", c)
	}
}

// TestBacklogAgesFromWhenRowsBecameDue: a row scheduled for later does not
// age the backlog however old it is, and a due row counts from the later
// of its created_at and available_at, the moment it could first be
// published.
func TestBacklogAgesFromWhenRowsBecameDue(t *testing.T) {
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	now := time.Now()
	ms := func(d time.Duration) int64 { return now.Add(d).UnixMilli() }
	for _, r := range []struct {
		id                 int
		created, available int64
	}{
		{1, ms(-2 * time.Hour), ms(time.Hour)},            // scheduled: not due
		{2, ms(-3 * time.Hour), ms(-5 * time.Minute)},     // retried: due for 5 minutes
		{3, ms(-10 * time.Minute), ms(-20 * time.Minute)}, // due since it was created
		{4, ms(-time.Minute), ms(-time.Minute)},           // just inserted
		{5, ms(-24 * time.Hour), ms(30 * 24 * time.Hour)}, // scheduled far ahead
		{6, ms(-48 * time.Hour), ms(-48*time.Hour) + 100}, // done long ago
	} {
		status := "pending"
		if r.id == 6 {
			status = "done"
		}
		testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, created_at, available_at) VALUES (?, ?, 'T', 'x', ?, ?, ?)`,
			r.id, r.id, status, r.created, r.available)
	}
	b, err := Backlog(context.Background(), s, true)
	if err != nil {
		t.Fatal(err)
	}
	if b.Pending != 5 {
		t.Errorf("pending %d, want 5 (scheduled rows are pending too)", b.Pending)
	}
	if want := ms(-10 * time.Minute); b.OldestPending.UnixMilli() != want {
		t.Errorf("oldest pending became due %v (%v ago), want %v: row 3, due for 10 minutes",
			b.OldestPending, now.Sub(b.OldestPending).Round(time.Second), time.UnixMilli(want))
	}

	// Nothing due: no age, however old the scheduled rows are.
	testenv.MustExec(t, db, `DELETE FROM event_queue WHERE id IN (2, 3, 4)`)
	if b, err = Backlog(context.Background(), s, true); err != nil || !b.OldestPending.IsZero() || b.Pending != 2 {
		t.Errorf("only scheduled rows: backlog %+v (%v), want 2 pending and no oldest", b, err)
	}
}

// TestBacklogReadsForeignTimes: rows a legacy writer left with a text
// created_at (CURRENT_TIMESTAMP's UTC text), a NULL or meaningless one,
// or an available_at that is NULL or text, never fail the backlog read.
// SQLite's date text counts as the UTC time it names; a created_at that is
// no time counts as available_at and the other way round; a row whose
// available_at is NULL or no time is due (the relay takes it to publish it
// or to dead-letter it).
func TestBacklogReadsForeignTimes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db := testenv.AppDB(t, path)
	testenv.MustExec(t, db, `CREATE TABLE event_queue (
	id INTEGER PRIMARY KEY,
	event_id TEXT,
	event_type TEXT NOT NULL,
	payload BLOB NOT NULL,
	status TEXT NOT NULL DEFAULT 'pending',
	attempts INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER,
	claimed_at INTEGER,
	created_at INTEGER,
	processed_at INTEGER,
	last_error TEXT)`)
	now := time.Now()
	ago := now.Add(-time.Minute).UnixMilli()
	ins := `INSERT INTO event_queue (id, event_type, payload, created_at, available_at) VALUES (?, 'T', 'x', ?, ?)`
	testenv.MustExec(t, db, ins, 1, "2024-05-01 10:00:00", 0)            // due since its creation
	testenv.MustExec(t, db, ins, 2, nil, nil)                            // due, since when?
	testenv.MustExec(t, db, ins, 3, nil, ago)                            // created when?
	testenv.MustExec(t, db, ins, 4, "soon", ago)                         // created when?
	testenv.MustExec(t, db, ins, 5, 1000, "2024-06-01 00:00:00")         // due since its text time
	testenv.MustExec(t, db, ins, 6, []byte{0}, ago)                      // created when?
	testenv.MustExec(t, db, ins, 7, now.Add(time.Hour).UnixMilli(), ago) // due in an hour
	s := testenv.OpenDB(t, path)
	b, err := Backlog(context.Background(), s, false) // no ordering_key: nothing parks
	if err != nil {
		t.Fatalf("backlog: %v", err)
	}
	want := time.Date(2024, 5, 1, 10, 0, 0, 0, time.UTC)
	if b.Pending != 7 || !b.OldestPending.Equal(want) {
		t.Fatalf("backlog %d pending, oldest due %v; want 7 and %v", b.Pending, b.OldestPending.UTC(), want)
	}

	// Without the text rows, the oldest due rows are those whose created_at
	// is no time, counted from their available_at.
	testenv.MustExec(t, db, `DELETE FROM event_queue WHERE id IN (1, 5)`)
	if b, err = Backlog(context.Background(), s, false); err != nil || b.OldestPending.UnixMilli() != now.Add(-time.Minute).UnixMilli() {
		t.Fatalf("backlog %+v (%v), want the oldest due a minute ago", b, err)
	}
}

// TestParkedKeysGauge: on a file where dead letters park two ordering keys
// (testenv.InsertParkedKeys), the gauge reads 2; it drops as a key's dead
// letter is deleted, and reads 0 where dead letters park nothing (skip),
// whatever it read before.
func TestParkedKeysGauge(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.InsertParkedKeys(t, db)
	m := metrics.New("", "")
	g := NewGauges(m, "") // the file's shares, as its keepers come and go
	refresh := func(parks bool, want float64) {
		t.Helper()
		if err := New(OnFile(s, parks), Options{Metrics: m, Gauges: g}).RefreshBacklog(ctx); err != nil {
			t.Fatal(err)
		}
		if got := metrics.Value(m.ParkedKeys); got != want {
			t.Errorf("parks %v: parked keys gauge %v, want %v", parks, got, want)
		}
	}
	refresh(true, 2)
	testenv.MustExec(t, db, `DELETE FROM event_queue WHERE id = 8`) // key b's only dead letter
	refresh(true, 1)
	refresh(false, 0)
}

// TestDeletesFreeAMebibyteAtMost: retention deletes a window's old rows
// in transactions that free pruneBytes of payload at most (one row at
// least), so that deleting rows of large payloads (their overflow pages
// freed under the write lock) holds the application up no longer than
// small rows do.
func TestDeletesFreeAMebibyteAtMost(t *testing.T) {
	ids := func(n int) []int64 {
		out := make([]int64, n)
		for i := range out {
			out[i] = int64(i + 1)
		}
		return out
	}
	sizes := func(size int64, n int) []int64 {
		out := make([]int64, n)
		for i := range out {
			out[i] = size
		}
		return out
	}
	for _, tc := range []struct {
		name  string
		sizes []int64
		want  []int // rows per part
	}{
		{"500 rows of 256 B", sizes(256, 500), []int{500}},
		{"40 rows of 64 KiB", sizes(64<<10, 40), []int{16, 16, 8}},
		{"rows larger than a mebibyte", sizes(3<<20, 3), []int{1, 1, 1}},
		{"none", nil, nil},
	} {
		var got []int
		for _, p := range split(ids(len(tc.sizes)), tc.sizes, pruneBytes) {
			got = append(got, len(p))
		}
		if fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("%s: parts of %v rows, want %v", tc.name, got, tc.want)
		}
	}
}

// TestOldestPendingAgesWhileTheTableCannotBeRead: once the outbox table
// cannot be read (renamed away here), the backlog read fails, and the
// oldest pending row last read keeps aging in oldest_pending_age_seconds,
// so that an alert on it fires; the counts stay as last read.
func TestOldestPendingAgesWhileTheTableCannotBeRead(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.InsertN(t, db, 2, "T")
	m := metrics.New("", "")
	k := New(OnFile(s, false), Options{Metrics: m})
	if err := k.RefreshBacklog(ctx); err != nil {
		t.Fatal(err)
	}
	first := metrics.Value(m.OldestPendingAge)
	testenv.MustExec(t, db, `ALTER TABLE event_queue RENAME TO elsewhere`)
	time.Sleep(1100 * time.Millisecond) // the row grows a second older
	if err := k.RefreshBacklog(ctx); err == nil {
		t.Fatal("the backlog of a table renamed away was read")
	}
	if age := metrics.Value(m.OldestPendingAge); age < first+1 {
		t.Fatalf("oldest pending age %v s a second after %v s, the table unreadable; want it aging", age, first)
	}
	if p := metrics.Value(m.Backlog.WithLabelValues("pending")); p != 2 {
		t.Fatalf("pending gauge %v, want the 2 last read", p)
	}
}
