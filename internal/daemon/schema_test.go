package daemon

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestSchemaOffRefusesWhatTheRelayCannotRunOn: with schema.mode off, a
// table without the relay's columns (an application's own table, or one
// column dropped) stops startup with an error naming each missing column
// and what to do, instead of a relay whose rows are never published; and
// the file is left as it was.
func TestSchemaOffRefusesWhatTheRelayCannotRunOn(t *testing.T) {
	n := testenv.StartNATS(t)
	ownTable := filepath.Join(t.TempDir(), "own.db")
	app := testenv.AppDB(t, ownTable)
	testenv.MustExec(t, app, `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_id TEXT UNIQUE, event_type TEXT NOT NULL,
		payload BLOB NOT NULL, status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
		available_at INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL DEFAULT 0, processed_at INTEGER, last_error TEXT)`)
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('e1', 'Thing', 'x')`)
	dropped := testenv.NewDB(t)
	testenv.MustExec(t, testenv.AppDB(t, dropped), `ALTER TABLE event_queue DROP COLUMN stream_seq`)

	for path, missing := range map[string][]string{
		ownTable: {"column event_queue.claimed_by", "column event_queue.ordering_key", "column event_queue.headers", "column event_queue.stream_seq", "table outbox_relay_instances"},
		dropped:  {"column event_queue.stream_seq"},
	} {
		cfg := config.Default()
		cfg.Database.Path, cfg.NATS.URL, cfg.Metrics.Listen, cfg.Schema.Mode = path, n.URL(), "", config.SchemaOff
		a, err := Open(context.Background(), cfg, zap.NewNop(), Options{Version: "test"})
		if err == nil {
			a.Close()
			t.Fatalf("%s: the relay started with schema.mode off on a table without %v", filepath.Base(path), missing)
		}
		for _, want := range append(missing, "schema.mode is off", "outbox-relay migrate", "schema.mode: auto") {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: the error does not name %q: %v", filepath.Base(path), want, err)
			}
		}
	}
	if got := testenv.Strings(t, app, `SELECT status FROM event_queue`); len(got) != 1 || got[0] != "pending" {
		t.Fatalf("the application's row: %v", got)
	}
	if got := testenv.Strings(t, app, `SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name`); strings.Join(got, ",") != "event_queue" {
		t.Fatalf("schema.mode off changed the schema: tables %v", got)
	}
}

// TestSchemaOffStartsWithoutTheIndexes: an application that indexes the
// table its own way may run the relay with schema.mode off: missing only
// the relay's indexes is a warning, and the rows are published.
func TestSchemaOffStartsWithoutTheIndexes(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.MustExec(t, app, `DROP INDEX event_queue_pending`)
	core, logs := observer.New(zapcore.InfoLevel)
	a, _ := openTestLog(t, n, zap.New(core), func(c *config.Config) { c.Database.Path, c.Schema.Mode = path, config.SchemaOff })
	testenv.InsertN(t, app, 2, "Unindexed")
	testenv.Eventually(t, 30*time.Second, "the rows published", func() bool { return testenv.Counts(t, app)["done"] == 2 })
	testenv.Eventually(t, 20*time.Second, "ready", func() bool { return a.Ready(context.Background()) == nil })
	if l := logs.FilterMessageSnippet("starting without the relay's indexes").All(); len(l) != 1 ||
		!strings.Contains(l[0].ContextMap()["error"].(string), "index event_queue_pending") {
		t.Fatalf("warning lines %v", logs.All())
	}
}
