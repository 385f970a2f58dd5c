package main

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// hostileID is an event id an application could write: shown raw, it
// would set the terminal's title and clear its screen.
const hostileID = "id\x1b]0;PWNED\x07\x1b[2J"

// escapedID is hostileID as output for people shows it.
const escapedID = `id\x1b]0;PWNED\a\x1b[2J`

// rawControls reports the first byte of out a terminal would act on
// (anything below a space but a newline, and DEL), or -1.
func rawControls(out string) int {
	return strings.IndexFunc(out, func(r rune) bool { return (r < ' ' && r != '\n') || r == 0x7f || r == '\u202e' })
}

// TestHumanOutputEscapesDatabaseValues: the values the application wrote
// (event_id, last_error, headers, a relay's heartbeat row, a consumer's
// exhausted message) reach the terminal with their control characters
// escaped in status and dead-letters list and show; --json keeps them as
// they are, escaped by JSON.
func TestHumanOutputEscapesDatabaseValues(t *testing.T) {
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, attempts, last_error, headers, processed_at)
		VALUES (1, ?1, 'T', 'x', 'dead_lettered', 3, ?2, ?3, 1000)`,
		hostileID, "refused: "+hostileID+"\rall good \u202eevil", `{"x": "`+hostileID+`"}`)
	testenv.MustExec(t, db, `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, in_flight)
		VALUES (?1, ?2, ?2, ?1, 1, ?1, 0)`, hostileID, time.Now().UnixMilli())
	testenv.MustExec(t, db, `INSERT INTO `+schema.ExhaustedTable+` (event_id, stream, consumer, stream_seq, subject, deliveries, observed_at)
		VALUES (?1, 'EVENTS', 'worker', 7, 'events.T', 5, 1000)`, hostileID)

	for _, args := range [][]string{
		{"status"},
		{"dead-letters", "list"},
		{"dead-letters", "list", "--consumer"},
		{"dead-letters", "show", "1"},
	} {
		code, out, errOut := runCLI(t, append(args, "--database-path", path)...)
		if code != 0 {
			t.Fatalf("%v: exit %d\n%s", args, code, errOut)
		}
		if i := rawControls(out); i >= 0 {
			t.Errorf("%v prints a raw control character (%q at %d):\n%q", args, out[i], i, out)
		}
		if !strings.Contains(out, escapedID) {
			t.Errorf("%v does not show the id escaped (%s):\n%q", args, escapedID, out)
		}
	}
	if _, out, _ := runCLI(t, "dead-letters", "show", "1", "--database-path", path); !strings.Contains(out, `\rall good \u202eevil`) {
		t.Errorf("show does not escape the carriage return and the right-to-left override in last_error:\n%q", out)
	}

	_, out, _ := runCLI(t, "dead-letters", "list", "--json", "--database-path", path)
	var dls []struct {
		EventID string `json:"event_id"`
	}
	if err := json.Unmarshal([]byte(out), &dls); err != nil || len(dls) != 1 || dls[0].EventID != hostileID {
		t.Errorf("list --json: %v %+v; want the id as written", err, dls)
	}

}

// TestStatusPresumesSilentRelaysDead: a heartbeat row older than the
// relays' staleness window (a relay killed without cleaning up) is not
// shown leading but presumed dead, with who takes over, in the text and
// in --json; a live relay beside it is named as the one taking over.
func TestStatusPresumesSilentRelaysDead(t *testing.T) {
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	beat := func(id string, started, beat time.Time) {
		testenv.MustExec(t, db, `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, in_flight)
			VALUES (?, ?, ?, 'host', 4242, 'test', 3)`, id, started.UnixMilli(), beat.UnixMilli())
	}
	now := time.Now()
	beat("dead-relay", now.Add(-time.Hour), now.Add(-35*time.Second))

	out := statusText(t, path)
	line := relayLine(t, out, "dead-relay")
	if strings.Contains(line, "leading") || !strings.Contains(line, "not heartbeating for 35") ||
		!strings.Contains(line, "presumed dead; the next relay to start takes over") {
		t.Errorf("a relay silent for 35 s:\n%s", out)
	}
	relays := statusRelays(t, path)
	if len(relays) != 1 || relays[0].Leader || !relays[0].PresumedDead {
		t.Errorf("status --json relays %+v; want the silent one presumed dead, not leading", relays)
	}

	beat("live-relay", now.Add(-time.Minute), time.Now())
	out = statusText(t, path)
	if line := relayLine(t, out, "dead-relay"); !strings.Contains(line, "presumed dead; a live relay takes over") {
		t.Errorf("a silent relay beside a live one:\n%s", out)
	}
	if line := relayLine(t, out, "live-relay"); !strings.Contains(line, "standing by") || strings.Contains(line, "presumed dead") {
		t.Errorf("the live relay:\n%s", out)
	}
	relays = statusRelays(t, path)
	if len(relays) != 2 || !relays[0].PresumedDead || relays[1].PresumedDead || relays[0].Leader || relays[1].Leader {
		t.Errorf("status --json relays %+v", relays)
	}

	testenv.MustExec(t, db, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = 'dead-relay'`)
	if line := relayLine(t, statusText(t, path), "live-relay"); !strings.Contains(line, "leading") {
		t.Errorf("the live relay alone does not lead: %s", line)
	}
}

// relayLine is the line of status's output about the relay id.
func relayLine(t *testing.T, out, id string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, id+" on ") {
			return l
		}
	}
	t.Fatalf("status does not list relay %s:\n%s", id, out)
	return ""
}

// statusRelays runs status --json and returns its relays.
func statusRelays(t *testing.T, path string) []struct {
	ID           string `json:"instance"`
	Leader       bool   `json:"leader"`
	PresumedDead bool   `json:"presumed_dead"`
} {
	t.Helper()
	code, out, errOut := runCLI(t, "status", "--json", "--database-path", path)
	var st struct {
		Relays []struct {
			ID           string `json:"instance"`
			Leader       bool   `json:"leader"`
			PresumedDead bool   `json:"presumed_dead"`
		} `json:"relays"`
	}
	if err := json.Unmarshal([]byte(out), &st); code != 0 || err != nil {
		t.Fatalf("status --json: exit %d, %v\n%s%s", code, err, out, errOut)
	}
	return st.Relays
}

// TestMissingTableSaysWhatToDo: status and dead-letters on a file
// without the outbox table, or without the relay's own tables, name the
// table and the file (as an absolute path) and say how to create it, or
// to check database.table.
func TestMissingTableSaysWhatToDo(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.db")
	testenv.MustExec(t, testenv.AppDB(t, empty), `CREATE TABLE app_data (id INTEGER PRIMARY KEY)`)
	t.Chdir(dir)
	for _, args := range [][]string{
		{"status"},
		{"dead-letters", "list"},
		{"dead-letters", "show", "1"},
		{"dead-letters", "retry", "--all"},
	} {
		code, _, errOut := runCLI(t, append(args, "--database-path", "empty.db")...)
		for _, want := range []string{"no such table: event_queue in " + empty, "outbox-relay migrate", "database.table"} {
			if code != exitRuntime || !strings.Contains(errOut, want) {
				t.Errorf("%v on a file without the outbox table: exit %d, stderr %q; want 1 and %q", args, code, errOut, want)
			}
		}
	}

	// The application created the outbox table itself and no relay ran
	// yet: the relay's own tables are missing.
	path := filepath.Join(dir, "app.db")
	testenv.MustExec(t, testenv.AppDB(t, path), `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_id TEXT, event_type TEXT, payload BLOB,
		status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT, created_at INTEGER, available_at INTEGER, processed_at INTEGER)`)
	code, _, errOut := runCLI(t, "status", "--database-path", path)
	if want := "no such table: " + schema.InstancesTable + " in " + path; code != exitRuntime || !strings.Contains(errOut, want) || !strings.Contains(errOut, "outbox-relay migrate") {
		t.Errorf("status without the relay's tables: exit %d, stderr %q; want 1 and %q", code, errOut, want)
	}
	if code, out, errOut := runCLI(t, "dead-letters", "list", "--database-path", path); code != 0 {
		t.Errorf("dead-letters list reads the outbox table alone: exit %d\n%s%s", code, out, errOut)
	}
}
