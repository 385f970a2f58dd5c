package main

import (
	"bytes"
	"crypto/rand"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// tenantDB creates the migrated outbox file of tenant in dir and returns
// the application's connection to it.
func tenantDB(t *testing.T, dir, tenant string) *sql.DB {
	t.Helper()
	path := filepath.Join(dir, tenant+".db")
	if code, _, errOut := runCLI(t, "migrate", "--database-path", path); code != 0 {
		t.Fatalf("migrate %s: exit %d\n%s", path, code, errOut)
	}
	return testenv.AppDB(t, path)
}

// pendingRows inserts n pending rows of tenant, the first of them due
// since dueFor ago, the rest due now.
func pendingRows(t *testing.T, db *sql.DB, tenant string, n int, dueFor time.Duration) {
	t.Helper()
	now := time.Now()
	for i := range n {
		at := now
		if i == 0 {
			at = now.Add(-dueFor)
		}
		testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, created_at, available_at) VALUES (?1, 'OrderPlaced', 'x', ?2, ?2)`,
			fmt.Sprintf("%s-p%d", tenant, i), at.UnixMilli())
	}
}

// testFleet builds a fleet of five files in a new directory and returns
// its pattern: acme (42 pending, the oldest due for 2 h; 2 dead letters,
// one of which parks key order-42, whose 2 pending rows wait; a leading
// relay), globex (5 pending, due for 5 min; 1 dead letter), initech (10
// done rows), bare (a SQLite file without the outbox table) and corrupt
// (random bytes).
func testFleet(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	acme := tenantDB(t, dir, "acme")
	pendingRows(t, acme, "acme", 40, 2*time.Hour)
	now := time.Now().UnixMilli()
	testenv.MustExec(t, acme, `INSERT INTO event_queue (event_id, event_type, payload, status, attempts, last_error, processed_at, ordering_key)
		VALUES ('acme-d1', 'OrderPaid', 'x', 'dead_lettered', 10, 'nats: permission denied', ?1, 'order-42'),
		       ('acme-d2', 'OrderShipped', 'x', 'dead_lettered', 3, 'message size exceeds maximum allowed', ?1, NULL)`, now-60_000)
	testenv.MustExec(t, acme, `INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES ('acme-k1', 'OrderPaid', 'x', 'order-42'), ('acme-k2', 'OrderPaid', 'x', 'order-42')`)
	testenv.MustExec(t, acme, `INSERT INTO outbox_relay_instances (instance_id, started_at, heartbeat_at, hostname, pid, version) VALUES ('relay-7f3a', ?1, ?1, 'node-1', 4242, 'test')`, now)

	globex := tenantDB(t, dir, "globex")
	pendingRows(t, globex, "globex", 5, 5*time.Minute)
	testenv.MustExec(t, globex, `INSERT INTO event_queue (event_id, event_type, payload, status, attempts, last_error, processed_at)
		VALUES ('globex-d1', 'InvoiceSent', 'x', 'dead_lettered', 10, 'nats: permission denied', ?)`, now)

	initech := tenantDB(t, dir, "initech")
	testenv.InsertRows(t, initech, 10, "done")
	testenv.MustExec(t, initech, `UPDATE event_queue SET processed_at = ?`, now)

	testenv.MustExec(t, testenv.AppDB(t, filepath.Join(dir, "bare.db")), `CREATE TABLE notes (body TEXT)`)
	noise := make([]byte, 8192)
	rand.Read(noise)
	if err := os.WriteFile(filepath.Join(dir, "corrupt.db"), noise, 0o600); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, "*.db")
}

// fleetJSON is what the tests read of status --json on a fleet.
type fleetJSON struct {
	Pattern string `json:"pattern"`
	Count   int    `json:"file_count"`
	Unread  int    `json:"unreadable_count"`
	Files   []struct {
		Tenant  string  `json:"tenant"`
		Path    string  `json:"path"`
		Pending int64   `json:"pending"`
		Due     int64   `json:"pending_due"`
		Dead    int64   `json:"dead_lettered"`
		Parked  int64   `json:"parked_key_count"`
		Oldest  float64 `json:"oldest_pending_age_seconds"`
		Leader  string  `json:"leader"`
		Error   string  `json:"error"`
	} `json:"files"`
}

// TestFleetStatusSummary: status without --db on a fleet prints one line a
// file, worst first: the file without the outbox table and the corrupt one
// first, each with its error, then the healthy ones by backlog with their
// figures and leader; it exits 0, and creates no file of the fleet.
// --json has the same.
func TestFleetStatusSummary(t *testing.T) {
	pattern := testFleet(t)
	dir := filepath.Dir(pattern)
	before, _ := fleet.Files(pattern)
	corrupt, _ := os.ReadFile(filepath.Join(dir, "corrupt.db"))

	code, out, errOut := runCLI(t, "status", "--database-path", pattern)
	t.Logf("status on the fleet:\n%s", out)
	if code != 0 || errOut != "" {
		t.Fatalf("status on a fleet: exit %d, stderr %q", code, errOut)
	}
	lines := statusLines(out)
	want := []string{
		"database " + pattern + " (table event_queue): a fleet of 5 files, 2 could not be read",
		"TENANT PENDING DUE DEAD_LETTERED PARKED_KEYS OLDEST_PENDING LEADER",
		"bare error: no such table: event_queue in " + filepath.Join(dir, "bare.db") + ": to create it, run outbox-relay migrate",
		"corrupt error: open database " + filepath.Join(dir, "corrupt.db") + ": ",
		"acme 42 42 2 1 2h0m",
		"globex 5 5 1 0 5m",
		"initech 0 0 0 0 none due none",
		"one file's detail: status --db TENANT",
	}
	for i, w := range want {
		if i >= len(lines) || !strings.HasPrefix(lines[i], w) {
			t.Errorf("line %d does not begin %q:\n%s", i+1, w, out)
		}
	}
	if !strings.Contains(lines[3], "file is not a database") || !strings.HasSuffix(lines[4], " relay-7f3a") || !strings.HasSuffix(lines[5], " none") {
		t.Errorf("corrupt's error, acme's leader or globex's lack of one is not shown:\n%s", out)
	}

	code, out, _ = runCLI(t, "status", "--database-path", pattern, "--json")
	var r fleetJSON
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 {
		t.Fatalf("status --json on a fleet: exit %d, %v\n%s", code, err, out)
	}
	var tenants []string
	for _, f := range r.Files {
		tenants = append(tenants, f.Tenant)
	}
	if r.Pattern != pattern || r.Count != 5 || r.Unread != 2 || strings.Join(tenants, " ") != "bare corrupt acme globex initech" {
		t.Fatalf("status --json: %+v", r)
	}
	if a := r.Files[2]; a.Pending != 42 || a.Due != 42 || a.Dead != 2 || a.Parked != 1 || a.Oldest < 7200 || a.Leader != "relay-7f3a" ||
		a.Path != filepath.Join(dir, "acme.db") || a.Error != "" {
		t.Errorf("acme in --json: %+v", a)
	}
	if !strings.Contains(r.Files[0].Error, "no such table: event_queue") || !strings.Contains(r.Files[1].Error, "file is not a database") {
		t.Errorf("the broken files' errors in --json: %q, %q", r.Files[0].Error, r.Files[1].Error)
	}
	var raw struct{ Files []map[string]any }
	if err := json.Unmarshal([]byte(out), &raw); err != nil || raw.Files[3]["leader"] != "" {
		t.Errorf("globex, which no relay leads, in --json: %v (%v); want \"leader\": \"\"", raw.Files[3], err)
	}

	after, _ := fleet.Files(pattern)
	if now, _ := os.ReadFile(filepath.Join(dir, "corrupt.db")); !slices.Equal(before, after) || !bytes.Equal(now, corrupt) {
		t.Errorf("status changed the fleet: files %q, then %q; corrupt.db unchanged: %v", before, after, bytes.Equal(now, corrupt))
	}
}

// TestFleetCommandsTakeDB: on a fleet, --db chooses the file status,
// dead-letters and audit work on, by tenant, file name or path; without
// it dead-letters and audit fail with exit 2 naming database.path, the
// number of files, --db and tenants to choose from. --db naming no file
// of the fleet fails naming it; with a single file, --db must name that
// file. streamsync reads no database and has no --db.
func TestFleetCommandsTakeDB(t *testing.T) {
	pattern := testFleet(t)
	dir := filepath.Dir(pattern)

	out := statusText(t, pattern, "--db", "acme")
	for _, want := range []string{"database " + filepath.Join(dir, "acme.db") + " (table event_queue)", "pending 42", "dead_lettered 2",
		"relay-7f3a on node-1 (pid 4242, test)", "parked keys 1: their rows wait", `"order-42"`} {
		if !strings.Contains(strings.Join(statusLines(out), "\n"), want) {
			t.Errorf("status --db acme does not say %q:\n%s", want, out)
		}
	}
	if st := statusJSON(t, pattern, "--db", filepath.Join(dir, "globex.db")); st.Rows["pending"] != 5 || st.Rows["dead_lettered"] != 1 {
		t.Errorf("status --db by path: %+v, want globex's", st)
	}

	code, out, errOut := runCLI(t, "dead-letters", "list", "--json", "--database-path", pattern, "--db", "acme.db")
	var dls []struct {
		EventID string `json:"event_id"`
	}
	if err := json.Unmarshal([]byte(out), &dls); err != nil || code != 0 || len(dls) != 2 || dls[0].EventID != "acme-d2" {
		t.Errorf("dead-letters list --db acme.db: exit %d, %v, %+v\n%s", code, err, dls, errOut)
	}
	code, out, _ = runCLI(t, "dead-letters", "retry", "--all", "--dry-run", "--database-path", pattern, "--db", "globex")
	if code != 0 || out != "would retry 1 dead-lettered row(s) (dry run: nothing changed)\n" {
		t.Errorf("dead-letters retry --dry-run --db globex: exit %d, %q", code, out)
	}

	for _, args := range [][]string{{"dead-letters", "list"}, {"dead-letters", "show", "1"}, {"audit"}} {
		code, _, errOut := runCLI(t, append(args, "--database-path", pattern)...)
		want := "database.path " + pattern + " is a fleet of 5 files: choose one with --db TENANT (tenants: acme, bare, corrupt, globex, initech)"
		if code != exitUsage || !strings.Contains(errOut, want) {
			t.Errorf("%s without --db: exit %d, %q; want 2 and %q", strings.Join(args, " "), code, errOut, want)
		}
	}
	if code, _, errOut := runCLI(t, "dead-letters", "list", "--database-path", pattern, "--db", "acme-corp"); code != 1 ||
		!strings.Contains(errOut, `is named "acme-corp"`) || !strings.Contains(errOut, "tenants: acme, bare") {
		t.Errorf("--db naming no file: exit %d, %q", code, errOut)
	}
	if code, _, errOut := runCLI(t, "dead-letters", "list", "--database-path", pattern, "--db", "bare"); code != 1 ||
		!strings.Contains(errOut, "no such table: event_queue in "+filepath.Join(dir, "bare.db")) {
		t.Errorf("--db bare: exit %d, %q", code, errOut)
	}

	single := filepath.Join(dir, "acme.db")
	for _, name := range []string{"acme", "acme.db", single} {
		if code, _, errOut := runCLI(t, "dead-letters", "list", "--database-path", single, "--db", name); code != 0 {
			t.Errorf("a single file and --db %s, which names it: exit %d, %q", name, code, errOut)
		}
	}
	if code, _, errOut := runCLI(t, "status", "--database-path", single, "--db", "globex"); code != exitUsage ||
		!strings.Contains(errOut, `--db "globex": database.path `+single+" is a single file, not a fleet's pattern") {
		t.Errorf("a single file and --db naming another: exit %d, %q", code, errOut)
	}

	if code, out, _ := runCLI(t, "streamsync", "--help"); code != 0 || strings.Contains(out, "--db") {
		t.Errorf("streamsync --help: exit %d; it reads no database, so takes no --db:\n%s", code, out)
	}
}

// TestFleetAuditTakesDB: audit --db audits the file chosen, and says so.
func TestFleetAuditTakesDB(t *testing.T) {
	pattern := testFleet(t)
	n := testenv.StartNATS(t)
	testenv.EventsStream(t, n.JetStream(t), 0)
	code, out, errOut := runCLI(t, "audit", "--database-path", pattern, "--db", "initech", "--nats-url", n.URL())
	if code != 0 || !strings.HasPrefix(out, "audit of "+filepath.Join(filepath.Dir(pattern), "initech.db")+" (table event_queue)") ||
		!strings.Contains(out, "unrecorded  10") {
		t.Errorf("audit --db initech: exit %d\n%s%s", code, out, errOut)
	}
}

// TestFleetStatusOfManyFiles: the summary shows the worst 20 files and
// counts the rest; a file its application keeps locked against readers is
// reported on its line after a short wait, not waited for.
func TestFleetStatusOfManyFiles(t *testing.T) {
	dir := t.TempDir()
	first := tenantDB(t, dir, "tenant-00")
	for i := 1; i < 23; i++ {
		testenv.MustExec(t, first, `VACUUM INTO ?`, filepath.Join(dir, fmt.Sprintf("tenant-%02d.db", i)))
	}
	pendingRows(t, testenv.AppDB(t, filepath.Join(dir, "tenant-17.db")), "t17", 3, time.Minute)
	testenv.HoldExclusive(t, testenv.AppDB(t, filepath.Join(dir, "tenant-05.db")))

	pattern := filepath.Join(dir, "tenant-*.db")
	code, out, errOut := runCLI(t, "status", "--database-path", pattern)
	t.Logf("status on 23 files:\n%s", out)
	lines := statusLines(out)
	if code != 0 || len(lines) < 5 || !strings.HasSuffix(lines[0], "a fleet of 23 files, 1 could not be read") ||
		!strings.HasPrefix(lines[2], "tenant-05 error: ") || !strings.Contains(lines[2], "locking_mode=EXCLUSIVE") ||
		!strings.HasPrefix(lines[3], "tenant-17 3 3 ") || !strings.Contains(out, "\n... and 3 more (--json lists every file)\n") {
		t.Errorf("status on 23 files, one locked: exit %d\n%s%s", code, out, errOut)
	}
	if n := strings.Count(out, "\ntenant-"); n != 20 {
		t.Errorf("%d files listed, want 20", n)
	}
	var r fleetJSON
	if code, out, _ = runCLI(t, "status", "--database-path", pattern, "--json"); json.Unmarshal([]byte(out), &r) != nil || len(r.Files) != 23 {
		t.Errorf("status --json on 23 files: exit %d, %d files listed, want all", code, len(r.Files))
	}
}
