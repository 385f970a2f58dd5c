package daemon_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestRetentionLoop: housekeeping prunes done rows past retention.done and
// counts them; younger rows and unfinished ones stay.
func TestRetentionLoop(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	insertOldRows(t, app)
	old := time.Now().Add(-2 * time.Hour).UnixMilli()
	if _, err := app.Exec(`INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at, last_error) VALUES ('dead', 'T', 'x', 'dead_lettered', ?1, ?1, 'kept')`, old); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{mutateKeeper: func(o *housekeeping.Options) {
		o.RetentionInterval, o.RetainDone, o.RetainProcessedEvents = 50*time.Millisecond, time.Hour, 0
	}})
	testenv.InsertN(t, app, 10, "Fresh")
	testenv.Eventually(t, 20*time.Second, "old rows pruned", func() bool {
		return scrape(t, h, `outbox_relay_pruned_rows_total{table="outbox"}`) == 1500
	})
	waitAllSettled(t, app, 11, 10*time.Second)
	if c := testenv.Counts(t, app); c["done"] != 10 || c["dead_lettered"] != 1 {
		t.Fatalf("after retention: %v", c)
	}
	var ledger int
	if err := app.QueryRow(`SELECT count(*) FROM processed_events`).Scan(&ledger); err != nil || ledger != 3 {
		t.Fatalf("retention.processed_events 0 must keep the ledger: %d rows (%v)", ledger, err)
	}
}

// TestRetentionKeepsWhatZeroKeeps: retention.done 0 keeps done rows
// forever while the ledger is pruned past its retention and counted.
func TestRetentionKeepsWhatZeroKeeps(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	old := insertOldRows(t, app)
	if _, err := app.Exec(`INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES ('new', 'h', 'done', ?1, ?1)`, time.Now().UnixMilli()); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{mutateKeeper: func(o *housekeeping.Options) {
		o.RetentionInterval, o.RetainDone, o.RetainProcessedEvents = 50*time.Millisecond, 0, time.Hour
	}})
	testenv.Eventually(t, 20*time.Second, "old ledger rows pruned", func() bool {
		return scrape(t, h, `outbox_relay_pruned_rows_total{table="processed_events"}`) == 3
	})
	var ledger int
	if err := app.QueryRow(`SELECT count(*) FROM processed_events`).Scan(&ledger); err != nil || ledger != 1 {
		t.Fatalf("ledger after retention: %d rows (%v), want the new one", ledger, err)
	}
	if c := testenv.Counts(t, app); c["done"] != old {
		t.Fatalf("retention.done 0 pruned done rows: %v", c)
	}
	if v := scrape(t, h, `outbox_relay_pruned_rows_total{table="outbox"}`); v != 0 {
		t.Fatalf("outbox pruned %v rows with retention.done 0", v)
	}
}

// insertOldRows writes 1500 done rows and 3 ledger rows finished two hours
// ago, and returns how many done rows it wrote.
func insertOldRows(t *testing.T, app *sql.DB) int {
	t.Helper()
	old := time.Now().Add(-2 * time.Hour).UnixMilli()
	if _, err := app.Exec(`WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1500)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'old-' || i, 'T', 'x', 'done', ?1, ?1 FROM n`, old); err != nil {
		t.Fatal(err)
	}
	if _, err := app.Exec(`INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES ('a', 'h', 'done', ?1, ?1), ('b', 'h', 'done', ?1, ?1), ('c', 'h', 'failed', ?1, ?1)`, old); err != nil {
		t.Fatal(err)
	}
	return 1500
}
