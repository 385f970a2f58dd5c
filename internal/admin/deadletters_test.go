package admin

import (
	"context"
	"database/sql"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// bulkDB returns a migrated file opened as the workbench opens it, and an
// application's connection to it.
func bulkDB(t *testing.T) (*sqlitedb.DB, *sql.DB) {
	t.Helper()
	path := testenv.NewDB(t)
	db, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 10 * time.Second, OwnCheckpoints: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db, testenv.AppDB(t, path)
}

// TestBulkOn100kDeadLetters: retrying and discarding 100,000 dead letters
// while an application writes: each operation takes every row its filter
// selects, in many short transactions, and the application's writes go on
// between them (its longest wait for the lock is logged). A dry run counts
// and changes nothing.
func TestBulkOn100kDeadLetters(t *testing.T) {
	ctx := context.Background()
	db, app := bulkDB(t)
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000)
		INSERT INTO event_queue (event_id, event_type, payload, status, attempts, processed_at, last_error)
		SELECT 'dead-' || i, CASE WHEN i % 2 = 0 THEN 'Even' ELSE 'Odd' END, 'x', 'dead_lettered', 10, 1000 + i, 'refused ' || (i % 7) FROM n`)

	// The application: one small transaction after another, timing each.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var writes atomic.Int64
	var longest atomic.Int64 // ns
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			start := time.Now()
			if err := testenv.Insert(app, testenv.NewEvent("App", []byte("a"))); err != nil {
				t.Error(err)
				return
			}
			if d := time.Since(start).Nanoseconds(); d > longest.Load() {
				longest.Store(d)
			}
			writes.Add(1)
			time.Sleep(time.Millisecond)
		}
	}()
	run := func(what string, op func() (Bulk, error)) Bulk {
		t.Helper()
		before := writes.Load()
		longest.Store(0)
		b, err := op()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		during := writes.Load() - before
		t.Logf("%s: %+v; the application committed %d times meanwhile, its longest write %v", what, b, during, time.Duration(longest.Load()))
		if !b.DryRun && (b.Transactions < 10 || during < int64(b.Transactions)/4) {
			t.Errorf("%s: %d transactions, %d application writes between them: the lock was not left to the application", what, b.Transactions, during)
		}
		return b
	}

	dry := run("dry run", func() (Bulk, error) {
		return Requeue(ctx, db, Selection{All: true, Filter: Filter{Type: "Even"}}, true)
	})
	if dry.Matched != 50000 || dry.Changed != 0 || dry.Transactions != 0 {
		t.Fatalf("dry run %+v; want 50000 matched, nothing changed", dry)
	}
	if c := testenv.Counts(t, app); c["dead_lettered"] != 100000 {
		t.Fatalf("a dry run changed rows: %v", c)
	}
	b := run("retry --all --type Even", func() (Bulk, error) {
		return Requeue(ctx, db, Selection{All: true, Filter: Filter{Type: "Even"}}, false)
	})
	if b.Matched != 50000 || b.Changed != 50000 {
		t.Fatalf("retry %+v; want 50000 requeued", b)
	}
	b = run("discard --all --error 'refused 3'", func() (Bulk, error) {
		return Discard(ctx, db, Selection{All: true, Filter: Filter{Error: "refused 3"}}, false)
	})
	// i % 7 == 3 among the odd i of 1..100000.
	want := int64(0)
	for i := 1; i <= 100000; i += 2 {
		if i%7 == 3 {
			want++
		}
	}
	if b.Changed != want {
		t.Fatalf("discard %+v; want %d deleted", b, want)
	}
	b = run("discard --all", func() (Bulk, error) { return Discard(ctx, db, Selection{All: true}, false) })
	close(stop)
	wg.Wait()
	if b.Changed != 50000-want {
		t.Fatalf("discard --all %+v; want the remaining %d", b, 50000-want)
	}
	c := testenv.Counts(t, app)
	if c["dead_lettered"] != 0 || c["pending"] != 50000+int(writes.Load()) {
		t.Fatalf("counts %v after %d application writes", c, writes.Load())
	}
}

// TestBulkKeepsAtomicGroupsTogether: a retry writes each atomic group's
// dead letters in one transaction, wherever its batches would cut: a
// group straddling the first batch's end, one larger than a batch, and,
// with ids given, only the selected rows of a group. A group requeued in
// two transactions reaches a running relay in two parts, and was
// published in part. Each transaction writes one available_at (its now,
// a millisecond or more after the last): a group's rows share one.
func TestBulkKeepsAtomicGroupsTogether(t *testing.T) {
	ctx := context.Background()
	db, app := bulkDB(t)
	// Rows 1 to 199 alone, 200 to 219 group a, 220 to 469 group b; group
	// c's rows (470 to 479) are interleaved with rows alone (480 to 489).
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 489)
		INSERT INTO event_queue (id, event_id, event_type, payload, status, attempts, processed_at, atomic_group)
		SELECT i, 'dead-' || i, 'T', 'x', 'dead_lettered', 10, 1000 + i,
			CASE WHEN i BETWEEN 200 AND 219 THEN 'a' WHEN i BETWEEN 220 AND 469 THEN 'b' WHEN i BETWEEN 470 AND 479 THEN 'c' END FROM n`)
	b, err := Requeue(ctx, db, Selection{All: true}, false)
	if err != nil {
		t.Fatal(err)
	}
	if b.Changed != 489 {
		t.Fatalf("%+v; want 489 rows requeued", b)
	}
	split := testenv.Strings(t, app, `SELECT atomic_group FROM event_queue WHERE atomic_group IS NOT NULL
		GROUP BY atomic_group HAVING count(DISTINCT available_at) > 1`)
	if len(split) > 0 {
		t.Errorf("groups %v were requeued in more than one transaction (%+v)", split, b)
	}

	// With ids: group c's rows given, among others, are written together,
	// and a row not given stays a dead letter.
	testenv.MustExec(t, app, `UPDATE event_queue SET status = 'dead_lettered'`)
	ids := []int64{475}
	for i := int64(1); i <= 199; i++ {
		ids = append(ids, i)
	}
	ids = append(ids, 470, 471, 472, 473, 474, 476, 477, 478)
	if b, err = Requeue(ctx, db, Selection{IDs: ids}, false); err != nil || b.Changed != 208 {
		t.Fatalf("%+v (%v); want 208 rows requeued", b, err)
	}
	if n := testenv.Strings(t, app, `SELECT count(DISTINCT available_at) FROM event_queue WHERE atomic_group = 'c' AND status = 'pending'`); n[0] != "1" {
		t.Errorf("group c's rows given were requeued in %s transactions, want 1", n[0])
	}
	if st := testenv.Strings(t, app, `SELECT status FROM event_queue WHERE id = 479`); st[0] != "dead_lettered" {
		t.Errorf("row 479, not given, is %s", st[0])
	}
}
