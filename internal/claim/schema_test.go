package claim

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlite3 "github.com/mattn/go-sqlite3"
)

// legacyNullable is a pre-0101 event_queue whose available_at may be NULL.
const legacyNullable = `CREATE TABLE event_queue (
	id INTEGER PRIMARY KEY,
	event_type TEXT NOT NULL,
	payload BLOB NOT NULL,
	status TEXT NOT NULL DEFAULT 'pending',
	attempts INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER,
	created_at INTEGER NOT NULL DEFAULT 0,
	processed_at INTEGER,
	last_error TEXT)`

// legacyRows fills a legacyNullable table with n pending rows created at
// consecutive milliseconds from 1700000000000, available_at NULL.
func legacyRows(t testing.TB, db *sql.DB, n int) {
	t.Helper()
	exec1(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
		INSERT INTO event_queue (id, event_type, payload, created_at) SELECT i, 'Legacy', 'legacy ' || i, 1700000000000 + i FROM n`, n)
}

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
	s := newStore(t)
	db := appDB(t, s.Path())
	exec1(t, db, `DROP INDEX event_queue_event_id`)
	exec1(t, db, `CREATE INDEX event_queue_event_id ON event_queue (event_id)`)
	// What the index lets through:
	exec1(t, db, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('same', 'A', 'x'), ('same', 'B', 'y')`)
	exec1(t, db, `DELETE FROM event_queue`)

	err := s.Verify(ctx)
	if !errors.Is(err, ErrSchema) {
		t.Fatalf("Verify with a non-unique event_id index = %v, want ErrSchema", err)
	}
	for _, want := range []string{"index event_queue_event_id on event_queue.event_id is not UNIQUE",
		"replace it: DROP INDEX event_queue_event_id; CREATE UNIQUE INDEX event_queue_event_id ON event_queue (event_id)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Verify error %q does not say %q", err, want)
		}
	}
	if _, err := s.Migrate(ctx); !errors.Is(err, ErrSchema) || !strings.Contains(err.Error(), "index event_queue_event_id on event_queue.event_id is not UNIQUE") {
		t.Errorf("Migrate with a non-unique event_id index = %v, want it refused by name", err)
	}

	// A unique index of the application's own, under another name, does.
	exec1(t, db, `DROP INDEX event_queue_event_id`)
	exec1(t, db, `CREATE UNIQUE INDEX app_event_ids ON event_queue (event_id)`)
	if err := s.Verify(ctx); err != nil {
		t.Errorf("Verify with the application's unique index: %v", err)
	}
	if _, err := s.Migrate(ctx); err != nil {
		t.Errorf("Migrate with the application's unique index: %v", err)
	}

	// A non-unique index of another name on a table not yet migrated is
	// left alone: the migration adds the unique one.
	legacy := filepath.Join(t.TempDir(), "legacy.db")
	ldb := appDB(t, legacy)
	exec1(t, ldb, legacyTable)
	exec1(t, ldb, `ALTER TABLE event_queue ADD COLUMN event_id TEXT`)
	exec1(t, ldb, `CREATE INDEX legacy_event_ids ON event_queue (event_id)`)
	ls := openStore(t, legacy, false)
	if err := ls.Verify(ctx); err == nil || !strings.Contains(err.Error(), "index legacy_event_ids on event_queue.event_id is not UNIQUE") ||
		!strings.Contains(err.Error(), "create one: CREATE UNIQUE INDEX event_queue_event_id ON event_queue (event_id)") {
		t.Errorf("Verify with only a non-unique index of another name = %v", err)
	}
	if _, err := ls.Migrate(ctx); err != nil {
		t.Fatalf("Migrate with a non-unique index of another name: %v", err)
	}
	if err := ls.Verify(ctx); err != nil {
		t.Errorf("Verify after the migration: %v", err)
	}

	// An index on (event_id, status) is unique per pair, not per event id.
	exec1(t, db, `DROP INDEX app_event_ids`)
	exec1(t, db, `CREATE UNIQUE INDEX event_queue_event_id ON event_queue (event_id, status)`)
	if err := s.Verify(ctx); err == nil || !strings.Contains(err.Error(), "index event_queue_event_id on event_queue (event_id, status) is not UNIQUE on event_id alone") {
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
			db := appDB(t, path)
			exec1(t, db, tc.table)
			exec1(t, db, `INSERT INTO event_queue (event_type, payload) VALUES ('Legacy', 'x')`)
			s := openStore(t, path, false)
			want := append(tc.want, "declare it", "rebuild the table")
			_, err := s.Migrate(ctx)
			if !errors.Is(err, ErrSchema) {
				t.Fatalf("Migrate = %v, want ErrSchema", err)
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
			if got, err := s.AppliedMigrations(ctx); err != nil || len(got) != 0 {
				t.Errorf("Migrate refused but recorded %v (%v)", got, err)
			}
			err = s.Verify(ctx)
			if !errors.Is(err, ErrSchema) {
				t.Fatalf("Verify = %v, want ErrSchema", err)
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
		{"the relay's default", legacy("INTEGER NOT NULL DEFAULT ("+nowSQL+")", "BIGINT NOT NULL DEFAULT ("+nowSQL+")")},
		{"numeric text", legacy("INTEGER NOT NULL DEFAULT '0'", "INTEGER DEFAULT -1")},
	}
	for _, tc := range accepted {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "app.db")
			db := appDB(t, path)
			exec1(t, db, tc.table)
			s := openStore(t, path, false)
			if _, err := s.Migrate(ctx); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
			if err := s.Verify(ctx); err != nil {
				t.Fatalf("Verify: %v", err)
			}
			exec1(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('a', 'A', 'x', 0)`)
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
	db := appDB(t, path)
	exec1(t, db, legacyNullable)
	legacyRows(t, db, 25)
	later := time.Now().Add(time.Hour).UnixMilli()
	exec1(t, db, `INSERT INTO event_queue (id, event_type, payload, created_at, available_at) VALUES (26, 'Later', 'x', 1700000000026, ?)`, later)
	exec1(t, db, `INSERT INTO event_queue (id, event_type, payload, created_at) VALUES (27, 'TextTime', 'x', '2020-01-01 00:00:00')`)
	s := openStore(t, path, false)
	before := time.Now().UnixMilli()
	if _, err := s.Migrate(ctx); err != nil {
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

// legacyDB is a WAL database holding a legacy outbox of n rows.
func legacyDB(t *testing.T, n int) (string, *sql.DB) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "app.db")
	db := appDB(t, path)
	exec1(t, db, `PRAGMA journal_mode = WAL`)
	exec1(t, db, legacyNullable)
	legacyRows(t, db, n)
	return path, db
}

// TestMigrateBackfillsInShortTransactions: the backfill of a large legacy
// table commits in batches and leaves the lock to the application between
// them: a writer whose busy_timeout is 200 ms keeps committing all through
// the migration and never gets "database is locked".
func TestMigrateBackfillsInShortTransactions(t *testing.T) {
	const n = 50_000
	ctx := context.Background()
	path, db := legacyDB(t, n)
	s := openStore(t, path, false)

	// Count the relay's commits on its (single) writer connection.
	var commits atomic.Int64
	conn, err := s.write.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := conn.Raw(func(dc any) error {
		dc.(*sqlite3.SQLiteConn).RegisterCommitHook(func() int { commits.Add(1); return 0 })
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	conn.Close()

	app, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=200&_txlock=immediate")
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
			tx, err := app.Begin() // BEGIN IMMEDIATE: waits up to 200 ms
			if err == nil {
				worst = max(worst, time.Since(asked))
				now := time.Now().UnixMilli()
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
	_, migErr := s.Migrate(ctx)
	close(stop)
	wg.Wait()
	if migErr != nil {
		t.Fatal(migErr)
	}
	if writeErr != nil {
		t.Fatalf("the application's write failed during the migration (after %d commits): %v", written, writeErr)
	}
	t.Logf("the application committed %d rows during the migration, waiting %v for the lock at worst; the relay committed %d transactions", written, worst, commits.Load())
	if c := commits.Load(); c < n/backfillBatch {
		t.Errorf("the migration committed %d transactions; want the %d-row backfill in batches of %d", c, n, backfillBatch)
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
func assertMigrated(t *testing.T, s *Store) {
	t.Helper()
	ctx := context.Background()
	if got, err := s.AppliedMigrations(ctx); err != nil || fmt.Sprint(got) != "[101 102 103 104]" {
		t.Fatalf("recorded %v, %v", got, err)
	}
	if err := s.Verify(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestMigrateResumesAfterKill kills a migrating process (kill -9) half way
// through the backfill: the migration is not recorded, the ids given so far
// stay, and the next migration finishes the job.
func TestMigrateResumesAfterKill(t *testing.T) {
	const n = 50_000
	ctx := context.Background()
	path, db := legacyDB(t, n)

	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperMigrateToBeKilled$")
	cmd.Env = append(os.Environ(), "CLAIM_HELPER_MIGRATE_KILLED="+path)
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

	s := openStore(t, path, false)
	if got, err := s.AppliedMigrations(ctx); err != nil || len(got) != 0 {
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

	if _, err := s.Migrate(ctx); err != nil {
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
	path := os.Getenv("CLAIM_HELPER_MIGRATE_KILLED")
	if path == "" {
		t.Skip("helper process only")
	}
	s, err := Open(context.Background(), Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
}
