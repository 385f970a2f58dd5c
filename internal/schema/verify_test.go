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

// TestIDsNeverReusedReadsCodeOnly: AUTOINCREMENT counts only as a keyword,
// not in a comment, a default's text or a quoted name.
func TestIDsNeverReusedReadsCodeOnly(t *testing.T) {
	for ddl, want := range map[string]bool{
		`CREATE TABLE q (id INTEGER PRIMARY KEY AUTOINCREMENT, x TEXT)`:             true,
		"CREATE TABLE q (id integer primary key autoincrement -- the id\n, x TEXT)": true,
		"CREATE TABLE q (id INTEGER PRIMARY KEY, -- not AUTOINCREMENT\n x TEXT)":    false,
		`CREATE TABLE q (id INTEGER PRIMARY KEY /* AUTOINCREMENT */, x TEXT)`:       false,
		`CREATE TABLE q (id INTEGER PRIMARY KEY, x TEXT DEFAULT 'AUTOINCREMENT')`:   false,
		`CREATE TABLE q (id INTEGER PRIMARY KEY, "AUTOINCREMENT" TEXT)`:             false,
		"CREATE TABLE q (id INTEGER PRIMARY KEY, [autoincrement] TEXT, `a` TEXT)":   false,
	} {
		db := testenv.AppDB(t, filepath.Join(t.TempDir(), "app.db"))
		testenv.MustExec(t, db, ddl)
		got, err := schema.IDsNeverReused(context.Background(), db, "q")
		if err != nil || got != want {
			t.Errorf("%s: ids never reused %v (%v), want %v", ddl, got, err, want)
		}
	}
}

// TestRecordsTableOnlyForDeleteDone: a file without the table of done
// records (made by the application's own migrations before it existed)
// passes verify, since only retention.done_rows: delete writes it, and
// DeleteDoneProblem names it; a table of that name that is not the
// relay's stops the migration and DeleteDoneProblem, and nothing writes
// or prunes it.
func TestRecordsTableOnlyForDeleteDone(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.MustExec(t, db, `DROP TABLE outbox_relay_done_event_queue`)
	if err := schema.Verify(ctx, s); err != nil {
		t.Fatalf("verify without the records table: %v", err)
	}
	if p, err := schema.DeleteDoneProblem(ctx, s); err != nil || !strings.Contains(p, "outbox_relay_done_event_queue") || !strings.Contains(p, "missing") {
		t.Fatalf("delete mode without the records table: %q, %v", p, err)
	}
	testenv.MustExec(t, db, `CREATE TABLE outbox_relay_done_event_queue (id INTEGER PRIMARY KEY, note TEXT)`)
	if p, err := schema.DeleteDoneProblem(ctx, s); err != nil || !strings.Contains(p, "not the relay's") {
		t.Fatalf("delete mode with a foreign records table: %q, %v", p, err)
	}
	testenv.MustExec(t, db, `DELETE FROM outbox_relay_migrations WHERE version = 108`)
	if _, err := schema.Migrate(ctx, s); !errors.Is(err, schema.ErrSchema) || !strings.Contains(err.Error(), "lacks column(s) event_id") {
		t.Fatalf("migrate over a foreign records table: %v", err)
	}
}
