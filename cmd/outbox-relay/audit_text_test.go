package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/audit"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestAuditReportEscapesEventIDs: a mismatch's event id, written by the
// application, reaches the terminal with its control characters escaped.
func TestAuditReportEscapesEventIDs(t *testing.T) {
	var w bytes.Buffer
	printAudit(&w, config.Default(), 0, audit.Report{Audited: 1, Mismatches: []audit.Mismatch{{RowID: 1, EventID: hostileID, StreamSeq: 3, MsgID: hostileID}}})
	if i := rawControls(w.String()); i >= 0 || !strings.Contains(w.String(), "event_id "+escapedID) {
		t.Errorf("audit's report does not escape the event id:\n%q", w.String())
	}
}

// TestAuditNamesAMissingTable: audit on a file without the outbox table
// names the table and the file and says what to do, before it connects to
// the server (which is not there).
func TestAuditNamesAMissingTable(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "empty.db")
	testenv.MustExec(t, testenv.AppDB(t, empty), `CREATE TABLE app_data (id INTEGER PRIMARY KEY)`)
	code, _, errOut := runCLI(t, "audit", "--database-path", empty, "--nats-url", "nats://127.0.0.1:1")
	for _, want := range []string{"no such table: event_queue in " + empty, "outbox-relay migrate", "database.table"} {
		if code != exitRuntime || !strings.Contains(errOut, want) {
			t.Errorf("audit on a file without the outbox table: exit %d, stderr %q; want 1 and %q", code, errOut, want)
		}
	}
}
