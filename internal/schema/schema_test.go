package schema_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// allMigrations are the versions of every migration, as a fresh file
// records them.
const allMigrations = "[101 102 103 104 105 106 107 108 109 110 111]"

var uuidRe = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// legacyIDs returns the event ids of the rows with id <= n, failing on a row
// without a UUID or an id given twice.
func legacyIDs(t *testing.T, db *sql.DB, n int) map[int64]string {
	t.Helper()
	rows, err := db.Query(`SELECT id, event_id FROM event_queue WHERE id <= ?`, n)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	ids := map[int64]string{}
	seen := map[string]bool{}
	for rows.Next() {
		var id int64
		var eid sql.NullString
		if err := rows.Scan(&id, &eid); err != nil {
			t.Fatal(err)
		}
		if !eid.Valid || !uuidRe.MatchString(eid.String) {
			t.Fatalf("row %d has event_id %v, want a UUID", id, eid)
		}
		if seen[eid.String] {
			t.Fatalf("event id %s given twice", eid.String)
		}
		seen[eid.String] = true
		ids[id] = eid.String
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(ids) != n {
		t.Fatalf("%d legacy rows, want %d", len(ids), n)
	}
	return ids
}

// TestVerifyRequiresAUniqueEventIDIndex: an index on event_id that is not
// UNIQUE lets two rows share an id, and JetStream then drops the second as
// a duplicate; verify (and auto) must refuse it, naming the index.
func TestVerifyRequiresAUniqueEventIDIndex(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.MustExec(t, db, `DROP INDEX event_queue_event_id`)
	testenv.MustExec(t, db, `CREATE INDEX event_queue_event_id ON event_queue (event_id)`)
	// What the index lets through:
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('same', 'A', 'x'), ('same', 'B', 'y')`)
	testenv.MustExec(t, db, `DELETE FROM event_queue`)

	err := schema.Verify(ctx, s)
	if !errors.Is(err, schema.ErrSchema) {
		t.Fatalf("Verify with a non-unique event_id index = %v, want schema.ErrSchema", err)
	}
	for _, want := range []string{"index event_queue_event_id on event_queue.event_id is not UNIQUE",
		"replace it: DROP INDEX event_queue_event_id; CREATE UNIQUE INDEX event_queue_event_id ON event_queue (event_id)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Verify error %q does not say %q", err, want)
		}
	}
	if _, err := schema.Migrate(ctx, s); !errors.Is(err, schema.ErrSchema) || !strings.Contains(err.Error(), "index event_queue_event_id on event_queue.event_id is not UNIQUE") {
		t.Errorf("Migrate with a non-unique event_id index = %v, want it refused by name", err)
	}

	// A unique index of the application's own, under another name, does.
	testenv.MustExec(t, db, `DROP INDEX event_queue_event_id`)
	testenv.MustExec(t, db, `CREATE UNIQUE INDEX app_event_ids ON event_queue (event_id)`)
	if err := schema.Verify(ctx, s); err != nil {
		t.Errorf("Verify with the application's unique index: %v", err)
	}
	if _, err := schema.Migrate(ctx, s); err != nil {
		t.Errorf("Migrate with the application's unique index: %v", err)
	}

	// A non-unique index of another name on a table not yet migrated is
	// left alone: the migration adds the unique one.
	legacy := filepath.Join(t.TempDir(), "legacy.db")
	ldb := testenv.AppDB(t, legacy)
	testenv.MustExec(t, ldb, legacyTable)
	testenv.MustExec(t, ldb, `ALTER TABLE event_queue ADD COLUMN event_id TEXT`)
	testenv.MustExec(t, ldb, `CREATE INDEX legacy_event_ids ON event_queue (event_id)`)
	ls := testenv.OpenDB(t, legacy)
	if err := schema.Verify(ctx, ls); err == nil || !strings.Contains(err.Error(), "index legacy_event_ids on event_queue.event_id is not UNIQUE") ||
		!strings.Contains(err.Error(), "create one: CREATE UNIQUE INDEX event_queue_event_id ON event_queue (event_id)") {
		t.Errorf("Verify with only a non-unique index of another name = %v", err)
	}
	if _, err := schema.Migrate(ctx, ls); err != nil {
		t.Fatalf("Migrate with a non-unique index of another name: %v", err)
	}
	if err := schema.Verify(ctx, ls); err != nil {
		t.Errorf("Verify after the migration: %v", err)
	}

	// An index on (event_id, status) is unique per pair, not per event id.
	testenv.MustExec(t, db, `DROP INDEX app_event_ids`)
	testenv.MustExec(t, db, `CREATE UNIQUE INDEX event_queue_event_id ON event_queue (event_id, status)`)
	if err := schema.Verify(ctx, s); err == nil || !strings.Contains(err.Error(), "index event_queue_event_id on event_queue (event_id, status) is not UNIQUE on event_id alone") {
		t.Errorf("Verify with a unique (event_id, status) index = %v", err)
	}
}

// TestTextTimeColumnsAreRefused: a legacy table whose time columns do not
// give integer milliseconds (a text default, a non-integer type) is named,
// with its type, its default and the fix, by both migrate and verify, and
// migrate changes nothing. Integer columns keep migrating.
func TestTextTimeColumnsAreRefused(t *testing.T) {
	legacy := func(created, available string) string {
		return `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_type TEXT NOT NULL, payload BLOB NOT NULL,
			status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
			available_at ` + available + `, created_at ` + created + `, processed_at INTEGER, last_error TEXT)`
	}
	refused := []struct {
		name, table string
		want        []string
	}{
		{"text current_timestamp", legacy("TEXT DEFAULT CURRENT_TIMESTAMP", "INTEGER NOT NULL DEFAULT 0"),
			[]string{"column event_queue.created_at is TEXT DEFAULT CURRENT_TIMESTAMP", "TEXT affinity", "INTEGER"}},
		{"datetime", legacy("DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP", "INTEGER"),
			[]string{"column event_queue.created_at is DATETIME DEFAULT CURRENT_TIMESTAMP", "NUMERIC affinity"}},
		{"integer with a text default", legacy("INTEGER NOT NULL DEFAULT CURRENT_TIMESTAMP", "INTEGER"),
			[]string{"column event_queue.created_at is INTEGER DEFAULT CURRENT_TIMESTAMP", "stores text"}},
		{"available_at datetime('now')", legacy("INTEGER NOT NULL DEFAULT 0", "INTEGER DEFAULT (datetime('now'))"),
			[]string{"column event_queue.available_at is INTEGER DEFAULT (datetime('now'))", "stores text"}},
		{"available_at real with a text default", legacy("INTEGER NOT NULL DEFAULT 0", "REAL DEFAULT 'now'"),
			[]string{"column event_queue.available_at is REAL DEFAULT 'now'", "REAL affinity"}},
		{"unix seconds", legacy("INTEGER NOT NULL DEFAULT (strftime('%s', 'now'))", "INTEGER"),
			[]string{"column event_queue.created_at is INTEGER DEFAULT (strftime('%s', 'now'))", "Unix seconds"}},
		{"both", legacy("TEXT DEFAULT CURRENT_TIMESTAMP", "TEXT DEFAULT CURRENT_TIMESTAMP"),
			[]string{"column event_queue.created_at is TEXT", "column event_queue.available_at is TEXT"}},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "app.db")
			db := testenv.AppDB(t, path)
			testenv.MustExec(t, db, tc.table)
			testenv.MustExec(t, db, `INSERT INTO event_queue (event_type, payload) VALUES ('Legacy', 'x')`)
			s := testenv.OpenDB(t, path)
			want := append(tc.want, "declare it", "rebuild the table")
			_, err := schema.Migrate(ctx, s)
			if !errors.Is(err, schema.ErrSchema) {
				t.Fatalf("Migrate = %v, want schema.ErrSchema", err)
			}
			for _, w := range want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Migrate error %q does not say %q", err, w)
				}
			}
			// Nothing changed: no column added, no migration recorded.
			var n int
			if err := db.QueryRow(`SELECT count(*) FROM pragma_table_info('event_queue') WHERE name IN ('event_id', 'claimed_at', 'claimed_by')`).Scan(&n); err != nil || n != 0 {
				t.Errorf("Migrate refused but added %d columns (%v)", n, err)
			}
			if got, err := applied(ctx, s); err != nil || len(got) != 0 {
				t.Errorf("Migrate refused but recorded %v (%v)", got, err)
			}
			err = schema.Verify(ctx, s)
			if !errors.Is(err, schema.ErrSchema) {
				t.Fatalf("Verify = %v, want schema.ErrSchema", err)
			}
			for _, w := range want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Verify error %q does not say %q", err, w)
				}
			}
		})
	}

	accepted := []struct{ name, table string }{
		{"integer default 0", legacy("INTEGER NOT NULL DEFAULT 0", "INTEGER NOT NULL DEFAULT 0")},
		{"no default", legacy("INTEGER NOT NULL DEFAULT 0", "INTEGER")},
		{"the relay's default", legacy("INTEGER NOT NULL DEFAULT ("+schema.NowSQL+")", "BIGINT NOT NULL DEFAULT ("+schema.NowSQL+")")},
		{"numeric text", legacy("INTEGER NOT NULL DEFAULT '0'", "INTEGER DEFAULT -1")},
	}
	for _, tc := range accepted {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "app.db")
			db := testenv.AppDB(t, path)
			testenv.MustExec(t, db, tc.table)
			s := testenv.OpenDB(t, path)
			if _, err := schema.Migrate(ctx, s); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
			if err := schema.Verify(ctx, s); err != nil {
				t.Fatalf("Verify: %v", err)
			}
			testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('a', 'A', 'x', 0)`)
			var typ string
			if err := db.QueryRow(`SELECT typeof(created_at) FROM event_queue`).Scan(&typ); err != nil || typ != "integer" {
				t.Fatalf("created_at of an inserted row is %s (%v), want integer", typ, err)
			}
		})
	}
}

// TestMigrateMakesNullAvailableAtClaimable: legacy rows with a NULL
// available_at are never due (the claim asks available_at <= now); the
// migration gives them their created_at, or now where that is not an
// integer, and leaves a set available_at alone.
func TestMigrateMakesNullAvailableAtClaimable(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "app.db")
	db := testenv.AppDB(t, path)
	testenv.MustExec(t, db, testenv.LegacyNullable)
	testenv.LegacyRows(t, db, 25)
	later := time.Now().Add(time.Hour).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_type, payload, created_at, available_at) VALUES (26, 'Later', 'x', 1700000000026, ?)`, later)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_type, payload, created_at) VALUES (27, 'TextTime', 'x', '2020-01-01 00:00:00')`)
	s := testenv.OpenDB(t, path)
	before := time.Now().UnixMilli()
	if _, err := schema.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	after := time.Now().UnixMilli()

	var avail, created sql.NullInt64
	for id := int64(1); id <= 25; id++ {
		if err := db.QueryRow(`SELECT available_at, created_at FROM event_queue WHERE id = ?`, id).Scan(&avail, &created); err != nil {
			t.Fatal(err)
		}
		if !avail.Valid || avail.Int64 != created.Int64 {
			t.Fatalf("row %d: available_at %v, want its created_at %d", id, avail, created.Int64)
		}
	}
	if err := db.QueryRow(`SELECT available_at FROM event_queue WHERE id = 26`).Scan(&avail); err != nil || avail.Int64 != later {
		t.Fatalf("a scheduled row's available_at became %v (%v), want %d", avail, err, later)
	}
	if err := db.QueryRow(`SELECT available_at FROM event_queue WHERE id = 27`).Scan(&avail); err != nil || avail.Int64 < before || avail.Int64 > after {
		t.Fatalf("the text-created row's available_at is %v (%v), want now in [%d, %d]", avail, err, before, after)
	}
	// The claim's condition (available_at <= now) now holds for every row
	// but the scheduled one.
	var due int
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'pending' AND typeof(available_at) = 'integer' AND available_at <= ?`, after).Scan(&due)
	if due != 26 {
		t.Fatalf("%d rows due after the migration, want 26 (all but the scheduled one)", due)
	}
}

// TestMigrateBackfillsInShortTransactions: the backfill of a large legacy
// table commits in batches and leaves the lock to the application between
// them: a writer whose busy_timeout is 200 ms keeps committing all through
// the migration and never gets "database is locked".
func TestMigrateBackfillsInShortTransactions(t *testing.T) {
	const n = 50_000
	ctx := context.Background()
	path, db := testenv.LegacyDB(t, n)
	s := testenv.OpenDB(t, path)

	// The application waits for the lock as long as a typical one does
	// (5 s, go-sqlite3's default): the migration must leave it the lock
	// often enough for that, on a loaded machine too. Its longest wait is
	// logged, not asserted.
	app, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	app.SetMaxOpenConns(1)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var written int
	var writeErr error
	var worst time.Duration
	// What the application saw of the backfill from inside its own
	// transactions: how many legacy rows had their id, each time.
	partial := map[int]bool{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			asked := time.Now()
			tx, err := app.Begin() // BEGIN IMMEDIATE: waits up to 5 s
			if err == nil {
				worst = max(worst, time.Since(asked))
				now := time.Now().UnixMilli()
				var given int // before the migration adds event_id, the query fails: none
				if tx.QueryRow(`SELECT count(*) FROM event_queue WHERE id <= ? AND event_id IS NOT NULL`, n).Scan(&given) == nil && given > 0 && given < n {
					partial[given] = true
				}
				if _, err = tx.Exec(`INSERT INTO event_queue (event_type, payload, available_at, created_at) VALUES ('App', 'x', ?1, ?1)`, now); err == nil {
					err = tx.Commit()
				} else {
					tx.Rollback()
				}
			}
			if err != nil {
				writeErr = err
				return
			}
			written++
			time.Sleep(time.Millisecond)
		}
	}()
	_, migErr := schema.Migrate(ctx, s)
	close(stop)
	wg.Wait()
	if migErr != nil {
		t.Fatal(migErr)
	}
	if writeErr != nil {
		t.Fatalf("the application's write failed during the migration (after %d commits): %v", written, writeErr)
	}
	t.Logf("the application committed %d rows during the migration, waiting %v for the lock at worst; it saw the backfill part done %d times", written, worst, len(partial))
	// Two different partial states seen from the application's own
	// transactions: the backfill committed at least three times, and the
	// application wrote between its commits.
	if len(partial) < 2 {
		t.Errorf("the application saw the backfill part done %d times (%v); want it in batches, with the application's commits between them", len(partial), partial)
	}

	legacyIDs(t, db, n)
	var missing int
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE id <= ? AND (available_at IS NULL OR available_at <> created_at)`, n).Scan(&missing)
	if missing != 0 {
		t.Fatalf("%d legacy rows without their available_at", missing)
	}
	assertMigrated(t, s)
}

// assertMigrated checks that every migration is recorded and the schema
// is complete.
func assertMigrated(t *testing.T, s *sqlitedb.DB) {
	t.Helper()
	ctx := context.Background()
	if got, err := applied(ctx, s); err != nil || fmt.Sprint(got) != allMigrations {
		t.Fatalf("recorded %v, %v", got, err)
	}
	if err := schema.Verify(ctx, s); err != nil {
		t.Fatal(err)
	}
}

// TestMigrateResumesAfterKill kills a migrating process (kill -9) half way
// through the backfill: the migration is not recorded, the ids given so far
// stay, and the next migration finishes the job.
func TestMigrateResumesAfterKill(t *testing.T) {
	const n = 50_000
	ctx := context.Background()
	path, db := testenv.LegacyDB(t, n)

	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperMigrateToBeKilled$")
	cmd.Env = append(os.Environ(), "SCHEMA_HELPER_MIGRATE_KILLED="+path)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// Partial progress: the first row has its id and the last does not yet.
	// (Before the migration adds event_id the query fails: not yet.)
	var first, last sql.NullString
	for partial := false; !partial; {
		select {
		case err := <-exited:
			t.Fatalf("the migration ended (%v) before any reader saw it half done: it is not batched\n%s", err, out.String())
		default:
		}
		err := db.QueryRow(`SELECT (SELECT event_id FROM event_queue WHERE id = 1), (SELECT event_id FROM event_queue WHERE id = ?)`, n).Scan(&first, &last)
		partial = err == nil && first.Valid && !last.Valid
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-exited

	s := testenv.OpenDB(t, path)
	if got, err := applied(ctx, s); err != nil || len(got) != 0 {
		t.Fatalf("recorded %v (%v) although the backfill did not finish", got, err)
	}
	given := map[int64]string{}
	rows, err := db.Query(`SELECT id, event_id FROM event_queue WHERE event_id IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var eid string
		rows.Scan(&id, &eid)
		given[id] = eid
	}
	rows.Close()
	if len(given) == 0 || len(given) == n {
		t.Fatalf("%d of %d rows have ids after the kill; want part of them", len(given), n)
	}
	t.Logf("killed with %d of %d rows given ids", len(given), n)

	if _, err := schema.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	ids := legacyIDs(t, db, n)
	for id, eid := range given {
		if ids[id] != eid {
			t.Fatalf("row %d's id changed from %s to %s on the rerun", id, eid, ids[id])
		}
	}
	var missing int
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE available_at IS NULL`).Scan(&missing)
	if missing != 0 {
		t.Fatalf("%d rows without available_at", missing)
	}
	assertMigrated(t, s)
}

// TestHelperMigrateToBeKilled is the child process of
// TestMigrateResumesAfterKill.
func TestHelperMigrateToBeKilled(t *testing.T) {
	path := os.Getenv("SCHEMA_HELPER_MIGRATE_KILLED")
	if path == "" {
		t.Skip("helper process only")
	}
	if _, err := schema.Migrate(context.Background(), testenv.OpenDB(t, path)); err != nil {
		t.Fatal(err)
	}
}

func TestMigrateFreshAndIdempotent(t *testing.T) {
	ctx := context.Background()
	s := testenv.CreateDB(t, filepath.Join(t.TempDir(), "app.db"))
	if err := schema.Verify(ctx, s); !errors.Is(err, schema.ErrSchema) || !strings.Contains(err.Error(), "table event_queue") {
		t.Fatalf("Verify before migrate = %v", err)
	}
	applied, err := schema.Migrate(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(applied) != allMigrations {
		t.Fatalf("applied %v", applied)
	}
	if err := schema.Verify(ctx, s); err != nil {
		t.Fatalf("Verify after migrate: %v", err)
	}
	// Again while the application holds its write lock throughout: a
	// migrated file takes no write lock (a fleet opens its files again
	// and again while their applications write).
	app, err := testenv.AppDB(t, s.Path()).Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	if _, err := app.ExecContext(ctx, `BEGIN IMMEDIATE`); err != nil {
		t.Fatal(err)
	}
	defer app.ExecContext(ctx, `ROLLBACK`)
	applied, err = schema.Migrate(ctx, s)
	if err != nil || len(applied) != 0 {
		t.Fatalf("second Migrate, with the application's write lock held, applied %v, %v", applied, err)
	}
}

func TestVerifyNamesEveryMissingPiece(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db := testenv.AppDB(t, path)
	testenv.MustExec(t, db, `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_type TEXT NOT NULL, payload BLOB NOT NULL,
		status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0, available_at INTEGER NOT NULL DEFAULT 0,
		created_at INTEGER NOT NULL DEFAULT 0, processed_at INTEGER, last_error TEXT)`)
	s := testenv.OpenDB(t, path)
	err := schema.Verify(context.Background(), s)
	for _, want := range []string{"column event_queue.event_id", "column event_queue.claimed_at", "column event_queue.claimed_by",
		"column event_queue.ordering_key", "column event_queue.headers", "column event_queue.stream_seq", "column event_queue.atomic_group", "index event_queue_event_id", "index event_queue_pending", "index event_queue_ordering", "index event_queue_atomic_group",
		"table processed_events", "table " + schema.InstancesTable, "table " + schema.ExhaustedTable, "table " + schema.PublishedTable} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Verify error %v does not name %s", err, want)
		}
	}
}

// legacyTable is an event_queue from before migration 101.
const legacyTable = `CREATE TABLE event_queue (
	id INTEGER PRIMARY KEY,
	event_type TEXT NOT NULL,
	payload BLOB NOT NULL,
	status TEXT NOT NULL DEFAULT 'pending',
	attempts INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER NOT NULL DEFAULT 0,
	created_at INTEGER NOT NULL DEFAULT 0,
	processed_at INTEGER,
	last_error TEXT)`

func TestMigrateLegacyBackfillsDistinctIDs(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "app.db")
	db := testenv.AppDB(t, path)
	testenv.MustExec(t, db, legacyTable)
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 5000)
		INSERT INTO event_queue (event_type, payload, status) SELECT 'Legacy', 'p' || i, CASE WHEN i % 2 = 0 THEN 'done' ELSE 'pending' END FROM n`)
	s := testenv.OpenDB(t, path)
	if _, err := schema.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	rows, err := db.Query(`SELECT event_id FROM event_queue`)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for rows.Next() {
		var id sql.NullString
		rows.Scan(&id)
		if !id.Valid || !uuidRe.MatchString(id.String) {
			t.Fatalf("row without a UUID: %v", id)
		}
		if seen[id.String] {
			t.Fatalf("event id %s given twice", id.String)
		}
		seen[id.String] = true
	}
	rows.Close()
	if len(seen) != 5000 {
		t.Fatalf("%d ids, want 5000", len(seen))
	}
	if _, err := db.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'X', 'x')`, firstKey(seen)); err == nil {
		t.Fatal("duplicate event_id accepted: no unique index")
	}
	if err := schema.Verify(ctx, s); err != nil {
		t.Fatal(err)
	}
}

func firstKey(m map[string]bool) string {
	for k := range m {
		return k
	}
	return ""
}

func TestMigrateRefusesForeignTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	testenv.MustExec(t, testenv.AppDB(t, path), `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, body TEXT)`)
	s := testenv.OpenDB(t, path)
	_, err := schema.Migrate(context.Background(), s)
	if err == nil || !strings.Contains(err.Error(), "lacks column(s) event_type, payload, status") {
		t.Fatalf("Migrate on a foreign table = %v", err)
	}
}

// TestMigrateCreatesATableWhole watches a new file's schema from the
// application's side while Migrate gives it the outbox: it sees no outbox
// table, then the whole of it (every column, index and table of the relay,
// every migration recorded), never a table part made. An application that
// creates the table itself (CREATE TABLE IF NOT EXISTS) and writes its
// ordering_key at once, as a fleet's new tenant does, would otherwise find
// the first migration's table and its insert refused.
func TestMigrateCreatesATableWhole(t *testing.T) {
	ctx := context.Background()
	for round := 0; round < 3; round++ {
		s := testenv.CreateDB(t, filepath.Join(t.TempDir(), "app.db"))
		app, err := testenv.AppDB(t, s.Path()).Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer app.Close()
		done := make(chan error, 1)
		go func() {
			_, err := schema.Migrate(ctx, s)
			done <- err
		}()
		var seen []string
		for migrating := true; migrating; {
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
				migrating = false
			default:
			}
			objects, records := schemaSeen(t, app)
			if state := objects + " | recorded: " + records; len(seen) == 0 || seen[len(seen)-1] != state {
				seen = append(seen, state)
			}
		}
		whole := seen[len(seen)-1]
		if !strings.Contains(whole, "column:ordering_key") || !strings.HasSuffix(whole, "recorded: "+strings.Trim(allMigrations, "[]")) {
			t.Fatalf("round %d: after Migrate the application sees %s", round, whole)
		}
		for _, state := range seen[:len(seen)-1] {
			if state != " | recorded: " {
				t.Errorf("round %d: the application saw the schema part made: %s", round, state)
			}
		}
		if t.Failed() {
			t.Fatalf("round %d: and then whole: %s", round, whole)
		}
	}
}

// TestMigrateCreatesADroppedTableAgain drops a migrated file's outbox
// table: its migrations are still recorded, and Migrate gives the file the
// table again, whole, rather than failing on the index the table took with
// it.
func TestMigrateCreatesADroppedTableAgain(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	testenv.MustExec(t, testenv.AppDB(t, s.Path()), `DROP TABLE event_queue`)
	applied, err := schema.Migrate(ctx, s)
	if err != nil || fmt.Sprint(applied) != allMigrations {
		t.Fatalf("Migrate after the table was dropped applied %v, %v", applied, err)
	}
	assertMigratedOnce(t, s.Path())
}

// schemaSeen returns, as of one commit, the objects of the file's schema
// and the outbox table's columns (type:name, sorted), and the migration
// versions recorded.
func schemaSeen(t *testing.T, app *sql.Conn) (objects, records string) {
	t.Helper()
	ctx := context.Background()
	if _, err := app.ExecContext(ctx, `BEGIN DEFERRED`); err != nil {
		t.Fatal(err)
	}
	defer app.ExecContext(ctx, `COMMIT`)
	err := app.QueryRowContext(ctx, `SELECT coalesce(group_concat(name, ' '), '') FROM (SELECT type || ':' || name AS name FROM sqlite_schema
	UNION ALL SELECT 'column:' || name FROM pragma_table_info('event_queue') ORDER BY 1)`).Scan(&objects)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(objects, "table:"+schema.MigrationsTable) {
		err = app.QueryRowContext(ctx, `SELECT coalesce(group_concat(version, ' '), '') FROM (SELECT version FROM `+schema.MigrationsTable+` ORDER BY version)`).Scan(&records)
		if err != nil {
			t.Fatal(err)
		}
	}
	return objects, records
}

// TestMigrationRace migrates the same new file from several independent
// connections at once, then from two processes at once.
func TestMigrationRace(t *testing.T) {
	for round := 0; round < 5; round++ {
		path := filepath.Join(t.TempDir(), "app.db")
		var wg sync.WaitGroup
		errs := make([]error, 4)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Create: true})
				if err != nil {
					errs[i] = err
					return
				}
				defer s.Close()
				_, errs[i] = schema.Migrate(context.Background(), s)
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("round %d migrator %d: %v", round, i, err)
			}
		}
		assertMigratedOnce(t, path)
	}
	path := filepath.Join(t.TempDir(), "app.db")
	var procs []*exec.Cmd
	outs := make([]strings.Builder, 2)
	for i := 0; i < 2; i++ {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperMigrate$")
		cmd.Env = append(os.Environ(), "SCHEMA_HELPER_MIGRATE="+path)
		cmd.Stdout, cmd.Stderr = &outs[i], &outs[i]
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs = append(procs, cmd)
	}
	for i, p := range procs {
		if err := p.Wait(); err != nil {
			t.Logf("output: %s", outs[i].String())
			t.Fatalf("migrating process %d: %v", i, err)
		}
	}
	assertMigratedOnce(t, path)
}

// TestHelperMigrate is the child process of TestMigrationRace.
func TestHelperMigrate(t *testing.T) {
	path := os.Getenv("SCHEMA_HELPER_MIGRATE")
	if path == "" {
		t.Skip("helper process only")
	}
	if _, err := schema.Migrate(context.Background(), testenv.CreateDB(t, path)); err != nil {
		t.Fatal(err)
	}
}

func assertMigratedOnce(t *testing.T, path string) {
	t.Helper()
	s := testenv.OpenDB(t, path)
	got, err := applied(context.Background(), s)
	if err != nil || fmt.Sprint(got) != allMigrations {
		t.Fatalf("migrations recorded %v, %v", got, err)
	}
	if err := schema.Verify(context.Background(), s); err != nil {
		t.Fatal(err)
	}
}

// applied lists the migration versions recorded for the outbox table of s.
func applied(ctx context.Context, s *sqlitedb.DB) ([]int, error) {
	if ok, err := sqlitedb.ObjectExists(ctx, s.Reader(), "table", schema.MigrationsTable); err != nil || !ok {
		return nil, err
	}
	rows, err := s.Reader().QueryContext(ctx, `SELECT version FROM `+schema.MigrationsTable+` WHERE target = ? ORDER BY version`, s.Table())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var vs []int
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		vs = append(vs, v)
	}
	return vs, rows.Err()
}
