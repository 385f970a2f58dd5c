package claim

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/event"
)

var uuidRe = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// newStore opens a migrated store on a new file.
func newStore(t testing.TB) *Store {
	t.Helper()
	s := openStore(t, filepath.Join(t.TempDir(), "app.db"), true)
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func openStore(t testing.TB, path string, create bool) *Store {
	t.Helper()
	s, err := Open(context.Background(), Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Create: create})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// appDB is the application's own connection to the file.
func appDB(t testing.TB, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func exec1(t testing.TB, db *sql.DB, q string, args ...any) {
	t.Helper()
	if _, err := db.Exec(q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// claimed opens a fresh store whose application inserts n pending rows,
// and claims them all.
func claimed(t *testing.T, n int) (*Store, *sql.DB, []event.Row) {
	t.Helper()
	s := newStore(t)
	db := appDB(t, s.Path())
	insertRows(t, db, n, "pending")
	rows, err := s.Claim(context.Background(), n, 0)
	if err != nil || len(rows) != n {
		t.Fatal(rows, err)
	}
	return s, db, rows
}

func insertRows(t testing.TB, db *sql.DB, n int, status string) {
	t.Helper()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	st, err := tx.Prepare(`INSERT INTO event_queue (event_id, event_type, payload, status) VALUES (?, 'Thing', x'00ff', ?)`)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		if _, err := st.Exec(event.NewID(), status); err != nil {
			t.Fatal(err)
		}
	}
	st.Close()
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

func TestOpenMissingDatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "nope.db")
	_, err := Open(context.Background(), Options{Path: path, Table: "event_queue"})
	if !errors.Is(err, ErrNoDatabase) || !strings.Contains(err.Error(), path) {
		t.Fatalf("Open of a missing file = %v; want ErrNoDatabase naming the path", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatal("Open without Create created the file")
	}
}

func TestOpenNotADatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "junk.db")
	if err := os.WriteFile(path, []byte(strings.Repeat("not sqlite ", 1000)), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Open(context.Background(), Options{Path: path, Table: "event_queue"})
	if err == nil || !strings.Contains(err.Error(), "not a database") {
		t.Fatalf("Open of a junk file = %v; want 'not a database'", err)
	}
}

func TestMigrateFreshAndIdempotent(t *testing.T) {
	ctx := context.Background()
	s := openStore(t, filepath.Join(t.TempDir(), "app.db"), true)
	if err := s.Verify(ctx); !errors.Is(err, ErrSchema) || !strings.Contains(err.Error(), "table event_queue") {
		t.Fatalf("Verify before migrate = %v", err)
	}
	applied, err := s.Migrate(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(applied) != "[101 102 103 104]" {
		t.Fatalf("applied %v", applied)
	}
	if err := s.Verify(ctx); err != nil {
		t.Fatalf("Verify after migrate: %v", err)
	}
	applied, err = s.Migrate(ctx)
	if err != nil || len(applied) != 0 {
		t.Fatalf("second Migrate applied %v, %v", applied, err)
	}
}

func TestVerifyNamesEveryMissingPiece(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db := appDB(t, path)
	exec1(t, db, `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_type TEXT NOT NULL, payload BLOB NOT NULL,
		status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0, available_at INTEGER NOT NULL DEFAULT 0,
		created_at INTEGER NOT NULL DEFAULT 0, processed_at INTEGER, last_error TEXT)`)
	s := openStore(t, path, false)
	err := s.Verify(context.Background())
	for _, want := range []string{"column event_queue.event_id", "column event_queue.claimed_at", "column event_queue.claimed_by",
		"index event_queue_event_id", "index event_queue_pending", "table processed_events", "table " + InstancesTable, "table " + ExhaustedTable} {
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
	db := appDB(t, path)
	exec1(t, db, legacyTable)
	exec1(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 5000)
		INSERT INTO event_queue (event_type, payload, status) SELECT 'Legacy', 'p' || i, CASE WHEN i % 2 = 0 THEN 'done' ELSE 'pending' END FROM n`)
	s := openStore(t, path, false)
	if _, err := s.Migrate(ctx); err != nil {
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
	if err := s.Verify(ctx); err != nil {
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
	exec1(t, appDB(t, path), `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, body TEXT)`)
	s := openStore(t, path, false)
	_, err := s.Migrate(context.Background())
	if err == nil || !strings.Contains(err.Error(), "lacks column(s) event_type, payload, status") {
		t.Fatalf("Migrate on a foreign table = %v", err)
	}
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
				s, err := Open(context.Background(), Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Create: true})
				if err != nil {
					errs[i] = err
					return
				}
				defer s.Close()
				_, errs[i] = s.Migrate(context.Background())
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
		cmd.Env = append(os.Environ(), "CLAIM_HELPER_MIGRATE="+path)
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
	path := os.Getenv("CLAIM_HELPER_MIGRATE")
	if path == "" {
		t.Skip("helper process only")
	}
	s, err := Open(context.Background(), Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Create: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func assertMigratedOnce(t *testing.T, path string) {
	t.Helper()
	s := openStore(t, path, false)
	got, err := s.AppliedMigrations(context.Background())
	if err != nil || fmt.Sprint(got) != "[101 102 103 104]" {
		t.Fatalf("migrations recorded %v, %v", got, err)
	}
	if err := s.Verify(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestMinimalInsertFromSQLiteShell runs the application's minimal insert
// from the system's sqlite3 shell (Debian 12 ships 3.40), so the column
// defaults must work on an older SQLite than the relay's.
func TestMinimalInsertFromSQLiteShell(t *testing.T) {
	shell, err := exec.LookPath("sqlite3")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("CI must install the sqlite3 shell")
		}
		t.Skip("no sqlite3 shell")
	}
	s := newStore(t)
	before := time.Now().UnixMilli()
	out, err := exec.Command(shell, s.Path(), `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('6f1c8f0e-5d7a-4b8e-9c1d-2a3b4c5d6e7f', 'ReviewLogged', '{"a":1}'); SELECT sqlite_version();`).CombinedOutput()
	if err != nil {
		t.Fatalf("sqlite3 shell: %v: %s", err, out)
	}
	t.Logf("sqlite3 shell version %s", strings.TrimSpace(string(out)))
	after := time.Now().UnixMilli()
	rows, err := s.Claim(context.Background(), 10, 0)
	if err != nil || len(rows) != 1 {
		t.Fatalf("claim after shell insert: %v %v", rows, err)
	}
	r := rows[0]
	if r.EventID != "6f1c8f0e-5d7a-4b8e-9c1d-2a3b4c5d6e7f" || r.EventType != "ReviewLogged" || string(r.Payload) != `{"a":1}` {
		t.Fatalf("row %+v", r)
	}
	if r.CreatedAt < before-1 || r.CreatedAt > after+1 {
		t.Fatalf("created_at default %d not within [%d, %d]", r.CreatedAt, before, after)
	}
}

// TestMinimalInsertOnOldSQLite runs the application's minimal insert through
// SQLite 3.30.1 (go-sqlite3 v1.13.0, built as its own module in
// test/sqlitecompat), older than the 3.31 the contract promises.
func TestMinimalInsertOnOldSQLite(t *testing.T) {
	if testing.Short() {
		t.Skip("builds an old go-sqlite3 (about a minute)")
	}
	bin := filepath.Join(t.TempDir(), "sqlitecompat")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = "../../test/sqlitecompat"
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the old-SQLite program: %v\n%s", err, out)
	}
	s := newStore(t)
	before := time.Now().UnixMilli()
	out, err := exec.Command(bin, "-db", s.Path()).Output()
	if err != nil {
		t.Fatalf("minimal insert on old SQLite: %v", err)
	}
	after := time.Now().UnixMilli()
	var res struct {
		Version           string `json:"sqlite_version"`
		Integrity, Status string
		ID, Attempts      int64
		AvailableAt       int64 `json:"available_at"`
		CreatedAt         int64 `json:"created_at"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("%s: %v", out, err)
	}
	if !strings.HasPrefix(res.Version, "3.30.") || res.Integrity != "ok" {
		t.Fatalf("ran on SQLite %q, integrity %q", res.Version, res.Integrity)
	}
	if res.Status != "pending" || res.Attempts != 0 || res.CreatedAt < before || res.CreatedAt > after || res.AvailableAt != res.CreatedAt {
		t.Fatalf("defaults evaluated by SQLite %s: %+v (now in [%d, %d])", res.Version, res, before, after)
	}
	rows, err := s.Claim(context.Background(), 10, 0)
	if err != nil || len(rows) != 1 || rows[0].EventType != "CompatChecked" {
		t.Fatalf("the relay cannot claim the old SQLite's row: %v %v", rows, err)
	}
}

func TestClaimDueRowsInOrder(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	db := appDB(t, s.Path())
	future := time.Now().Add(time.Hour).UnixMilli()
	exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (1, 'a', 'T', 'p1')`)
	exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, available_at) VALUES (2, 'b', 'T', 'p2', ?)`, future)
	exec1(t, db, `INSERT INTO event_queue (id, event_type, payload) VALUES (3, 'T', 'p3')`)
	exec1(t, db, `INSERT INTO event_queue (id, event_type, payload) VALUES (4, 'T', 'p4')`)
	exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status) VALUES (5, 'e', 'T', 'p5', 'done')`)
	exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (6, 'f', 'T', 'p6')`)

	rows, err := s.Claim(ctx, 3, 0)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for _, r := range rows {
		ids = append(ids, r.ID)
	}
	if fmt.Sprint(ids) != "[1 3 4]" {
		t.Fatalf("claimed %v, want [1 3 4] (2 is not due, 5 is done)", ids)
	}
	if rows[0].EventID != "a" || !uuidRe.MatchString(rows[1].EventID) || !uuidRe.MatchString(rows[2].EventID) || rows[1].EventID == rows[2].EventID {
		t.Fatalf("event ids %q %q %q", rows[0].EventID, rows[1].EventID, rows[2].EventID)
	}
	// The generated ids were written before the rows were returned; the
	// claim itself wrote nothing: the rows stay pending.
	var stored, status string
	var claimedAt sql.NullInt64
	db.QueryRow(`SELECT event_id, status, claimed_at FROM event_queue WHERE id = 3`).Scan(&stored, &status, &claimedAt)
	if stored != rows[1].EventID || status != "pending" || claimedAt.Valid {
		t.Fatalf("row 3 stored %q %q %v", stored, status, claimedAt)
	}
	rows, err = s.Claim(ctx, 10, 0)
	if err != nil || len(rows) != 1 || rows[0].ID != 6 {
		t.Fatalf("second claim %v %v, want row 6 only: 1, 3 and 4 are in flight", rows, err)
	}
}

// queryPlan returns EXPLAIN QUERY PLAN's details for q.
func queryPlan(t testing.TB, s *Store, q string, args ...any) string {
	t.Helper()
	rows, err := s.read.Query(`EXPLAIN QUERY PLAN `+q, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, unused int
		var detail string
		if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, detail)
	}
	return strings.Join(plan, "; ")
}

// TestClaimCostFollowsTheBatch: with many done rows (and statistics
// gathered), the claim walks the pending index in id order without a sort,
// and the reclaim walks the processing index: neither touches done rows.
func TestClaimCostFollowsTheBatch(t *testing.T) {
	s := newStore(t)
	db := appDB(t, s.Path())
	exec1(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
		INSERT INTO event_queue (event_id, event_type, payload, status, processed_at) SELECT 'done-' || i, 'T', 'x', 'done', 1 FROM n`)
	insertRows(t, db, 1000, "pending")
	exec1(t, db, `ANALYZE`)
	now := time.Now().UnixMilli()
	claimSub := regexp.MustCompile(`(?s)SELECT id, coalesce\(octet_length\(payload\), 0\) AS len FROM .*? LIMIT \?3`).FindString(s.q.takeAfter)
	plan := queryPlan(t, s, claimSub, 0, now, 100)
	if !strings.Contains(plan, "INDEX event_queue_pending") || strings.Contains(plan, "TEMP B-TREE") {
		t.Errorf("claim plan %q: want the pending index and no sort", plan)
	}
	plan = queryPlan(t, s, s.q.reclaim, now, "x", now)
	if !strings.Contains(plan, "USING INDEX event_queue_processing") || strings.Contains(plan, "SCAN event_queue\x00") {
		t.Errorf("reclaim plan %q: want the processing index", plan)
	}
	b, err := s.Backlog(context.Background())
	if err != nil || b.Pending != 1000 {
		t.Fatalf("backlog %+v %v", b, err)
	}
	plan = queryPlan(t, s, `SELECT count(*) FROM event_queue WHERE status = 'dead_lettered'`)
	if !strings.Contains(plan, "event_queue_dead_lettered") {
		t.Errorf("dead-letter count plan %q", plan)
	}
}

// benchStore is a store with a pool of pending 256-byte rows and, when
// done > 0, that many done rows before them.
func benchStore(b *testing.B, done, pending int) *Store {
	b.Helper()
	s := newStore(b)
	ctx := context.Background()
	if err := benchkit.Seed(ctx, s.write, s.table, done, 256, "done"); err != nil {
		b.Fatal(err)
	}
	if err := benchkit.Seed(ctx, s.write, s.table, pending, 256, "pending"); err != nil {
		b.Fatal(err)
	}
	return s
}

// BenchmarkClaim claims batches of 1000 rows (ns/op is per row), from a
// table with no done rows and from one with a million: the claim's cost
// must follow the batch, not the table.
func BenchmarkClaim(b *testing.B) {
	const batch = 1000
	for _, done := range []int{0, 1_000_000} {
		b.Run(fmt.Sprintf("done=%d", done), func(b *testing.B) {
			s := benchStore(b, done, 100*batch)
			ctx := context.Background()
			b.ResetTimer()
			for i := 0; i < b.N; i += batch {
				rows, err := s.Claim(ctx, batch, 0)
				if err != nil {
					b.Fatal(err)
				}
				if len(rows) < batch { // pool used up: put it back
					s.forget()
				}
			}
		})
	}
}

// BenchmarkClaimTrickle claims one row at a time, each just committed by
// the application's own connection (ns/op is per claim): the relay's cost
// at a trickle, where every claim finds the page caches stale.
func BenchmarkClaimTrickle(b *testing.B) {
	s := benchStore(b, 100_000, 0)
	app := appDB(b, s.Path())
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		exec1(b, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'Thing', randomblob(256))`, event.NewID())
		b.StartTimer()
		rows, err := s.Claim(ctx, 1000, 0)
		if err != nil || len(rows) != 1 {
			b.Fatal(len(rows), err)
		}
		b.StopTimer()
		if stale, err := s.Settle(ctx, []event.Outcome{{Row: rows[0], Settlement: event.Done}}); err != nil || len(stale) > 0 {
			b.Fatal(stale, err)
		}
		b.StartTimer()
	}
}

// BenchmarkSettle settles claimed batches of 1000 rows as done (ns/op is
// per row).
func BenchmarkSettle(b *testing.B) {
	const batch = 1000
	s := benchStore(b, 0, 100*batch)
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i += batch {
		b.StopTimer()
		rows, err := s.Claim(ctx, batch, 0)
		if err != nil {
			b.Fatal(err)
		}
		if len(rows) < batch {
			if _, err := s.write.Exec(`UPDATE event_queue SET status = 'pending', processed_at = NULL`); err != nil {
				b.Fatal(err)
			}
			s.forget()
			if rows, err = s.Claim(ctx, batch, 0); err != nil {
				b.Fatal(err)
			}
		}
		outs := make([]event.Outcome, len(rows))
		for j, r := range rows {
			outs[j] = event.Outcome{Row: r, Settlement: event.Done}
		}
		b.StartTimer()
		if stale, err := s.Settle(ctx, outs); err != nil || len(stale) > 0 {
			b.Fatal(stale, err)
		}
	}
}

func settleOne(t *testing.T, s *Store, o event.Outcome) int {
	t.Helper()
	stale, err := s.Settle(context.Background(), []event.Outcome{o})
	if err != nil {
		t.Fatal(err)
	}
	return len(stale)
}

type rowState struct {
	Status                 string
	Attempts               int
	AvailableAt            int64
	ClaimedAt, ProcessedAt sql.NullInt64
	LastError              sql.NullString
}

func state(t *testing.T, db *sql.DB, id int64) rowState {
	t.Helper()
	var r rowState
	if err := db.QueryRow(`SELECT status, attempts, available_at, claimed_at, processed_at, last_error FROM event_queue WHERE id = ?`, id).
		Scan(&r.Status, &r.Attempts, &r.AvailableAt, &r.ClaimedAt, &r.ProcessedAt, &r.LastError); err != nil {
		t.Fatal(err)
	}
	return r
}

func TestSettleOutcomes(t *testing.T) {
	ctx := context.Background()
	s, db, rows := claimed(t, 4)
	later := time.Now().Add(time.Minute)
	outs := []event.Outcome{
		{Row: rows[0], Settlement: event.Done},
		event.Reject(rows[1], "message too large", 10, time.Now()),
		event.Reject(rows[2], "still too large", 1, time.Now()),
		{Row: rows[3], Settlement: event.Release, AvailableAt: later},
	}
	stale, err := s.Settle(ctx, outs)
	if err != nil || len(stale) != 0 {
		t.Fatal(stale, err)
	}
	if r := state(t, db, rows[0].ID); r.Status != "done" || !r.ProcessedAt.Valid || r.ClaimedAt.Valid {
		t.Errorf("done row %+v", r)
	}
	if r := state(t, db, rows[1].ID); r.Status != "pending" || r.Attempts != 1 || r.LastError.String != "message too large" || r.AvailableAt != outs[1].AvailableAt.UnixMilli() {
		t.Errorf("retried row %+v", r)
	}
	if r := state(t, db, rows[2].ID); r.Status != "dead_lettered" || r.Attempts != 1 || r.LastError.String != "still too large" || !r.ProcessedAt.Valid {
		t.Errorf("dead-lettered row %+v", r)
	}
	if r := state(t, db, rows[3].ID); r.Status != "pending" || r.Attempts != 0 || r.AvailableAt != later.UnixMilli() || r.LastError.Valid {
		t.Errorf("released row %+v", r)
	}
}

// TestSettleIsFencedByTheLead: a leader that was paused and lost the lead
// writes nothing when it resumes; the new leader takes the rows from the
// table, where they are still pending.
func TestSettleIsFencedByTheLead(t *testing.T) {
	ctx := context.Background()
	a := newStore(t)
	b := openStore(t, a.Path(), false)
	db := appDB(t, a.Path())
	insertRows(t, db, 2, "pending")
	for _, s := range []*Store{a, b} {
		if _, err := s.Heartbeat(ctx, "test", time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // started_at orders the relays
	}
	if !a.Leads() || b.Leads() {
		t.Fatalf("a leads %v, b leads %v; want the first relay to lead", a.Leads(), b.Leads())
	}
	old, err := a.Claim(ctx, 2, 0)
	if err != nil || len(old) != 2 {
		t.Fatal(old, err)
	}
	// a is paused past the staleness window; b, beating on time, judges it
	// dead and leads.
	exec1(t, db, `UPDATE `+InstancesTable+` SET heartbeat_at = heartbeat_at - 120000 WHERE instance_id = ?`, a.Instance())
	b.beatingSince = time.Now().Add(-2 * time.Minute)
	if _, err := b.Heartbeat(ctx, "test", time.Hour, time.Minute); err != nil || !b.Leads() {
		t.Fatalf("b leads %v (%v) after a went silent", b.Leads(), err)
	}
	// a resumes, still believing it leads: its settle writes nothing.
	stale, err := a.Settle(ctx, []event.Outcome{{Row: old[0], Settlement: event.Done}, event.Reject(old[1], "refused", 5, time.Now())})
	if err != nil || fmt.Sprint(stale) != "[0 1]" {
		t.Fatalf("a paused leader settled: stale %v, %v; want [0 1]", stale, err)
	}
	for _, r := range old {
		if st := state(t, db, r.ID); st.Status != "pending" || st.Attempts != 0 {
			t.Fatalf("a paused leader wrote row %d: %+v", r.ID, st)
		}
	}
	fresh, err := b.Claim(ctx, 10, 0)
	if err != nil || len(fresh) != 2 {
		t.Fatal(fresh, err)
	}
	if n := settleOne(t, b, event.Outcome{Row: fresh[0], Settlement: event.Done}); n != 0 {
		t.Fatal("the leader could not settle")
	}
	if a.InFlight() != 0 || b.InFlight() != 1 {
		t.Fatalf("in flight: a %d, b %d; want 0 and 1", a.InFlight(), b.InFlight())
	}
}

// legacyClaim marks up to n pending rows processing for owner, as a
// claimer that writes its claims does (an older relay, or another
// implementation of the same design), and returns how many it took.
func legacyClaim(t *testing.T, db *sql.DB, owner string, n int) int64 {
	t.Helper()
	res, err := db.Exec(`UPDATE event_queue SET status = 'processing', claimed_at = ?, claimed_by = ?
WHERE id IN (SELECT id FROM event_queue WHERE status = 'pending' ORDER BY id LIMIT ?)`, time.Now().UnixMilli(), owner, n)
	if err != nil {
		t.Fatal(err)
	}
	k, _ := res.RowsAffected()
	return k
}

func TestHeartbeatReclaimsOnlyDeadOwners(t *testing.T) {
	ctx := context.Background()
	live := newStore(t)
	dead := openStore(t, live.Path(), false)
	other := openStore(t, live.Path(), false)
	db := appDB(t, live.Path())
	insertRows(t, db, 6, "pending")
	for _, s := range []*Store{live, dead} {
		if _, err := s.Heartbeat(ctx, "test", time.Hour, 5*time.Second); err != nil {
			t.Fatal(err)
		}
		if n := legacyClaim(t, db, s.Instance(), 3); n != 3 {
			t.Fatal(n)
		}
	}
	// Both owners are alive: nothing is taken before the lease.
	if n, err := other.Heartbeat(ctx, "test", time.Hour, 5*time.Second); err != nil || n != 0 {
		t.Fatalf("reclaimed %d (%v) while both owners are alive", n, err)
	}
	// dead stops heartbeating (kill -9): its claims come back at once, to a
	// relay that has been heartbeating on time for a staleness window.
	exec1(t, db, `UPDATE `+InstancesTable+` SET heartbeat_at = heartbeat_at - 60000 WHERE instance_id = ?`, dead.Instance())
	other.beatingSince = time.Now().Add(-time.Minute)
	n, err := other.Heartbeat(ctx, "test", time.Hour, 5*time.Second)
	if err != nil || n != 3 {
		t.Fatalf("reclaimed %d (%v), want the dead owner's 3", n, err)
	}
	var pending, liveHeld, instances int
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'pending'`).Scan(&pending)
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'processing' AND claimed_by = ?`, live.Instance()).Scan(&liveHeld)
	db.QueryRow(`SELECT count(*) FROM ` + InstancesTable).Scan(&instances)
	if pending != 3 || liveHeld != 3 || instances != 2 {
		t.Fatalf("pending %d, live holds %d, instances %d; want 3, 3, 2", pending, liveHeld, instances)
	}
	if err := live.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	db.QueryRow(`SELECT count(*) FROM ` + InstancesTable).Scan(&instances)
	if instances != 1 {
		t.Fatalf("%d instances after Leave", instances)
	}
}

// TestClaimsNeverRepeatRowsInFlight: claims in small batches return every
// pending row once while none is settled; rows released due at once (a
// shutdown's) are taken again, without a write.
func TestClaimsNeverRepeatRowsInFlight(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	insertRows(t, appDB(t, s.Path()), 2000, "pending")
	seen := map[int64]int{}
	var all []event.Row
	for {
		rows, err := s.Claim(ctx, 97, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) == 0 {
			break
		}
		for _, r := range rows {
			seen[r.ID]++
		}
		all = append(all, rows...)
	}
	if len(seen) != 2000 || len(all) != 2000 || s.InFlight() != 2000 {
		t.Fatalf("%d rows claimed (%d distinct, %d in flight), want 2000 once each", len(all), len(seen), s.InFlight())
	}
	outs := make([]event.Outcome, len(all))
	for i, r := range all {
		outs[i] = event.Outcome{Row: r, Settlement: event.Done}
		if i%2 == 1 {
			outs[i] = event.Outcome{Row: r, Settlement: event.Release, AvailableAt: time.Now()}
		}
	}
	if stale, err := s.Settle(ctx, outs); err != nil || len(stale) != 0 {
		t.Fatal(stale, err)
	}
	again, err := s.Claim(ctx, 5000, 0)
	if err != nil || len(again) != 1000 || again[0].ID != all[1].ID {
		t.Fatalf("after settling, claimed %d rows (%v), want the 1000 released ones", len(again), err)
	}
}

// TestRowIDReuseIsSeen: without AUTOINCREMENT, a new row gets the highest
// id plus one; once retention has deleted the highest rows, that id is at
// or below ids the relay has already taken. It is claimed at once, whether
// or not rows are in flight.
func TestRowIDReuseIsSeen(t *testing.T) {
	ctx := context.Background()
	path, db := legacyDB(t, 10) // INTEGER PRIMARY KEY without AUTOINCREMENT
	s := openStore(t, path, false)
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	rows, err := s.Claim(ctx, 10, 0)
	if err != nil || len(rows) != 10 {
		t.Fatal(rows, err)
	}
	// 6..10 are done and deleted; 1..5 stay in flight.
	outs := make([]event.Outcome, 0, 5)
	for _, r := range rows[5:] {
		outs = append(outs, event.Outcome{Row: r, Settlement: event.Done})
	}
	if stale, err := s.Settle(ctx, outs); err != nil || len(stale) != 0 {
		t.Fatal(stale, err)
	}
	exec1(t, db, `DELETE FROM event_queue WHERE status = 'done'`)
	exec1(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('reused-1', 'T', 'x', 0)`)
	got, err := s.Claim(ctx, 10, 0)
	if err != nil || len(got) != 1 || got[0].EventID != "reused-1" || got[0].ID != 6 {
		t.Fatalf("claimed %+v (%v), want the new row with the reused id 6", got, err)
	}
	// Nothing in flight: everything settled and deleted, ids start over.
	outs = outs[:0]
	for _, r := range append(rows[:5], got...) {
		outs = append(outs, event.Outcome{Row: r, Settlement: event.Done})
	}
	if stale, err := s.Settle(ctx, outs); err != nil || len(stale) != 0 {
		t.Fatal(stale, err)
	}
	exec1(t, db, `DELETE FROM event_queue`)
	exec1(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('reused-2', 'T', 'x', 0)`)
	got, err = s.Claim(ctx, 10, 0)
	if err != nil || len(got) != 1 || got[0].EventID != "reused-2" || got[0].ID != 1 {
		t.Fatalf("claimed %+v (%v), want the new row with the reused id 1", got, err)
	}
}

// TestDeferredRowsBelowInFlightAreClaimedWhenDue: while rows with higher
// ids are in flight, a row this relay retried comes back when it is due,
// and a row the application scheduled for later is found by the rescan.
func TestDeferredRowsBelowInFlightAreClaimedWhenDue(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	var offset atomic.Int64 // the due clock's lead over the wall clock
	clock := event.NewClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) })
	path := filepath.Join(t.TempDir(), "app.db")
	s, err := Open(ctx, Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Create: true, Clock: clock, Rescan: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db := appDB(t, path)
	later := now.Add(time.Minute).UnixMilli()
	exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (1, 'retried', 'T', 'x'), (2, 'held', 'T', 'x')`)
	exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, available_at) VALUES (3, 'scheduled', 'T', 'x', ?)`, later)
	exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (4, 'held-too', 'T', 'x')`)
	rows, err := s.Claim(ctx, 10, 0)
	if err != nil || len(rows) != 3 {
		t.Fatal(rows, err)
	}
	// Row 1 is refused and retried in 5 s; 2 and 4 stay in flight.
	if n := settleOne(t, s, event.Reject(rows[0], "refused", 5, clock.Now())); n != 0 {
		t.Fatal("stale retry")
	}
	if got, err := s.Claim(ctx, 10, 0); err != nil || len(got) != 0 {
		t.Fatalf("claimed %v (%v) before anything was due", got, err)
	}
	offset.Store(int64(10 * time.Second))
	got, err := s.Claim(ctx, 10, 0)
	if err != nil || len(got) != 1 || got[0].EventID != "retried" {
		t.Fatalf("claimed %+v (%v), want the retried row once due", got, err)
	}
	offset.Store(int64(2 * time.Minute))
	if got, err := s.Claim(ctx, 10, 0); err != nil || len(got) != 0 {
		t.Fatalf("claimed %v (%v): the scheduled row waits for the rescan", got, err)
	}
	s.Rescan()
	got, err = s.Claim(ctx, 10, 0)
	if err != nil || len(got) != 1 || got[0].EventID != "scheduled" {
		t.Fatalf("claimed %+v (%v), want the scheduled row at the rescan", got, err)
	}
}

// startWatch runs Watch with an hour-long fallback poll (only the file
// notification can wake it) and returns once it has seen a commit of db:
// from then on it is watching, whatever the scheduler did.
func startWatch(t *testing.T, s *Store, db *sql.DB) (wake chan struct{}, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	wake = make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() { done <- s.Watch(ctx, time.Hour, wake) }()
	deadline := time.Now().Add(10 * time.Second)
	for woke := false; !woke; {
		if time.Now().After(deadline) {
			t.Fatal("the watch never woke for a commit")
		}
		insertRows(t, db, 1, "pending")
		select {
		case <-wake:
			woke = true
		case <-time.After(50 * time.Millisecond):
		}
	}
	return wake, func() {
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

func TestWatchSeesForeignCommits(t *testing.T) {
	s := newStore(t)
	db := appDB(t, s.Path())
	wake, stop := startWatch(t, s, db)
	defer stop()
	select {
	case <-wake:
		t.Fatal("woke without a commit")
	case <-time.After(200 * time.Millisecond):
	}
	insertRows(t, db, 1, "pending")
	select {
	case <-wake:
	case <-time.After(10 * time.Second):
		t.Fatal("no wake-up after a commit")
	}
}

func TestBacklog(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	db := appDB(t, s.Path())
	insertRows(t, db, 3, "done")
	exec1(t, db, `INSERT INTO event_queue (event_type, payload, created_at) VALUES ('T', 'x', 1000)`)
	insertRows(t, db, 4, "pending")
	insertRows(t, db, 2, "dead_lettered")
	if n := legacyClaim(t, db, "an-older-relay", 2); n != 2 {
		t.Fatal(n)
	}
	b, err := s.Backlog(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if b.Pending != 3 || b.Processing != 2 || b.DeadLettered != 2 {
		t.Fatalf("backlog %+v", b)
	}
	// The oldest pending row is the 4th inserted (the first two pending were claimed).
	var want int64
	db.QueryRow(`SELECT created_at FROM event_queue WHERE status = 'pending' ORDER BY id LIMIT 1`).Scan(&want)
	if b.OldestPending.UnixMilli() != want {
		t.Fatalf("oldest pending %v, want %d", b.OldestPending, want)
	}
}

// TestPruneLeavesTheApplicationAlone deletes 100,000 old done rows while an
// application writes; pruning completes, keeps everything else, and the
// writer's commits go on between the prune's short transactions (its
// longest wait is logged; a test does not judge timing).
func TestPruneLeavesTheApplicationAlone(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	db := appDB(t, s.Path())
	old := time.Now().Add(-8 * 24 * time.Hour).UnixMilli()
	exec1(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'old-' || i, 'T', 'x', 'done', ?1, ?1 FROM n`, old)
	exec1(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at, last_error) VALUES ('old-dead', 'T', 'x', 'dead_lettered', ?1, ?1, 'kept')`, old)
	exec1(t, db, `INSERT INTO event_queue (event_id, event_type, payload, created_at) VALUES ('old-pending', 'T', 'x', ?1)`, old)
	insertRows(t, db, 100, "done") // recent
	ledgerOld := time.Now().Add(-31 * 24 * time.Hour).UnixMilli()
	exec1(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES ('a', 'h', 'done', ?1, ?1), ('b', 'h', 'in_progress', ?1, NULL), ('c', 'h', 'done', ?2, ?2), ('d', 'h', 'done', ?3, ?3)`,
		ledgerOld, time.Now().UnixMilli(), old)

	stop := make(chan struct{})
	waits := make(chan time.Duration, 1)
	var commits atomic.Int64
	writer := appDB(t, s.Path())
	go func() {
		var worst time.Duration
		for {
			select {
			case <-stop:
				waits <- worst
				return
			default:
			}
			start := time.Now()
			tx, err := writer.Begin() // BEGIN IMMEDIATE: waits for the lock
			if err != nil {
				t.Error(err)
				waits <- worst
				return
			}
			worst = max(worst, time.Since(start))
			tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'App', 'x')`, event.NewID())
			if tx.Commit() == nil {
				commits.Add(1)
			}
			time.Sleep(time.Millisecond)
		}
	}()
	before := time.Now().Add(-7 * 24 * time.Hour)
	n, err := s.Prune(ctx, event.PruneOutbox, before, 20*time.Millisecond)
	during := commits.Load()
	close(stop)
	worst := <-waits
	if err != nil || n != 100000 {
		t.Fatalf("pruned %d, %v; want 100000", n, err)
	}
	var left, kept int
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id LIKE 'old-%'`).Scan(&left)
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id IN ('old-dead', 'old-pending')`).Scan(&kept)
	if left != 2 || kept != 2 {
		t.Fatalf("%d old rows left (want the dead letter and the pending row)", left)
	}
	t.Logf("writer's longest wait for the lock while pruning: %v; %d commits meanwhile", worst, during)
	// One long transaction would have let the writer in once, at its end.
	if during < 5 {
		t.Errorf("the application committed %d times while pruning; the prune held the lock throughout", during)
	}
	n, err = s.Prune(ctx, event.PruneProcessedEvents, time.Now().Add(-30*24*time.Hour), time.Millisecond)
	if err != nil || n != 2 {
		t.Fatalf("pruned %d ledger rows, %v; want the old done one and the abandoned claim", n, err)
	}
	// Nothing is old any more: a second pass deletes nothing and stops early.
	if n, err := s.Prune(ctx, event.PruneOutbox, before, time.Millisecond); err != nil || n != 0 {
		t.Fatalf("second prune %d, %v", n, err)
	}
}

// TestHeldUpHeartbeatJudgesNobody: when the application held the write lock
// longer than the staleness limit, every relay's heartbeat waited; the first
// one through must not take the others for dead.
func TestHeldUpHeartbeatJudgesNobody(t *testing.T) {
	ctx := context.Background()
	a := newStore(t)
	b := openStore(t, a.Path(), false)
	db := appDB(t, a.Path())
	insertRows(t, db, 5, "pending")
	const stale = 1500 * time.Millisecond
	for _, s := range []*Store{a, b} {
		if _, err := s.Heartbeat(ctx, "t", time.Hour, stale); err != nil {
			t.Fatal(err)
		}
	}
	if n := legacyClaim(t, db, b.Instance(), 5); n != 5 {
		t.Fatal(n)
	}
	tx, err := db.Begin() // the application's long transaction
	if err != nil {
		t.Fatal(err)
	}
	tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES ('long', 'T', 'x')`)
	time.AfterFunc(2*time.Second, func() { tx.Commit() })
	n, err := a.Heartbeat(ctx, "t", time.Hour, stale) // waits 2 s for the lock
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("a held-up heartbeat reclaimed %d rows of a relay that was only held up too", n)
	}
	// b really is dead now: the next, timely heartbeats take its rows.
	time.Sleep(stale)
	if _, err := a.Heartbeat(ctx, "t", time.Hour, stale); err != nil {
		t.Fatal(err)
	}
	var reclaimed int64
	step := func() bool {
		n, err := a.Heartbeat(ctx, "t", time.Hour, stale)
		if err != nil {
			t.Fatal(err)
		}
		reclaimed += n
		return reclaimed == 5
	}
	deadline := time.Now().Add(10 * time.Second)
	for !step() {
		if time.Now().After(deadline) {
			t.Fatalf("dead relay's rows not reclaimed (%d)", reclaimed)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestSettleInPartsAndLostRows: settling part of a claim, or a claim some
// of whose rows someone else took meanwhile (a claimer that writes its
// claims, an operator), changes exactly the rows presented that are still
// pending, and reports the others stale.
func TestSettleInPartsAndLostRows(t *testing.T) {
	ctx := context.Background()
	s, db, rows := claimed(t, 5)
	exec1(t, db, `UPDATE event_queue SET status = 'processing', claimed_by = 'other' WHERE id = ?`, rows[0].ID)
	exec1(t, db, `UPDATE event_queue SET status = 'done' WHERE id = ?`, rows[3].ID)
	stale, err := s.Settle(ctx, []event.Outcome{{Row: rows[0], Settlement: event.Done}, {Row: rows[1], Settlement: event.Done}})
	if err != nil || fmt.Sprint(stale) != "[0]" {
		t.Fatalf("stale %v, %v; want [0]", stale, err)
	}
	want := map[int64]string{rows[0].ID: "processing", rows[1].ID: "done", rows[2].ID: "pending", rows[4].ID: "pending"}
	for id, st := range want {
		if got := state(t, db, id).Status; got != st {
			t.Errorf("row %d is %s, want %s", id, got, st)
		}
	}
	outs := []event.Outcome{event.Reject(rows[3], "late", 5, time.Now()), event.Reject(rows[2], "refused", 5, time.Now()), {Row: rows[4], Settlement: event.Done}}
	stale, err = s.Settle(ctx, outs)
	if err != nil || fmt.Sprint(stale) != "[0]" {
		t.Fatalf("stale %v, %v; want [0]", stale, err)
	}
	if st := state(t, db, rows[3].ID); st.Status != "done" || st.Attempts != 0 {
		t.Errorf("a row done elsewhere was retried: %+v", st)
	}
	if st := state(t, db, rows[2].ID); st.Status != "pending" || st.Attempts != 1 {
		t.Errorf("retried row %+v", st)
	}
	if s.InFlight() != 0 {
		t.Errorf("%d rows still in flight", s.InFlight())
	}
}

// TestPruneFindsRowsOutOfOrder: rows finished out of insertion order (a
// requeued dead letter done yesterday before rows done nine days ago) and
// legacy done rows without processed_at are pruned all the same.
func TestPruneFindsRowsOutOfOrder(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	db := appDB(t, s.Path())
	day := 24 * time.Hour
	yesterday, nineDays := time.Now().Add(-day).UnixMilli(), time.Now().Add(-9*day).UnixMilli()
	exec1(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 600)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'recent-' || i, 'T', 'x', 'done', ?1, ?2 FROM n`, nineDays, yesterday)
	exec1(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'old-' || i, 'T', 'x', 'done', ?1, ?1 FROM n`, nineDays)
	exec1(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 50)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'legacy-' || i, 'T', 'x', 'done', ?1, NULL FROM n`, nineDays)
	var total int64
	for i := 0; i < 3; i++ { // a few sweeps, as the relay makes one a minute
		n, err := s.Prune(ctx, event.PruneOutbox, time.Now().Add(-7*day), time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		total += n
	}
	var left, recent int
	db.QueryRow(`SELECT count(*) FROM event_queue`).Scan(&left)
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_id LIKE 'recent-%'`).Scan(&recent)
	if total != 1050 || left != 600 || recent != 600 {
		t.Fatalf("pruned %d, left %d (%d recent); want 1050 pruned and the 600 recent rows kept", total, left, recent)
	}
}

// TestJudgeOnlyAfterBeatingOnTime: a relay that has just started (or just
// got the lock back) does not take another for dead until it has itself
// been heartbeating on time for a staleness window.
func TestJudgeOnlyAfterBeatingOnTime(t *testing.T) {
	ctx := context.Background()
	const stale = 600 * time.Millisecond
	dead := newStore(t)
	db := appDB(t, dead.Path())
	insertRows(t, db, 2, "pending")
	if _, err := dead.Heartbeat(ctx, "t", time.Hour, stale); err != nil {
		t.Fatal(err)
	}
	if n := legacyClaim(t, db, dead.Instance(), 2); n != 2 {
		t.Fatal(n)
	}
	exec1(t, db, `UPDATE `+InstancesTable+` SET heartbeat_at = heartbeat_at - 60000`)
	judge := openStore(t, dead.Path(), false)
	start := time.Now() // before the first heartbeat, which starts the judge's clock
	if n, err := judge.Heartbeat(ctx, "t", time.Hour, stale); err != nil || n != 0 {
		t.Fatalf("a relay's first heartbeat reclaimed %d (%v)", n, err)
	}
	var n int64
	for n == 0 && time.Since(start) < 5*time.Second {
		time.Sleep(50 * time.Millisecond)
		k, err := judge.Heartbeat(ctx, "t", time.Hour, stale)
		if err != nil {
			t.Fatal(err)
		}
		n = k
	}
	if n != 2 || time.Since(start) < stale {
		t.Fatalf("reclaimed %d after %v; want 2, not before %v", n, time.Since(start), stale)
	}
}

// TestWatchPace: the fallback poll slows once notifications announce
// commits, and speeds up again when the poll finds one they missed.
func TestWatchPace(t *testing.T) {
	p := pace{fast: 100 * time.Millisecond}
	steps := []struct {
		notified, polled bool
		next             time.Duration
		change           bool
	}{
		{polled: true}, // untrusted: the poll finding commits changes nothing
		{notified: true, next: time.Second, change: true}, // a notification announced one: trust, slow down
		{notified: true}, // still trusted
		{polled: true, next: 100 * time.Millisecond, change: true}, // one was missed: fast again
		{polled: true},
		{}, // an overflow: no source, no change
		{notified: true, next: time.Second, change: true},
	}
	for i, st := range steps {
		next, change := p.found(st.notified, st.polled)
		if next != st.next || change != st.change {
			t.Fatalf("step %d: got (%v, %v), want (%v, %v)", i, next, change, st.next, st.change)
		}
	}
}

// TestCheckpointSkipsAnUnchangedWAL: a checkpoint copies the WAL into the
// database; the next one, with nothing committed since, does no work; a
// commit makes the one after it run again.
func TestCheckpointSkipsAnUnchangedWAL(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	db := appDB(t, s.Path())
	db.SetMaxOpenConns(1)
	exec1(t, db, `PRAGMA wal_autocheckpoint = 0`) // only the store checkpoints
	insertRows(t, db, 50, "pending")
	pages, done, err := s.Checkpoint(ctx)
	if err != nil || pages == 0 || done != pages {
		t.Fatalf("checkpoint: %d of %d pages (%v)", done, pages, err)
	}
	ran := s.ckptWal.at
	if p, d, err := s.Checkpoint(ctx); err != nil || p != pages || d != done || !s.ckptWal.at.Equal(ran) {
		t.Fatalf("an unchanged WAL was checkpointed again (%d of %d, %v)", d, p, err)
	}
	time.Sleep(20 * time.Millisecond) // past the file system's coarse clock tick
	insertRows(t, db, 50, "pending")
	if _, d, err := s.Checkpoint(ctx); err != nil || s.ckptWal.at.Equal(ran) || d == 0 {
		t.Fatalf("a commit after the checkpoint was not checkpointed (%d pages, %v)", d, err)
	}
}

// TestNoWritesToAReplacedFile: once another file is renamed over the
// database, every write and checkpoint is refused with
// event.ErrDatabaseReplaced, and Ping says so.
func TestNoWritesToAReplacedFile(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	if _, err := s.Heartbeat(ctx, "test", time.Minute, 6*time.Second); err != nil {
		t.Fatal(err)
	}
	insertRows(t, appDB(t, s.Path()), 3, "pending") // due: a claim gets to its write
	other := s.Path() + ".other"
	if err := os.WriteFile(other, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other, s.Path()); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Heartbeat(ctx, "test", time.Minute, 6*time.Second); !errors.Is(err, event.ErrDatabaseReplaced) {
		t.Errorf("heartbeat on a replaced file: %v", err)
	}
	if _, err := s.Claim(ctx, 10, 0); !errors.Is(err, event.ErrDatabaseReplaced) {
		t.Errorf("claim on a replaced file: %v", err)
	}
	if _, _, err := s.Checkpoint(ctx); !errors.Is(err, event.ErrDatabaseReplaced) {
		t.Errorf("checkpoint on a replaced file: %v", err)
	}
	if err := s.Ping(ctx); !errors.Is(err, event.ErrDatabaseReplaced) || !strings.Contains(err.Error(), s.Path()) {
		t.Errorf("ping on a replaced file: %v", err)
	}
}

// TestWatchSeesSynchronousFullCommits: an application with
// synchronous=FULL syncs the WAL before its commit becomes visible, so the
// file notification comes before the commit can be seen; the watch must
// look again rather than wait for its (here hour-long) poll.
func TestWatchSeesSynchronousFullCommits(t *testing.T) {
	s := newStore(t)
	db, err := sql.Open("sqlite3", "file:"+s.Path()+"?_busy_timeout=5000&_txlock=immediate&_synchronous=FULL")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	wake, stop := startWatch(t, s, db)
	defer stop()
	for i := range 20 {
		insertRows(t, db, 1, "pending")
		select {
		case <-wake:
		case <-time.After(5 * time.Second):
			t.Fatalf("commit %d: no wake-up", i)
		}
	}
}

// forget drops the rows in flight without settling them (benchmarks put
// their pool back this way).
func (s *Store) forget() {
	s.mu.Lock()
	s.held = held{ids: map[int64]struct{}{}}
	s.mu.Unlock()
}
