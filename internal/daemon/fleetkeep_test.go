package daemon_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestIdleFilesAreKept: a fleet's files closed while idle still have their
// retention and checkpoints: a file idle from the start and one served
// and then closed, each given 1500 done rows and 3 ledger rows finished two
// hours ago while closed, lose them to a one-hour retention without being
// opened, and the closed file's WAL (its application checkpoints nothing)
// is copied into the database.
func TestIdleFilesAreKept(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	idle := tenantFile(t, dir, "idle", 0)
	served := tenantFile(t, dir, "served", 3)
	migrate(t, dir, "idle", "served")
	insertOldRows(t, idle)
	h := startFleetWith(t, dir, n.URL(), 300*time.Millisecond, func(cfg *config.Config) {
		cfg.Retention.Done, cfg.Retention.ProcessedEvents = time.Hour, time.Hour
	}, func(th *daemon.TestHooks) { th.KeepClosed = 500 * time.Millisecond })
	waitDone(t, served, 3)
	h.waitReadyz(t, ": 0 open (leading 0), 2 idle")

	// Written while closed, by an application that leaves checkpoints to
	// the relay.
	path := filepath.Join(dir, "served.db")
	before := fileSize(t, path)
	app := testenv.AppDB(t, path)
	app.SetMaxOpenConns(1)
	testenv.MustExec(t, app, `PRAGMA wal_autocheckpoint = 0`)
	insertOldRows(t, app)

	h.waitMetrics(t, `outbox_relay_pruned_rows_total{table="outbox"} 3000`, `outbox_relay_pruned_rows_total{table="processed_events"} 6`)
	if c := testenv.Counts(t, served); c["done"] != 3 {
		t.Errorf("served: %v, want its 3 new rows done and no other", c)
	}
	if c := testenv.Counts(t, idle); c["done"] != 0 {
		t.Errorf("idle: %v, want no row", c)
	}
	testenv.Eventually(t, 10*time.Second, "the closed file's WAL checkpointed", func() bool { return fileSize(t, path) > before })
	if code, body := h.readyz(t); code != 200 || !strings.Contains(body, ": 0 open (leading 0), 2 idle") {
		t.Errorf("/readyz %d %q: kept files were opened", code, body)
	}
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// TestWokenFileIsPrunedOnceAnInterval: a file that commits wake is not
// pruned at every open. Its relay's first pass, at the file's first open,
// prunes; rows that are old by the file's second open a moment later,
// well within the relay's retention interval, are still there once the
// file is closed again: the second relay went on from where the first
// one's retention stood.
func TestWokenFileIsPrunedOnceAnInterval(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	app := tenantFile(t, dir, "woken", 0)
	migrate(t, dir, "woken")
	insertOldRows(t, app)
	testenv.InsertRows(t, app, 3, "pending")
	h := startFleetWith(t, dir, n.URL(), 300*time.Millisecond, func(cfg *config.Config) {
		cfg.Retention.Done, cfg.Retention.ProcessedEvents = time.Hour, time.Hour
	})
	h.waitMetrics(t, `outbox_relay_pruned_rows_total{table="outbox"} 1500`)
	waitDone(t, app, 3)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")

	old := time.Now().Add(-2 * time.Hour).UnixMilli()
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) VALUES ('old-again', 'T', 'x', 'done', ?1, ?1)`, old)
	testenv.InsertRows(t, app, 1, "pending") // wakes it
	testenv.Eventually(t, 30*time.Second, "the row that woke it published", func() bool {
		return testenv.Counts(t, app)["pending"] == 0
	})
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	var kept int
	if err := app.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id = 'old-again'`).Scan(&kept); err != nil || kept != 1 {
		t.Fatalf("the row old at the second open: %d left (%v); want it kept until the next pass is due", kept, err)
	}
	h.waitMetrics(t, `outbox_relay_pruned_rows_total{table="outbox"} 1500`)
}
