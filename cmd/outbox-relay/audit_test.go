package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// auditJSON runs audit --json against n and the database at path.
func auditJSON(t *testing.T, n *testenv.NATS, path string, args ...string) (int, map[string]any) {
	t.Helper()
	code, out, errOut := runCLI(t, append([]string{"audit", "--json", "--database-path", path, "--nats-url", n.URL()}, args...)...)
	var r map[string]any
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("audit --json: %v\n%s\n%s", err, out, errOut)
	}
	return code, r
}

// TestAudit: after a run, every done row's recorded stream sequence holds
// its event (all matched, and status shows the latest sequence); messages
// the stream's limits removed are reported as removed, not as mismatches;
// a row whose sequence holds another event is a mismatch, and audit exits
// 1. It only reads the database.
func TestAudit(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 300, "Audited")
	d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN="}, "run", "--database-path", path)
	testenv.Eventually(t, 30*time.Second, "300 rows done", func() bool { return testenv.Counts(t, app)["done"] == 300 })
	d.stop()
	var unrecorded int
	app.QueryRow(`SELECT count(*) FROM event_queue WHERE stream_seq IS NULL`).Scan(&unrecorded)
	if unrecorded != 0 {
		t.Fatalf("%d done rows without a stream sequence", unrecorded)
	}

	code, r := auditJSON(t, n, path)
	if code != 0 || r["audited"] != 300.0 || r["matched"] != 300.0 || r["removed"] != 0.0 || len(r["mismatches"].([]any)) != 0 {
		t.Fatalf("audit after a run: exit %d, %v", code, r)
	}
	code, out, _ := runCLI(t, "status", "--json", "--database-path", path)
	var st struct {
		LastStreamSeq uint64 `json:"last_stream_seq"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || code != 0 || st.LastStreamSeq != 300 {
		t.Fatalf("status: last_stream_seq %d (%v, exit %d)", st.LastStreamSeq, err, code)
	}

	// The stream's limits remove its oldest 100 messages.
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Purge(context.Background(), jetstream.WithPurgeKeep(200)); err != nil {
		t.Fatal(err)
	}
	code, r = auditJSON(t, n, path, "--limit", "250")
	if code != 0 || r["audited"] != 250.0 || r["matched"] != 200.0 || r["removed"] != 50.0 || r["stream_first_seq"] != 101.0 {
		t.Fatalf("audit after the oldest 100 were removed (newest 250 audited): exit %d, %v", code, r)
	}

	// A forged row: its sequence holds another row's event. And an id
	// reused after its row was deleted: the stream holds the id, but the
	// other row's message (JetStream took the second as a duplicate).
	testenv.MustExec(t, app, `UPDATE event_queue SET stream_seq = 299 WHERE stream_seq = 300`)
	var reused string
	app.QueryRow(`SELECT event_id FROM event_queue WHERE id = 250`).Scan(&reused)
	testenv.MustExec(t, app, `DELETE FROM event_queue WHERE id = 250`)
	testenv.MustExec(t, app, `UPDATE event_queue SET event_id = ?, stream_seq = 250 WHERE id = 251`, reused)
	code, out, _ = runCLI(t, "audit", "--database-path", path, "--nats-url", n.URL())
	if code != 1 || !strings.Contains(out, "mismatched  2") || !strings.Contains(out, "stream sequence 299 holds event") ||
		!strings.Contains(out, `row 251 (event_id `+reused+`): stream sequence 250 holds event "`+reused+`" (row "250")`) {
		t.Fatalf("audit of forged rows: exit %d\n%s", code, out)
	}
	code, r = auditJSON(t, n, path, "--since", "1h")
	if m := r["mismatches"].([]any); code != 1 || len(m) != 2 || m[0].(map[string]any)["stream_seq"] != 299.0 {
		t.Fatalf("audit --json of forged rows: exit %d, %v", code, r)
	}
}

// TestAuditEarlierStream: rows the relay published before the stream was
// deleted are reported as published to an earlier stream once the relay
// has created it again and published into it, not as mismatches where
// the new stream holds other events at their sequences: audit exits 0.
func TestAuditEarlierStream(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	relay := func(done int) {
		t.Helper()
		d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN="}, "run", "--database-path", path)
		testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == done })
		d.stop()
	}
	testenv.InsertN(t, app, 5, "Before")
	relay(5)
	if err := n.JetStream(t).DeleteStream(context.Background(), "EVENTS"); err != nil {
		t.Fatal(err)
	}
	testenv.InsertN(t, app, 3, "After")
	relay(8)

	code, r := auditJSON(t, n, path)
	if code != 0 || r["audited"] != 8.0 || r["matched"] != 3.0 || r["earlier_stream"] != 5.0 || r["removed"] != 0.0 || len(r["mismatches"].([]any)) != 0 {
		t.Fatalf("audit after the stream was deleted and created again: exit %d, %v", code, r)
	}
	code, out, _ := runCLI(t, "audit", "--database-path", path, "--nats-url", n.URL())
	if code != 0 || !strings.Contains(out, "  earlier     5 (published to an earlier stream EVENTS, since deleted") || !strings.Contains(out, "mismatched  0") {
		t.Fatalf("audit: exit %d\n%s", code, out)
	}
}
