package benchkit

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestSeedAndReadBack seeds done and pending rows into a migrated outbox
// and reads back what the bench reads: not drained while a row is pending,
// drained once every row is done, and one lag per done row.
func TestSeedAndReadBack(t *testing.T) {
	ctx := context.Background()
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	if err := Seed(ctx, db, "event_queue", 3, 16, "done"); err != nil {
		t.Fatal(err)
	}
	if err := Seed(ctx, db, "event_queue", 2, 16, "pending"); err != nil {
		t.Fatal(err)
	}
	var ids, sized int
	db.QueryRow(`SELECT count(DISTINCT event_id), sum(length(payload) = 16) FROM event_queue`).Scan(&ids, &sized)
	if ids != 5 || sized != 5 {
		t.Fatalf("%d distinct event ids and %d payloads of 16 bytes, want 5 and 5", ids, sized)
	}
	if drained, err := Drained(ctx, db, "event_queue"); err != nil || drained {
		t.Fatalf("drained %v (%v) with 2 rows pending", drained, err)
	}
	if _, err := db.Exec(`UPDATE event_queue SET status = 'done', processed_at = created_at + 7 WHERE status = 'pending'`); err != nil {
		t.Fatal(err)
	}
	if drained, err := Drained(ctx, db, "event_queue"); err != nil || !drained {
		t.Fatalf("drained %v (%v) with every row done", drained, err)
	}
	lags, err := Lags(ctx, db, "event_queue", 3)
	if err != nil || len(lags) != 2 || lags[0] != 7 || lags[1] != 7 {
		t.Fatalf("lags after the 3 seeded done rows: %v (%v), want [7 7]", lags, err)
	}
	last, err := LastProcessed(ctx, db, "event_queue")
	if err != nil || time.Since(last) > time.Hour || last.After(time.Now().Add(time.Minute)) {
		t.Fatalf("last processed %v (%v), want about now", last, err)
	}
}

// TestReplaceStreamRounds replaces the only stream of the account again
// and again, as successive measurements do; the server sometimes fails to
// create a stream right after a delete, and ReplaceStream tries again.
func TestReplaceStreamRounds(t *testing.T) {
	js := testenv.StartNATS(t).JetStream(t)
	ctx := context.Background()
	old := ""
	for i := range 400 {
		name := fmt.Sprint("BENCH_", i)
		if err := ReplaceStream(ctx, js, old, name, []string{"bench.>"}, time.Minute); err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		old = name
	}
}

// TestSeedKeys: with Keys(k), row i of a Seed (in id order, across its
// transactions of 50,000 rows) gets key i mod k; without it, rows get none.
func TestSeedKeys(t *testing.T) {
	ctx := context.Background()
	db := testenv.AppDB(t, testenv.NewDB(t))
	if err := Seed(ctx, db, "event_queue", 2, 0, "done"); err != nil {
		t.Fatal(err)
	}
	const n, k = 50_000 + 10, 7
	if err := Seed(ctx, db, "event_queue", n, 0, "pending", Keys(k)); err != nil {
		t.Fatal(err)
	}
	rows, err := db.Query(`SELECT ordering_key FROM event_queue ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var keys []sql.NullString
	for rows.Next() {
		var key sql.NullString
		if err := rows.Scan(&key); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, key)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2+n || keys[0].Valid || keys[1].Valid {
		t.Fatalf("%d rows, the first two keyed %v %v; want %d rows, the unkeyed ones without a key", len(keys), keys[0], keys[1], 2+n)
	}
	for i, key := range keys[2:] {
		if want := OrderingKey(i % k); key.String != want {
			t.Fatalf("seeded row %d has key %v, want %q", i, key, want)
		}
	}
	// DoneKeys, the bench's read-back of what each row should carry.
	done, notDone, err := DoneKeys(ctx, db, "event_queue")
	if err != nil || len(done) != 2 || done[1] != "" || done[2] != "" || notDone != n {
		t.Fatalf("DoneKeys: %d done %v, %d not done (%v); want the 2 unkeyed rows and %d", len(done), done, notDone, err, n)
	}
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'done' WHERE id = 3 + 7`)
	if done, notDone, err = DoneKeys(ctx, db, "event_queue"); err != nil || len(done) != 3 || done[10] != OrderingKey(0) || notDone != n-1 {
		t.Fatalf("DoneKeys after row 10 is done: %v, %d not done (%v)", done, notDone, err)
	}
}

// TestSeedGroups: with GroupsOf(g), every g consecutive rows of a Seed (in
// id order, across its transactions) share an atomic group, the last one
// holding the rows left over; AtomicGroups reads them back, and rows
// seeded without it have none.
func TestSeedGroups(t *testing.T) {
	ctx := context.Background()
	db := testenv.AppDB(t, testenv.NewDB(t))
	if err := Seed(ctx, db, "event_queue", 2, 0, "done"); err != nil {
		t.Fatal(err)
	}
	const n, g = 50_000 + 10, 7
	if err := Seed(ctx, db, "event_queue", n, 0, "pending", GroupsOf(g), Keys(3)); err != nil {
		t.Fatal(err)
	}
	groups, err := AtomicGroups(ctx, db, "event_queue")
	if err != nil {
		t.Fatal(err)
	}
	if len(groups) != n || groups[1] != "" || groups[2] != "" {
		t.Fatalf("%d rows in groups, the unseeded ones in %q and %q; want %d, none", len(groups), groups[1], groups[2], n)
	}
	for i := range n {
		if got, want := groups[int64(3+i)], GroupName(i/g); got != want {
			t.Fatalf("seeded row %d is in group %q, want %q", i, got, want)
		}
	}
	// The keys still go round robin, across the groups.
	if got := testenv.Strings(t, db, `SELECT ordering_key FROM event_queue WHERE id = 3 + 4`); got[0] != OrderingKey(1) {
		t.Fatalf("seeded row 4 has key %q, want %q", got[0], OrderingKey(1))
	}
	if last := groups[int64(2+n)]; last != GroupName((n-1)/g) {
		t.Fatalf("last row in group %q", last)
	}
}
