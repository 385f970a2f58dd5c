package benchkit

import (
	"context"
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
