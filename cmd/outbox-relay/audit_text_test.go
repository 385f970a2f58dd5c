package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

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
