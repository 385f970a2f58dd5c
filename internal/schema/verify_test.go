package schema_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestUsableNamesWhatTheRelayCannotWorkWithout: Usable (schema.mode off's
// check) refuses a table without the relay's columns or tables, naming
// each and what to run, and a time column that cannot hold milliseconds;
// it lets missing indexes pass, which Verify still names.
func TestUsableNamesWhatTheRelayCannotWorkWithout(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	app := testenv.AppDB(t, s.Path())
	testenv.MustExec(t, app, `DROP INDEX event_queue_pending`)
	if err := schema.Usable(ctx, s); err != nil {
		t.Fatalf("Usable without an index: %v; want nil", err)
	}
	if err := schema.Verify(ctx, s); err == nil || !strings.Contains(err.Error(), "index event_queue_pending") {
		t.Fatalf("Verify without an index = %v; want it named", err)
	}
	testenv.MustExec(t, app, `ALTER TABLE event_queue DROP COLUMN stream_seq`)
	testenv.MustExec(t, app, `ALTER TABLE event_queue DROP COLUMN headers`)
	testenv.MustExec(t, app, `DROP TABLE `+schema.ExhaustedTable)
	err := schema.Usable(ctx, s)
	if !errors.Is(err, schema.ErrSchema) {
		t.Fatalf("Usable without the relay's columns = %v; want schema.ErrSchema", err)
	}
	for _, want := range []string{s.Path(), "column event_queue.stream_seq", "column event_queue.headers", "table " + schema.ExhaustedTable, "outbox-relay migrate", "schema.mode auto"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Usable error %q does not name %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "index") {
		t.Errorf("Usable error %q names an index", err)
	}
}

// TestUsableRefusesTextTimes: a time column that holds text would make
// every row due, or none.
func TestUsableRefusesTextTimes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	app := testenv.AppDB(t, path)
	testenv.MustExec(t, app, strings.ReplaceAll(legacyTable, "created_at INTEGER NOT NULL DEFAULT 0", "created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP"))
	s := testenv.OpenDB(t, path)
	err := schema.Usable(context.Background(), s)
	if !errors.Is(err, schema.ErrSchema) || !strings.Contains(err.Error(), "column event_queue.created_at is TEXT") {
		t.Fatalf("Usable on a table with text times = %v; want the column named", err)
	}
}

// TestUsableWithoutTheTable names the table.
func TestUsableWithoutTheTable(t *testing.T) {
	s := testenv.CreateDB(t, filepath.Join(t.TempDir(), "app.db"))
	if err := schema.Usable(context.Background(), s); !errors.Is(err, schema.ErrSchema) || !strings.Contains(err.Error(), "missing table event_queue") {
		t.Fatalf("Usable without the table = %v; want it named", err)
	}
}
