package claim

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/lead"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

var uuidRe = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// newStore returns a Store on a new migrated database.
func newStore(t testing.TB) *Store {
	t.Helper()
	return New(testenv.MigratedDB(t), Options{})
}

// openStore returns a Store on the database at path: another relay's.
func openStore(t testing.TB, path string) *Store {
	t.Helper()
	return New(testenv.OpenDB(t, path), Options{})
}

// claimed opens a fresh store whose application inserts n pending rows,
// and claims them all.
func claimed(t *testing.T, n int) (*Store, *sql.DB, []event.Row) {
	t.Helper()
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	testenv.InsertRows(t, db, n, "pending")
	rows, err := s.Claim(context.Background(), n, 0)
	if err != nil || len(rows) != n {
		t.Fatal(rows, err)
	}
	return s, db, rows
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
	out, err := exec.Command(shell, s.db.Path(), `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('6f1c8f0e-5d7a-4b8e-9c1d-2a3b4c5d6e7f', 'ReviewLogged', '{"a":1}'); SELECT sqlite_version();`).CombinedOutput()
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
	out, err := exec.Command(bin, "-db", s.db.Path()).Output()
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
	db := testenv.AppDB(t, s.db.Path())
	future := time.Now().Add(time.Hour).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (1, 'a', 'T', 'p1')`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, available_at) VALUES (2, 'b', 'T', 'p2', ?)`, future)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_type, payload) VALUES (3, 'T', 'p3')`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_type, payload) VALUES (4, 'T', 'p4')`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status) VALUES (5, 'e', 'T', 'p5', 'done')`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (6, 'f', 'T', 'p6')`)

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

// TestReadRowsKeepsEachRowsPayload holds go-sqlite3 to what readRows
// relies on to read each payload without copying it again: every row's
// BLOB comes in memory of its own, which later rows and later claims do
// not write over.
func TestReadRowsKeepsEachRowsPayload(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	payload := func(i int) []byte { return bytes.Repeat([]byte{byte('a' + i%26)}, 1+i*997%70000) }
	const n = 40
	for i := range 2 * n {
		testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'T', ?)`, fmt.Sprint("id-", i), payload(i))
	}
	ctx := context.Background()
	first, err := s.Claim(ctx, n, 0)
	if err != nil || len(first) != n {
		t.Fatal(len(first), err)
	}
	second, err := s.Claim(ctx, n, 0)
	if err != nil || len(second) != n {
		t.Fatal(len(second), err)
	}
	for i, r := range append(first, second...) {
		if !bytes.Equal(r.Payload, payload(i)) {
			t.Fatalf("row %d: payload of %d bytes starting %q, want %d bytes of %q", r.ID, len(r.Payload), r.Payload[:min(len(r.Payload), 4)], len(payload(i)), payload(i)[:1])
		}
	}
}

// TestClaimCostFollowsTheBatch: with many done rows (and statistics
// gathered), the claim walks the pending index in id order without a sort,
// and the reclaim walks the processing index: neither touches done rows.
func TestClaimCostFollowsTheBatch(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
		INSERT INTO event_queue (event_id, event_type, payload, status, processed_at) SELECT 'done-' || i, 'T', 'x', 'done', 1 FROM n`)
	testenv.InsertRows(t, db, 1000, "pending")
	testenv.MustExec(t, db, `ANALYZE`)
	now := time.Now().UnixMilli()
	claimSub := regexp.MustCompile(`(?s)SELECT id, coalesce\(octet_length\(payload\), 0\) AS len FROM .*? LIMIT \+\?3`).FindString(s.q.takeAfter)
	plan := testenv.QueryPlan(t, s.db, claimSub, 0, now, 100, 0, "[]", "", 0, 0)
	if !strings.Contains(plan, "INDEX event_queue_pending") || strings.Contains(plan, "TEMP B-TREE") {
		t.Errorf("claim plan %q: want the pending index and no sort", plan)
	}
	// The row of a row's ordering key before it: one seek of the ordering
	// index, which holds no done rows.
	plan = testenv.QueryPlan(t, s.db, s.q.takeAfter, 0, now, 100, 1<<20, "[]", "", 0, 0)
	if !strings.Contains(plan, "SEARCH e USING COVERING INDEX event_queue_ordering (ordering_key=? AND id<?)") {
		t.Errorf("claim plan %q: want the ordering index for the row before", plan)
	}
	// Marking rows done seeks each by its id (by the rowid, or in the
	// pending index, which leads with id and holds only pending rows).
	// So does deleting them (retention.done_rows: delete), and reading
	// them for their records.
	del := newQueries("event_queue", true)
	for _, q := range append(append(s.q.done, del.done...), del.doneRecord) {
		plan = testenv.QueryPlan(t, s.db, q, "[[1,5],[2,6]]", now)
		byID := strings.Contains(plan, "SEARCH event_queue USING INTEGER PRIMARY KEY (rowid=?)") || strings.Contains(plan, "SEARCH event_queue USING COVERING INDEX event_queue_pending (id=?)") || strings.Contains(plan, "SEARCH event_queue USING INDEX event_queue_pending (id=?)")
		if !byID || regexp.MustCompile(`SCAN event_queue($|;)`).MatchString(plan) {
			t.Errorf("done plan %q: want each row sought by its id", plan)
		}
	}
	b, err := housekeeping.Backlog(context.Background(), s.db, true)
	if err != nil || b.Pending != 1000 {
		t.Fatalf("backlog %+v %v", b, err)
	}
	plan = testenv.QueryPlan(t, s.db, `SELECT count(*) FROM event_queue WHERE status = 'dead_lettered'`)
	if !strings.Contains(plan, "event_queue_dead_lettered") {
		t.Errorf("dead-letter count plan %q", plan)
	}
}

// TestNoQueryRecompilesAtEveryBind: SQLite (3.54) compiles a statement
// with a bare parameter in LIMIT again every time a value is bound to it,
// so the statement cache cannot save the claim's parse and plan, which
// every commit pays for (BenchmarkClaimTrickle: 212 against 52 µs a claim).
// A unary plus keeps the value from the planner.
func TestNoQueryRecompilesAtEveryBind(t *testing.T) {
	bare := regexp.MustCompile(`(?i)\bLIMIT\s+[?:@$]`)
	for _, deleteDone := range []bool{false, true} {
		q := reflect.ValueOf(newQueries("event_queue", deleteDone))
		for i := range q.NumField() {
			f := q.Field(i)
			texts := []string{}
			if f.Kind() == reflect.String {
				texts = append(texts, f.String())
			} else {
				for j := range f.Len() {
					texts = append(texts, f.Index(j).String())
				}
			}
			for _, text := range texts {
				if bare.MatchString(text) {
					t.Errorf("query %s has a bare parameter in LIMIT (write +?N): %s", q.Type().Field(i).Name, text)
				}
			}
		}
	}
}

// benchStore is a store with a pool of pending 256-byte rows and, when
// done > 0, that many done rows before them.
func benchStore(b *testing.B, done, pending int) *Store {
	b.Helper()
	s := newStore(b)
	ctx := context.Background()
	app := testenv.AppDB(b, s.db.Path())
	if err := benchkit.Seed(ctx, app, "event_queue", done, 256, "done"); err != nil {
		b.Fatal(err)
	}
	if err := benchkit.Seed(ctx, app, "event_queue", pending, 256, "pending"); err != nil {
		b.Fatal(err)
	}
	// Fenced by the lead, as the daemon's store is.
	l := lead.New(s.db)
	if _, err := l.Heartbeat(ctx, "bench", 0, time.Hour, time.Minute); err != nil {
		b.Fatal(err)
	}
	s.fence = l
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
	app := testenv.AppDB(b, s.db.Path())
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		testenv.MustExec(b, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'Thing', randomblob(256))`, event.NewID())
		b.StartTimer()
		rows, err := s.Claim(ctx, 1000, 0)
		if err != nil || len(rows) != 1 {
			b.Fatal(len(rows), err)
		}
		b.StopTimer()
		if stale, err := s.Settle(ctx, []event.Outcome{{Row: rows[0], Settlement: event.Done}}, 0); err != nil || len(stale) > 0 {
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
			if _, err := s.db.Exec(ctx, `UPDATE event_queue SET status = 'pending', processed_at = NULL`); err != nil {
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
		if stale, err := s.Settle(ctx, outs, 0); err != nil || len(stale) > 0 {
			b.Fatal(stale, err)
		}
	}
}

func settleOne(t *testing.T, s *Store, o event.Outcome) int {
	t.Helper()
	stale, err := s.Settle(context.Background(), []event.Outcome{o}, 0)
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
	stale, err := s.Settle(ctx, outs, 0)
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
	dba := testenv.MigratedDB(t)
	dbb := testenv.OpenDB(t, dba.Path())
	la, lb := lead.New(dba), lead.New(dbb)
	a, b := New(dba, Options{Fence: la}), New(dbb, Options{Fence: lb})
	db := testenv.AppDB(t, a.db.Path())
	testenv.InsertRows(t, db, 2, "pending")
	for _, l := range []*lead.Lease{la, lb} {
		if _, err := l.Heartbeat(ctx, "test", 0, time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // started_at orders the relays
	}
	if !la.Leads() || lb.Leads() {
		t.Fatalf("a leads %v, b leads %v; want the first relay to lead", la.Leads(), lb.Leads())
	}
	old, err := a.Claim(ctx, 2, 0)
	if err != nil || len(old) != 2 {
		t.Fatal(old, err)
	}
	// a is paused past the staleness window; b judges it dead (removing
	// its heartbeat row) and leads.
	testenv.MustExec(t, db, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = ?`, la.Instance())
	if _, err := lb.Heartbeat(ctx, "test", 0, time.Hour, time.Minute); err != nil || !lb.Leads() {
		t.Fatalf("b leads %v (%v) after a went silent", lb.Leads(), err)
	}
	// a resumes, still believing it leads: its settle writes nothing.
	stale, err := a.Settle(ctx, []event.Outcome{{Row: old[0], Settlement: event.Done}, event.Reject(old[1], "refused", 5, time.Now())}, 0)
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
	if inFlight(a) != 0 || inFlight(b) != 1 {
		t.Fatalf("in flight: a %d, b %d; want 0 and 1", inFlight(a), inFlight(b))
	}
}

// TestClaimsNeverRepeatRowsInFlight: claims in small batches return every
// pending row once while none is settled; rows released due at once (a
// shutdown's) are taken again, without a write.
func TestClaimsNeverRepeatRowsInFlight(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	testenv.InsertRows(t, testenv.AppDB(t, s.db.Path()), 2000, "pending")
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
	if len(seen) != 2000 || len(all) != 2000 || inFlight(s) != 2000 {
		t.Fatalf("%d rows claimed (%d distinct, %d in flight), want 2000 once each", len(all), len(seen), inFlight(s))
	}
	outs := make([]event.Outcome, len(all))
	for i, r := range all {
		outs[i] = event.Outcome{Row: r, Settlement: event.Done}
		if i%2 == 1 {
			outs[i] = event.Outcome{Row: r, Settlement: event.Release, AvailableAt: time.Now()}
		}
	}
	if stale, err := s.Settle(ctx, outs, 0); err != nil || len(stale) != 0 {
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
	path, db := testenv.LegacyDB(t, 10) // INTEGER PRIMARY KEY without AUTOINCREMENT
	s := openStore(t, path)
	if _, err := schema.Migrate(ctx, s.db); err != nil {
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
	if stale, err := s.Settle(ctx, outs, 0); err != nil || len(stale) != 0 {
		t.Fatal(stale, err)
	}
	testenv.MustExec(t, db, `DELETE FROM event_queue WHERE status = 'done'`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('reused-1', 'T', 'x', 0)`)
	got, err := s.Claim(ctx, 10, 0)
	if err != nil || len(got) != 1 || got[0].EventID != "reused-1" || got[0].ID != 6 {
		t.Fatalf("claimed %+v (%v), want the new row with the reused id 6", got, err)
	}
	// Nothing in flight: everything settled and deleted, ids start over.
	outs = outs[:0]
	for _, r := range append(rows[:5], got...) {
		outs = append(outs, event.Outcome{Row: r, Settlement: event.Done})
	}
	if stale, err := s.Settle(ctx, outs, 0); err != nil || len(stale) != 0 {
		t.Fatal(stale, err)
	}
	testenv.MustExec(t, db, `DELETE FROM event_queue`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('reused-2', 'T', 'x', 0)`)
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
	path := testenv.NewDB(t)
	d, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	s := New(d, Options{Rescan: time.Hour})
	db := testenv.AppDB(t, path)
	later := now.Add(time.Minute).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (1, 'retried', 'T', 'x'), (2, 'held', 'T', 'x')`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, available_at) VALUES (3, 'scheduled', 'T', 'x', ?)`, later)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (4, 'held-too', 'T', 'x')`)
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

// TestSettleInPartsAndLostRows: settling part of a claim, or a claim some
// of whose rows someone else took meanwhile (a claimer that writes its
// claims, an operator), changes exactly the rows presented that are still
// pending, and reports the others stale.
func TestSettleInPartsAndLostRows(t *testing.T) {
	ctx := context.Background()
	s, db, rows := claimed(t, 5)
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'processing', claimed_by = 'other' WHERE id = ?`, rows[0].ID)
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'done' WHERE id = ?`, rows[3].ID)
	stale, err := s.Settle(ctx, []event.Outcome{{Row: rows[0], Settlement: event.Done}, {Row: rows[1], Settlement: event.Done}}, 0)
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
	stale, err = s.Settle(ctx, outs, 0)
	if err != nil || fmt.Sprint(stale) != "[0]" {
		t.Fatalf("stale %v, %v; want [0]", stale, err)
	}
	if st := state(t, db, rows[3].ID); st.Status != "done" || st.Attempts != 0 {
		t.Errorf("a row done elsewhere was retried: %+v", st)
	}
	if st := state(t, db, rows[2].ID); st.Status != "pending" || st.Attempts != 1 {
		t.Errorf("retried row %+v", st)
	}
	if inFlight(s) != 0 {
		t.Errorf("%d rows still in flight", inFlight(s))
	}
}

// TestNoWritesToAReplacedFile: once another file is renamed over the
// database, every write and checkpoint is refused with
// event.ErrDatabaseReplaced, and Ping says so.
func TestNoWritesToAReplacedFile(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	l := lead.New(s.db)
	if _, err := l.Heartbeat(ctx, "test", 0, time.Minute, 6*time.Second); err != nil {
		t.Fatal(err)
	}
	testenv.InsertRows(t, testenv.AppDB(t, s.db.Path()), 3, "pending") // due: a claim gets to its write
	other := s.db.Path() + ".other"
	if err := os.WriteFile(other, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other, s.db.Path()); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Heartbeat(ctx, "test", 0, time.Minute, 6*time.Second); !errors.Is(err, event.ErrDatabaseReplaced) {
		t.Errorf("heartbeat on a replaced file: %v", err)
	}
	if _, err := s.Claim(ctx, 10, 0); !errors.Is(err, event.ErrDatabaseReplaced) {
		t.Errorf("claim on a replaced file: %v", err)
	}
	if _, _, err := s.db.Checkpoint(ctx); !errors.Is(err, event.ErrDatabaseReplaced) {
		t.Errorf("checkpoint on a replaced file: %v", err)
	}
	if err := s.db.Ping(ctx); !errors.Is(err, event.ErrDatabaseReplaced) || !strings.Contains(err.Error(), s.db.Path()) {
		t.Errorf("ping on a replaced file: %v", err)
	}
}

// inFlight returns how many rows s holds in flight.
func inFlight(s *Store) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.held.ids)
}

// forget drops the rows in flight without settling them (benchmarks put
// their pool back this way).
func (s *Store) forget() {
	s.mu.Lock()
	s.held = newHeld()
	s.mu.Unlock()
}

// TestQuietUntilTheNextRowComesDue: after a claim of the whole pending
// index that took nothing, the store knows when a claim could next find a
// row without the table changing: when the earliest scheduled row comes
// due (far off when none is). After a claim that took rows, or a settle,
// it knows nothing.
func TestQuietUntilTheNextRowComesDue(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ctx := context.Background()
	if rows, err := s.Claim(ctx, 10, 0); err != nil || len(rows) != 0 {
		t.Fatalf("claim of an empty table: %v %v", rows, err)
	}
	if q := time.Until(s.Quiet()); q < 30*time.Minute {
		t.Fatalf("quiet for %v with nothing scheduled, want far off", q)
	}
	later := time.Now().Add(10 * time.Minute).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('later', 'T', 'x', ?)`, later)
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('much-later', 'T', 'x', ?)`, later+3600000)
	if rows, err := s.Claim(ctx, 10, 0); err != nil || len(rows) != 0 {
		t.Fatalf("claim with only scheduled rows: %v %v", rows, err)
	}
	if q := s.Quiet().UnixMilli(); q < later-60000 || q > later+1000 {
		t.Fatalf("quiet until %v, want when the row scheduled at %v comes due", time.UnixMilli(q), time.UnixMilli(later))
	}
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('now', 'T', 'x')`)
	rows, err := s.Claim(ctx, 10, 0)
	if err != nil || len(rows) != 1 {
		t.Fatalf("claim of a due row: %v %v", rows, err)
	}
	if !s.Quiet().IsZero() {
		t.Fatalf("quiet until %v after a claim that took a row, want unknown", s.Quiet())
	}
}

// TestClaimFencedByTheHeartbeatRow: a claim reads rows only while this
// relay's heartbeat row holds its latest heartbeat: not once the row went
// back to an earlier one (a backup written into the file in place) or is
// gone, until a heartbeat writes it again.
func TestClaimFencedByTheHeartbeatRow(t *testing.T) {
	ctx := context.Background()
	dbs := testenv.MigratedDB(t)
	l := lead.New(dbs)
	s := New(dbs, Options{Fence: l})
	db := testenv.AppDB(t, dbs.Path())
	testenv.InsertRows(t, db, 3, "pending")
	beat := func() {
		t.Helper()
		if _, err := l.Heartbeat(ctx, "test", 0, time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	beat()
	claimed := func() int {
		t.Helper()
		rows, err := s.Claim(ctx, 10, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) > 0 {
			outs := make([]event.Outcome, len(rows))
			for i, r := range rows {
				outs[i] = event.Outcome{Row: r, Settlement: event.Release, AvailableAt: time.Now()}
			}
			if stale, err := s.Settle(ctx, outs, 0); err != nil || len(stale) > 0 {
				t.Fatalf("release: %v %v", stale, err)
			}
		}
		return len(rows)
	}
	if n := claimed(); n != 3 {
		t.Fatalf("claimed %d rows with the heartbeat row as written; want 3", n)
	}
	_, _, fence := l.ClaimFence()
	testenv.MustExec(t, db, `UPDATE `+schema.InstancesTable+` SET heartbeat_at = ? WHERE instance_id = ?`, fence-1000, l.Instance())
	if n := claimed(); n != 0 {
		t.Fatalf("claimed %d rows with the heartbeat row gone back; want none", n)
	}
	testenv.MustExec(t, db, `DELETE FROM `+schema.InstancesTable)
	if n := claimed(); n != 0 {
		t.Fatalf("claimed %d rows with the heartbeat row gone; want none", n)
	}
	beat()
	if n := claimed(); n != 3 {
		t.Fatalf("claimed %d rows once a heartbeat wrote the row again; want 3", n)
	}
}

// betweenFence is the daemon's Lease as the claim store sees it, with
// between run right after Claim took its fence and before its query: where
// the heartbeat goroutine's commit may land, nothing orders the two.
type betweenFence struct {
	*lead.Lease
	between func()
}

func (f *betweenFence) ClaimFence() (string, int64, int64) {
	id, started, beat := f.Lease.ClaimFence()
	if f.between != nil {
		f.between()
		f.between = nil
	}
	return id, started, beat
}

// TestClaimFenceTakenBeforeTheRejoiningHeartbeat: a backup written into the
// file in place brings the relay's heartbeat row back to an earlier
// heartbeat. The claim that follows took its fence (the latest beat) just
// before the heartbeat that found the row gone back committed: that
// heartbeat writes a higher heartbeat_at with its rejoin, so the fence
// (heartbeat_at >= the old beat) holds again, and the claim reads the
// restored rows although the relay no longer leads. The settle that follows
// is not fenced either: the relay alone is the leader by leaderSQL.
func TestClaimFenceTakenBeforeTheRejoiningHeartbeat(t *testing.T) {
	ctx := context.Background()
	dbs := testenv.MigratedDB(t)
	l := lead.New(dbs)
	f := &betweenFence{Lease: l}
	s := New(dbs, Options{Fence: f})
	db := testenv.AppDB(t, dbs.Path())
	beat := func() {
		t.Helper()
		if _, err := l.Heartbeat(ctx, "test", 0, time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	beat()
	beat()
	if !l.Leads() {
		t.Fatal("a relay alone does not lead")
	}
	// The restore: rows published since are pending again, and the
	// heartbeat row holds an earlier heartbeat.
	testenv.InsertRows(t, db, 3, "pending")
	_, _, fence := l.ClaimFence()
	testenv.MustExec(t, db, `UPDATE `+schema.InstancesTable+` SET heartbeat_at = ? WHERE instance_id = ?`, fence-1000, l.Instance())
	// The claim woken by the restore's commit takes its fence; the
	// heartbeat ticking meanwhile finds the row gone back and rejoins.
	f.between = beat
	rows, err := s.Claim(ctx, 10, 0)
	if err != nil {
		t.Fatal(err)
	}
	if l.Leads() {
		t.Fatal("the relay leads on after the heartbeat that found its row gone back")
	}
	if len(rows) > 0 {
		outs := make([]event.Outcome, len(rows))
		for i, r := range rows {
			outs[i] = event.Outcome{Row: r, Settlement: event.Done}
		}
		stale, err := s.Settle(ctx, outs, 0)
		t.Fatalf("a claim read %d restored rows after the heartbeat that found the row gone back (the relay does not lead, has not reconciled); their settle as done: stale %d, err %v",
			len(rows), len(stale), err)
	}
}
