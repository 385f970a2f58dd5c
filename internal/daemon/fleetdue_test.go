package daemon_test

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestClosedFileWakesForRowsDueByNullOrTextAvailableAt: the contract
// says a NULL available_at means now and SQLite's date-time text counts as
// the time it names. A row written so into a file closed while idle is
// due: the file must be opened and the row published, not left pending.
func TestClosedFileWakesForRowsDueByNullOrTextAvailableAt(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	// legacy's available_at may be NULL (a table older than the relay's
	// migration, which never rewrites column definitions).
	legacy := testenv.AppDB(t, filepath.Join(dir, "legacy.db"))
	testenv.MustExec(t, legacy, `CREATE TABLE event_queue (
	id INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL UNIQUE, event_type TEXT NOT NULL,
	payload BLOB NOT NULL, status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER,
	created_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
	claimed_at INTEGER, claimed_by TEXT, published_at INTEGER, last_error TEXT, ordering_key TEXT)`)
	testenv.MustExec(t, legacy, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('l1', 'order.placed', 'legacy', ?)`, time.Now().UnixMilli())
	// texty has a row scheduled an hour ahead (as integer milliseconds).
	texty := tenantFile(t, dir, "texty", 1)
	testenv.MustExec(t, texty, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('later', 'order.placed', 'texty', ?)`,
		time.Now().Add(time.Hour).UnixMilli())
	h := startFleet(t, dir, n.URL(), 300*time.Millisecond)
	waitDone(t, legacy, 1)
	waitDone(t, texty, 1)
	h.waitReadyz(t, ": 0 open (leading 0), 2 idle")

	// Written while both files are closed: each row is due now.
	testenv.MustExec(t, legacy, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('l2', 'order.placed', 'legacy', NULL)`)
	testenv.MustExec(t, texty, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('t2', 'order.placed', 'texty', datetime('now'))`)
	waitDone(t, legacy, 2)
	waitDone(t, texty, 2)
}

// TestFileWithAParkedKeyIsNotOpenedForIt: a dead letter parks its key
// (ordering.on_dead_letter: hold), and the key's later rows wait for an
// operator: they are not due in any sense a relay can act on. A file
// whose only pending rows wait so must not be opened at start (nor by
// every write to it, nor by another relay's heartbeats on it, which
// makes two relays open it for each other for ever).
func TestFileWithAParkedKeyIsNotOpenedForIt(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	parked := tenantFile(t, dir, "parked", 0)
	testenv.MustExec(t, parked, `INSERT INTO event_queue (event_id, event_type, payload, status, ordering_key) VALUES ('dead', 'order.placed', 'parked', 'dead_lettered', 'k')`)
	insertKeyed(t, parked, "parked", 2) // behind the dead letter
	busy := tenantFile(t, dir, "busy", 3)
	h := startFleet(t, dir, n.URL(), time.Minute)
	waitDone(t, busy, 3) // the first scan is over
	h.waitReadyz(t, ": 1 open (leading 1), 1 idle")
	if c := testenv.Counts(t, parked); c["pending"] != 2 || c["dead_lettered"] != 1 {
		t.Fatalf("parked's rows: %v", c)
	}
}

// startFleetHooks starts a fleet with cfg and hooks (see startFleetWith).
