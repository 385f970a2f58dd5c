package admin

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestBulkOn100kDeadLetters: retrying and discarding 100,000 dead letters
// while an application writes: each operation takes every row its filter
// selects, in many short transactions, and the application's writes go on
// between them (its longest wait for the lock is logged). A dry run counts
// and changes nothing.
func TestBulkOn100kDeadLetters(t *testing.T) {
	ctx := context.Background()
	path := testenv.NewDB(t)
	db, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 10 * time.Second, OwnCheckpoints: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	app := testenv.AppDB(t, path)
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
