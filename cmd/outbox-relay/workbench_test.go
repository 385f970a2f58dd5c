package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// workbenchDB holds three dead letters (ids 1 to 3) of different types,
// errors, ages and payloads, and one done row (4).
func workbenchDB(t *testing.T) string {
	t.Helper()
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	now := time.Now().UnixMilli()
	ago := func(d time.Duration) int64 { return now - d.Milliseconds() }
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, attempts, last_error, processed_at, headers, ordering_key)
		VALUES (1, 'e1', 'OrderPaid', '{"order": 42, "note": "café"}', 'dead_lettered', 10, 'card declined by the bank', ?, '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}', 'order-42')`, ago(2*time.Hour))
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, attempts, last_error, processed_at, atomic_group, stream_seq)
		VALUES (2, 'e2', 'OrderShipped', x'00ff10', 'dead_lettered', 3, 'permission denied on subject events.OrderShipped', ?, 'order-7', 812)`, ago(10*time.Minute))
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, attempts, last_error, processed_at)
		VALUES (3, 'e3', 'OrderPaid', ?, 'dead_lettered', 1, 'permission denied on subject events.OrderPaid', ?)`, strings.Repeat("long text ", 1000), ago(time.Minute))
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, processed_at) VALUES (4, 'e4', 'OrderPaid', 'x', 'done', ?)`, now)
	return path
}

// listIDs runs dead-letters list --json with args and returns the ids.
func listIDs(t *testing.T, path string, args ...string) string {
	t.Helper()
	code, out, errOut := runCLI(t, append([]string{"dead-letters", "list", "--json", "--database-path", path}, args...)...)
	var dls []struct {
		ID int64 `json:"id"`
	}
	if err := json.Unmarshal([]byte(out), &dls); err != nil || code != 0 {
		t.Fatalf("list %v: exit %d, %v\n%s%s", args, code, err, out, errOut)
	}
	var ids []string
	for _, d := range dls {
		ids = append(ids, fmt.Sprint(d.ID))
	}
	return strings.Join(ids, " ")
}

// TestDeadLetterWorkbench: show prints a row whole (payload as text when
// it is UTF-8, else as hex, cut at --max-bytes); list, retry and discard
// take --type, --since, --until and --error; --dry-run changes nothing;
// every command has --json.
func TestDeadLetterWorkbench(t *testing.T) {
	path := workbenchDB(t)
	db := testenv.AppDB(t, path)

	code, out, errOut := runCLI(t, "dead-letters", "show", "1", "--database-path", path)
	for _, want := range []string{`{"order": 42, "note": "café"}`, "payload (30 bytes, text)", "card declined by the bank", `"order-42"`, "traceparent", "dead_lettered"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("show 1: exit %d, does not say %q\n%s%s", code, want, out, errOut)
		}
	}
	if code, out, _ = runCLI(t, "dead-letters", "show", "2", "--database-path", path); code != 0 || !strings.Contains(out, "payload (3 bytes, hex):\n00ff10\n") ||
		!strings.Contains(out, "atomic_group  order-7\n") || !strings.Contains(out, "stream_seq    812\n") {
		t.Errorf("show 2 (binary, of a group): exit %d\n%s", code, out)
	}
	if code, out, _ = runCLI(t, "dead-letters", "show", "3", "--max-bytes", "20", "--database-path", path); code != 0 ||
		!strings.Contains(out, "payload (10000 bytes, text, the first 20 shown (--max-bytes)):\nlong text long text \n") {
		t.Errorf("show 3 --max-bytes 20: exit %d\n%s", code, out)
	}
	code, out, _ = runCLI(t, "dead-letters", "show", "2", "--json", "--database-path", path)
	var shown map[string]any
	if err := json.Unmarshal([]byte(out), &shown); err != nil || code != 0 || shown["payload"] != "00ff10" || shown["payload_encoding"] != "hex" ||
		shown["payload_bytes"] != 3.0 || shown["event_type"] != "OrderShipped" || shown["attempts"] != 3.0 || shown["atomic_group"] != "order-7" {
		t.Errorf("show 2 --json: exit %d, %v, %v", code, err, shown)
	}
	if code, _, errOut = runCLI(t, "dead-letters", "show", "99", "--database-path", path); code != 1 || !strings.Contains(errOut, "row 99 in event_queue: no such row") {
		t.Errorf("show 99: exit %d, %s", code, errOut)
	}
	if code, _, errOut = runCLI(t, "dead-letters", "show", "1", "--max-bytes", "-5", "--database-path", path); code != 2 || !strings.Contains(errOut, "--max-bytes must be -1") {
		t.Errorf("show 1 --max-bytes -5: exit %d, %s", code, errOut)
	}
	if code, _, errOut = runCLI(t, "status", "--last", "-1", "--database-path", path); code != 2 || !strings.Contains(errOut, "--last must be 0 or more") {
		t.Errorf("status --last -1: exit %d, %s", code, errOut)
	}

	for args, want := range map[string]string{
		"":                       "3 2 1",
		"--type OrderPaid":       "3 1",
		"--error permission":     "3 2",
		"--since 30m":            "3 2",
		"--until 30m":            "1",
		"--since 30m --until 5m": "2",
		"--type OrderPaid --since " + time.Now().Add(-30*time.Minute).UTC().Format(time.RFC3339): "3",
	} {
		if got := listIDs(t, path, strings.Fields(args)...); got != want {
			t.Errorf("list %s: %q, want %q", args, got, want)
		}
	}
	if code, _, errOut = runCLI(t, "dead-letters", "list", "--since", "yesterday", "--database-path", path); code != 2 || !strings.Contains(errOut, `--since "yesterday"`) {
		t.Errorf("list --since yesterday: exit %d, %s", code, errOut)
	}
	if code, _, errOut = runCLI(t, "dead-letters", "list", "--consumer", "--since", "24h", "--database-path", path); code != 2 || !strings.Contains(errOut, "do not filter") {
		t.Errorf("list --consumer --since 24h: exit %d, %s; want a usage error, not an unfiltered list", code, errOut)
	}

	code, out, _ = runCLI(t, "dead-letters", "retry", "--all", "--type", "OrderPaid", "--dry-run", "--database-path", path)
	if code != 0 || out != "would retry 2 dead-lettered row(s) (dry run: nothing changed)\n" || testenv.Counts(t, db)["dead_lettered"] != 3 {
		t.Errorf("retry --dry-run: exit %d, %q, %v", code, out, testenv.Counts(t, db))
	}
	code, out, _ = runCLI(t, "dead-letters", "discard", "--all", "--error", "permission denied", "--json", "--database-path", path)
	var b map[string]any
	if err := json.Unmarshal([]byte(out), &b); err != nil || code != 0 || b["matched"] != 2.0 || b["changed"] != 2.0 || b["dry_run"] != false {
		t.Errorf("discard --all --error: exit %d, %v, %s", code, err, out)
	}
	if got := listIDs(t, path); got != "1" {
		t.Errorf("after the discard: %q, want 1", got)
	}
	if code, out, _ = runCLI(t, "dead-letters", "discard", "1", "4", "--database-path", path); code != 0 ||
		!strings.HasPrefix(out, "discarded 1 dead-lettered row(s)") || !strings.Contains(out, "1 of the ids given were not dead-lettered") {
		t.Errorf("discard 1 4: exit %d\n%s", code, out)
	}
	if c := testenv.Counts(t, db); c["dead_lettered"] != 0 || c["done"] != 1 {
		t.Errorf("counts %v: want only the done row", c)
	}
	if code, _, errOut = runCLI(t, "dead-letters", "discard", "--database-path", path); code != 2 || !strings.Contains(errOut, "give --all or row ids") {
		t.Errorf("discard with neither: exit %d, %s", code, errOut)
	}
}
