package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// statusJSON runs status --json (with args) and decodes what the tests
// look at.
func statusJSON(t *testing.T, path string, args ...string) (st struct {
	Rows      map[string]int64 `json:"rows"`
	Due       int64            `json:"pending_due"`
	Scheduled int64            `json:"pending_scheduled"`
	OldestAge float64          `json:"oldest_pending_age_seconds"`
	LastDead  []struct {
		ID        int64  `json:"id"`
		Processed string `json:"processed_at"`
	} `json:"last_dead_letters"`
	OnDeadLetter string `json:"ordering_on_dead_letter"`
	ParkedCount  int64  `json:"parked_key_count"`
	Parked       []struct {
		Key       string    `json:"ordering_key"`
		ID        int64     `json:"id"`
		EventType string    `json:"event_type"`
		LastError string    `json:"last_error"`
		Since     time.Time `json:"processed_at"`
		Waiting   int64     `json:"waiting_rows"`
	} `json:"parked_keys"`
}) {
	t.Helper()
	code, out, errOut := runCLI(t, append([]string{"status", "--database-path", path, "--json"}, args...)...)
	if code != 0 {
		t.Fatalf("status --json: exit %d\n%s", code, errOut)
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	return st
}

// statusText runs status (with args) and returns its output.
func statusText(t *testing.T, path string, args ...string) string {
	t.Helper()
	code, out, errOut := runCLI(t, append([]string{"status", "--database-path", path}, args...)...)
	if code != 0 {
		t.Fatalf("status: exit %d\n%s", code, errOut)
	}
	return out
}

// TestStatusAgesFromWhenRowsBecameDue: an event scheduled an hour ahead,
// inserted two hours ago, is not a stuck backlog; the age is that of the
// due row, counted from when it became due, and the scheduled row is
// shown apart.
func TestStatusAgesFromWhenRowsBecameDue(t *testing.T) {
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	now := time.Now()
	due := now.Add(-10 * time.Minute).UnixMilli()
	for _, args := range [][]any{
		{1, now.Add(-2 * time.Hour).UnixMilli(), now.Add(time.Hour).UnixMilli()},
		{2, now.Add(-3 * time.Hour).UnixMilli(), due},
	} {
		if _, err := db.Exec(`INSERT INTO event_queue (id, event_id, event_type, payload, created_at, available_at) VALUES (?, ?, 'A', 'x', ?, ?)`,
			args[0], args[0], args[1], args[2]); err != nil {
			t.Fatal(err)
		}
	}
	st := statusJSON(t, path)
	if st.Rows["pending"] != 2 || st.Due != 1 || st.Scheduled != 1 {
		t.Errorf("status %+v, want 2 pending: 1 due, 1 scheduled", st)
	}
	if age := time.Since(time.UnixMilli(due)).Seconds(); st.OldestAge < 600 || st.OldestAge > age {
		t.Errorf("oldest pending age %.1fs, want the due row's 10 minutes", st.OldestAge)
	}
	out := statusText(t, path)
	for _, want := range []string{"due 1   scheduled 1\n", "waiting since it became due (" + time.UnixMilli(due).UTC().Format(time.RFC3339) + ")"} {
		if !strings.Contains(out, want) {
			t.Errorf("status does not say %q:\n%s", want, out)
		}
	}

	if _, err := db.Exec(`DELETE FROM event_queue WHERE id = 2`); err != nil {
		t.Fatal(err)
	}
	if st := statusJSON(t, path); st.OldestAge != 0 || st.Scheduled != 1 {
		t.Errorf("only a scheduled row: %+v, want no age", st)
	}
	if out := statusText(t, path); !strings.Contains(out, "none due") {
		t.Errorf("only a scheduled row:\n%s", out)
	}
}

// statusLines returns status's lines with their runs of spaces (the
// columns' padding) made one.
func statusLines(out string) []string {
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		lines = append(lines, strings.Join(strings.Fields(l), " "))
	}
	return lines
}

// TestStatusShowsParkedKeys: with ordering.on_dead_letter: hold (the
// default), status names each key a dead letter parks, longest parked
// first, with that row (its id, event type and error, and since when it is
// dead-lettered) and how many rows of the key wait after it; it lists 100
// and says how many more there are. With skip it shows none.
func TestStatusShowsParkedKeys(t *testing.T) {
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	testenv.InsertParkedKeys(t, db)

	st := statusJSON(t, path)
	if st.OnDeadLetter != "hold" || st.ParkedCount != 2 || len(st.Parked) != 2 {
		t.Fatalf("status --json: on_dead_letter %q, %d parked keys %+v; want hold, keys b and a", st.OnDeadLetter, st.ParkedCount, st.Parked)
	}
	for i, want := range []struct {
		key, eventType, lastError string
		id, since, waiting        int64
	}{
		{"b", "T8", "message size exceeds maximum allowed", 8, 1000, 1},
		{"a", "T2", "nats: permission denied", 2, 2000, 2},
	} {
		p := st.Parked[i]
		if p.Key != want.key || p.ID != want.id || p.EventType != want.eventType || p.LastError != want.lastError ||
			!p.Since.Equal(time.UnixMilli(want.since)) || p.Waiting != want.waiting {
			t.Errorf("parked key %d: %+v, want %+v", i, p, want)
		}
	}
	out := statusText(t, path)
	lines := statusLines(out)
	want := []string{
		"parked keys 2: their rows wait until the dead letter is retried (dead-letters retry ID) or deleted",
		"parked keys, longest parked first:",
		"ORDERING_KEY SINCE ROW_ID WAITING EVENT_TYPE LAST_ERROR",
		`"b" 1970-01-01T00:00:01Z 8 1 "T8" message size exceeds maximum allowed`,
		`"a" 1970-01-01T00:00:02Z 2 2 "T2" nats: permission denied`,
	}
	if i := slices.Index(lines, want[0]); i < 0 || !slices.Equal(lines[i+1:i+1+len(want)-1], want[1:]) {
		t.Errorf("status does not say:\n%s\nit says:\n%s", strings.Join(want, "\n"), out)
	}

	// More keys than status lists: all are counted.
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 101)
		INSERT INTO event_queue (event_id, event_type, payload, status, processed_at, last_error, ordering_key)
		SELECT 'more-' || i, 'T', 'x', 'dead_lettered', 3000 + i, 'no', 'more-' || i FROM n`)
	if st := statusJSON(t, path); st.ParkedCount != 103 || len(st.Parked) != 100 || st.Parked[0].Key != "b" || st.Parked[99].Key != "more-98" {
		t.Errorf("status --json with 103 parked keys: count %d, %d listed; want 103, the 100 longest parked", st.ParkedCount, len(st.Parked))
	}
	if out := statusText(t, path); !strings.Contains(out, "\nand 3 more parked key(s)\n") {
		t.Errorf("status with 103 parked keys does not say how many more:\n%s", out)
	}

	skip := []string{"--ordering-on-dead-letter", "skip"}
	if st := statusJSON(t, path, skip...); st.OnDeadLetter != "skip" || st.ParkedCount != 0 || st.Parked == nil || len(st.Parked) != 0 {
		t.Errorf("status --json with skip: on_dead_letter %q, %d parked keys, %d listed; want none", st.OnDeadLetter, st.ParkedCount, len(st.Parked))
	}
	if out := statusText(t, path, skip...); !slices.Contains(statusLines(out), "parked keys none (ordering.on_dead_letter: skip)") || strings.Contains(out, "ORDERING_KEY") {
		t.Errorf("status with skip lists parked keys:\n%s", out)
	}
}

// TestStatusReadsForeignRows: rows a legacy writer left (a created_at in
// CURRENT_TIMESTAMP's text, a NULL available_at, a text processed_at) do

func TestStatusReadsForeignRows(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db := testenv.AppDB(t, path)
	// A legacy outbox whose available_at may be NULL, migrated before the
	// foreign rows arrive.
	if _, err := db.Exec(`CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_type TEXT NOT NULL, payload BLOB NOT NULL,
		status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0, available_at INTEGER,
		created_at INTEGER NOT NULL DEFAULT 0, processed_at INTEGER, last_error TEXT)`); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut := runCLI(t, "migrate", "--database-path", path); code != 0 {
		t.Fatalf("migrate: %d %s", code, errOut)
	}
	for _, q := range []string{
		`INSERT INTO event_queue (id, event_id, event_type, payload, created_at, available_at) VALUES (1, 'e1', 'A', 'x', '2024-05-01 10:00:00', 0)`,
		`INSERT INTO event_queue (id, event_id, event_type, payload, created_at, available_at) VALUES (2, 'e2', 'A', 'x', 1717200000000, NULL)`,
		`INSERT INTO event_queue (id, event_id, event_type, payload, created_at, available_at) VALUES (3, 'e3', 'A', 'x', 'whenever', '2024-05-01 10:00:00')`,
		`INSERT INTO event_queue (id, event_id, event_type, payload, status, processed_at, last_error) VALUES (4, 'e4', 'A', 'x', 'dead_lettered', '2024-05-02 00:00:00', 'gone')`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	st := statusJSON(t, path)
	if st.Rows["pending"] != 3 || st.Due != 3 || st.Scheduled != 0 {
		t.Errorf("status %+v, want 3 pending, all due", st)
	}
	if want := time.Since(time.Date(2024, 5, 1, 10, 0, 0, 0, time.UTC)).Seconds(); st.OldestAge < want-60 || st.OldestAge > want {
		t.Errorf("oldest pending age %.0fs, want %.0fs (since 2024-05-01 10:00 UTC)", st.OldestAge, want)
	}
	if len(st.LastDead) != 1 || st.LastDead[0].Processed != "2024-05-02T00:00:00Z" {
		t.Errorf("last dead letters %+v, want row 4 processed 2024-05-02T00:00:00Z", st.LastDead)
	}
	out := statusText(t, path)
	for _, want := range []string{
		"due 3   scheduled 0",
		"waiting since it became due (2024-05-01T10:00:00Z)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status does not say %q:\n%s", want, out)
		}
	}
	if code, out, errOut := runCLI(t, "dead-letters", "list", "--database-path", path); code != 0 || !strings.Contains(out, "2024-05-02T00:00:00Z") {
		t.Errorf("dead-letters list: exit %d\n%s%s", code, out, errOut)
	}
}

// TestStatusCountsUnknownStatuses: rows another writer gave a status the
// relay does not know are shown as other, by name, not hidden.
func TestStatusCountsUnknownStatuses(t *testing.T) {
	path, db := preparedDB(t)
	for _, q := range []string{
		`INSERT INTO event_queue (event_id, event_type, payload, status) VALUES ('w1', 'A', 'x', 'weird')`,
		`INSERT INTO event_queue (event_id, event_type, payload, status) VALUES ('q1', 'A', 'x', 'queued')`,
		`INSERT INTO event_queue (event_id, event_type, payload, status) VALUES ('q2', 'A', 'x', 'queued')`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	want := `pending 1   processing 1   done 1   dead_lettered 2   other 3 ("queued" 2, "weird" 1)`
	if out := statusText(t, path); !strings.Contains(out, want) {
		t.Errorf("status does not say %q:\n%s", want, out)
	}
	if st := statusJSON(t, path); st.Rows["weird"] != 1 || st.Rows["queued"] != 2 {
		t.Errorf("status --json rows %v", st.Rows)
	}
}

// TestRetryCountsEachIDOnce: an id given three times is one row; only ids
// that are really not dead-lettered are reported as such.
func TestRetryCountsEachIDOnce(t *testing.T) {
	path, db := preparedDB(t)
	requeued := regexp.MustCompile(`^requeued 1 dead-lettered row\(s\) in 1 transaction\(s\), the longest holding the write lock [0-9.]+ ms\n`)
	code, out, errOut := runCLI(t, "dead-letters", "retry", "--database-path", path, "2", "2", "2")
	if code != 0 || !requeued.MatchString(out) || strings.Count(out, "\n") != 1 {
		t.Errorf("retry 2 2 2: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "dead-letters", "retry", "--database-path", path, "3", "2", "3", "99", "2")
	if code != 0 || !requeued.MatchString(out) || !strings.HasSuffix(out, "\n2 of the ids given were not dead-lettered and were left alone\n") {
		t.Errorf("retry 3 2 3 99 2: exit %d\n%s%s", code, out, errOut)
	}
	if c := testenv.Counts(t, db); c["dead_lettered"] != 0 || c["pending"] != 3 {
		t.Errorf("after the retries: %v", c)
	}
}

// TestReadOnlyCommandsLeaveTheFileAlone: status and dead-letters list on a
// database in rollback-journal mode leave it exactly as it was: same
// bytes, same modification time, still journal_mode delete, no -wal,
// -shm or -journal beside it.
func TestReadOnlyCommandsLeaveTheFileAlone(t *testing.T) {
	path, app := preparedDB(t)
	app.Close()
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`PRAGMA journal_mode = DELETE`); err != nil {
		t.Fatal(err)
	}
	db.Close()
	journalMode := func() string {
		db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		var mode string
		if err := db.QueryRow(`PRAGMA journal_mode`).Scan(&mode); err != nil {
			t.Fatal(err)
		}
		return mode
	}
	if m := journalMode(); m != "delete" {
		t.Fatalf("journal_mode %s before the commands", m)
	}
	before, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"status"}, {"status", "--json"}, {"dead-letters", "list"}, {"dead-letters", "list", "--consumer"}} {
		if code, _, errOut := runCLI(t, append(args, "--database-path", path)...); code != 0 {
			t.Fatalf("%s: exit %d\n%s", strings.Join(args, " "), code, errOut)
		}
		after, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		fa, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(after, before) || !fa.ModTime().Equal(fi.ModTime()) {
			t.Errorf("%s changed the database file", strings.Join(args, " "))
		}
		for _, suffix := range []string{"-wal", "-shm", "-journal"} {
			if _, err := os.Stat(path + suffix); err == nil {
				t.Errorf("%s left a %s file", strings.Join(args, " "), suffix)
			}
		}
		if m := journalMode(); m != "delete" {
			t.Errorf("%s switched journal_mode to %s", strings.Join(args, " "), m)
		}
	}
}

// lockedBuffer is a bytes.Buffer a command writes while the test reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestReadCommandsWaitForAnExclusiveLock: an application holding the file
// in locking_mode=EXCLUSIVE keeps every other connection out. status does
// not block silently or fail: it says on stderr that the file is locked,
// waits, and answers once the application lets go.
func TestReadCommandsWaitForAnExclusiveLock(t *testing.T) {
	path, app := preparedDB(t)
	app.Close() // EXCLUSIVE mode needs the file to itself to begin with
	holder, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		t.Fatal(err)
	}
	holder.SetMaxOpenConns(1)
	for _, q := range []string{`PRAGMA locking_mode = EXCLUSIVE`, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('held', 'T', 'x')`} {
		if _, err := holder.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	var stdout, stderr lockedBuffer
	code := make(chan int, 1)
	// A busy timeout of 100 ms bounds a wait for a writer's lock; a file
	// locked against readers is waited out past it.
	go func() {
		code <- run([]string{"status", "--database-path", path, "--database-busy-timeout", "100ms"}, &stdout, &stderr)
	}()
	testenv.Eventually(t, 30*time.Second, "status to say the file is locked", func() bool {
		return strings.Contains(stderr.String(), "database locked against this process; waiting until it is free")
	})
	time.Sleep(2 * time.Second) // not a synchronisation: status must still be waiting after it
	select {
	case c := <-code:
		t.Fatalf("status ended with %d while the file was locked: %s %s", c, stdout.String(), stderr.String())
	default:
	}
	holder.Close() // the application lets go
	select {
	case c := <-code:
		if c != 0 || !strings.Contains(stdout.String(), "pending") {
			t.Fatalf("status after the lock was released: exit %d, %q, stderr %q", c, stdout.String(), stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("status did not answer after the lock was released")
	}
}

// TestStatusShowsAShortDuplicateWindow: with --stream, status asks the
// server for the stream's duplicate window and, when a max_age below an
// hour caps it, says so with the command the server accepts and what a
// shorter window costs.
func TestStatusShowsAShortDuplicateWindow(t *testing.T) {
	n := testenv.StartNATS(t)
	if _, err := n.JetStream(t).CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, MaxAge: time.Minute}); err != nil {
		t.Fatal(err)
	}
	path, _ := preparedDB(t)
	code, out, errOut := runCLI(t, "status", "--stream", "--database-path", path, "--nats-url", n.URL())
	for _, want := range []string{"duplicate window: 1m0s (stream EVENTS, stream.duplicate_window 1h0m0s)", "warning: stream EVENTS dedups within 1m", "--max-age 1h --dupe-window 1h"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("status --stream: exit %d, output lacks %q:\n%s%s", code, want, out, errOut)
		}
	}
	code, out, _ = runCLI(t, "status", "--stream", "--json", "--database-path", path, "--nats-url", n.URL())
	if code != 0 || !strings.Contains(out, `"duplicate_window": {`) || !strings.Contains(out, `"short": true`) {
		t.Errorf("status --stream --json: exit %d:\n%s", code, out)
	}
}
