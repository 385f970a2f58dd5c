package daemon_test

// Rows that a careless application writes. Each test asserts what a user
// observes (rows, messages, logs), not how the relay is built.

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// rowState is one row's status, attempts and last_error.
type rowState struct {
	status    string
	attempts  int
	lastError string
}

func rowByEventID(t *testing.T, db *sql.DB, id string) rowState {
	t.Helper()
	var r rowState
	var lastErr sql.NullString
	if err := db.QueryRow(`SELECT status, attempts, last_error FROM event_queue WHERE event_id = ?`, id).Scan(&r.status, &r.attempts, &lastErr); err != nil {
		t.Fatalf("row %q: %v", id, err)
	}
	r.lastError = lastErr.String
	return r
}

// TestWhitespaceEventIDIsRefusedNotMerged: NATS drops a header value's
// surrounding whitespace, so "sp1 " would be deduplicated against "sp1" and
// one event lost. The relay refuses such an id instead.
func TestWhitespaceEventIDIsRefusedNotMerged(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	for _, id := range []string{"sp1", "sp1 ", " sp1", "sp1\t"} {
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'Spaced', 'x')`, id)
	}
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 4, 20*time.Second)
	if r := rowByEventID(t, app, "sp1"); r.status != "done" {
		t.Errorf("row sp1 is %s, want done", r.status)
	}
	for _, id := range []string{"sp1 ", " sp1", "sp1\t"} {
		r := rowByEventID(t, app, id)
		if r.status != "dead_lettered" || !strings.Contains(r.lastError, "whitespace") {
			t.Errorf("row %q: %s %q; want dead_lettered saying why (whitespace)", id, r.status, r.lastError)
		}
	}
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	if len(msgs) != 1 || msgs[0].Header.Get(publish.HeaderMsgID) != "sp1" {
		t.Fatalf("stream holds %d messages, want the one of sp1", len(msgs))
	}
}

// TestReusedEventIDIsDeadLettered: an application that deletes a done row
// and reuses its event id within the duplicate window would lose the
// second event to JetStream's dedup: the row is dead-lettered with a
// reason that names the row and the sequence holding the id, and counted;
// so is one whose id the stream no longer holds after a purge (JetStream
// still drops it). A row published again (after a crash) is a harmless
// duplicate: done, not reported.
func TestReusedEventIDIsDeadLettered(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('reused-id', 'First', 'one')`)
	waitAllSettled(t, app, 1, 20*time.Second)
	// The same row published again (a relay that crashed after the PubAck).
	testenv.MustExec(t, app, `UPDATE event_queue SET status = 'pending', processed_at = NULL`)
	waitAllSettled(t, app, 1, 20*time.Second)
	if r := rowByEventID(t, app, "reused-id"); r.status != "done" {
		t.Fatalf("a row published again is %s (%s), want done", r.status, r.lastError)
	}
	const warning = "dead-lettered a row whose event id the stream holds for another row: its own event is not in the stream"
	if c := logCount(h, warning); c != 0 {
		t.Fatalf("a row published again was reported %d times as another row's duplicate", c)
	}
	// Another row with the id, within the window.
	testenv.MustExec(t, app, `DELETE FROM event_queue`)
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('reused-id', 'Second', 'two')`)
	waitAllSettled(t, app, 1, 20*time.Second)
	r := rowByEventID(t, app, "reused-id")
	if r.status != "dead_lettered" || !strings.Contains(r.lastError, "at sequence 1, published for row 1 of this table") {
		t.Fatalf("a row reusing an event id is %s (%q), want dead_lettered naming sequence 1 and row 1", r.status, r.lastError)
	}
	// A third, after the stream was purged: JetStream still drops the id.
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, app, `DELETE FROM event_queue`)
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('reused-id', 'Third', 'three')`)
	waitAllSettled(t, app, 1, 20*time.Second)
	r = rowByEventID(t, app, "reused-id")
	if r.status != "dead_lettered" || !strings.Contains(r.lastError, "for sequence 1, which the stream no longer holds") {
		t.Fatalf("a row reusing a purged event id is %s (%q), want dead_lettered naming sequence 1", r.status, r.lastError)
	}
	if msgs := testenv.StreamMessages(t, js, "EVENTS"); len(msgs) != 0 {
		t.Fatalf("the purged stream holds %d messages, want none", len(msgs))
	}
	testenv.Eventually(t, 5*time.Second, "the warnings", func() bool { return logCount(h, warning) == 2 })
	for _, e := range h.logs.FilterMessage(warning).All() {
		if e.ContextMap()["event_id"] != "reused-id" {
			t.Errorf("warning without the event id: %v", e.ContextMap())
		}
	}
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	if got := metrics.Value(h.metrics.ReusedEventIDs); got != 2 {
		t.Errorf("reused_event_ids_total %v, want 2", got)
	}
	if got := metrics.Value(h.metrics.DeadLettered.WithLabelValues(event.DeadLetterReusedID)); got != 2 {
		t.Errorf("dead_lettered_total{reason=reused_event_id} %v, want 2", got)
	}
}

// TestUnreadableRowIsDealtWithAlone: a row whose created_at is text does
// not stop the rows behind it. SQLite's own date-time text is read as the
// time it names; text that is no time dead-letters that row alone, saying
// why. A pending row with a NULL available_at or payload is published (an
// empty body), not ignored.
func TestUnreadableRowIsDealtWithAlone(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	path := dir + "/legacy.db"
	legacy, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		t.Fatal(err)
	}
	defer legacy.Close()
	// A legacy table whose available_at and payload may be NULL.
	testenv.MustExec(t, legacy, `CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_type TEXT NOT NULL, payload BLOB,
		status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
		available_at INTEGER, created_at INTEGER NOT NULL DEFAULT 0,
		processed_at INTEGER, last_error TEXT)`)
	if _, err := schema.Migrate(context.Background(), testenv.OpenDB(t, path)); err != nil {
		t.Fatal(err)
	}
	ins := `INSERT INTO event_queue (event_id, event_type, payload, created_at, available_at) VALUES (?, 'Thing', 'x', ?, ?)`
	now := time.Now().UnixMilli()
	testenv.MustExec(t, legacy, ins, "before", now, now)
	testenv.MustExec(t, legacy, ins, "sqlite-text", "2024-05-01 10:00:00", now)
	testenv.MustExec(t, legacy, ins, "garbage", "last tuesday", now)
	testenv.MustExec(t, legacy, ins, "no-available-at", now, nil)
	testenv.MustExec(t, legacy, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('no-payload', 'Thing', NULL)`)
	testenv.MustExec(t, legacy, ins, "after", now, now)
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, legacy, 6, 20*time.Second)
	for _, id := range []string{"before", "sqlite-text", "no-available-at", "no-payload", "after"} {
		if r := rowByEventID(t, legacy, id); r.status != "done" {
			t.Errorf("row %s is %s (%s), want done", id, r.status, r.lastError)
		}
	}
	if r := rowByEventID(t, legacy, "garbage"); r.status != "dead_lettered" || !strings.Contains(r.lastError, "created_at") {
		t.Errorf("row garbage: %s %q; want dead_lettered naming created_at", r.status, r.lastError)
	}
	for _, m := range testenv.StreamMessages(t, n.JetStream(t), "EVENTS") {
		if m.Header.Get(publish.HeaderMsgID) == "sqlite-text" {
			if got := m.Header.Get(publish.HeaderCreatedAt); got != "2024-05-01T10:00:00.000Z" {
				t.Errorf("created at header %q, want 2024-05-01T10:00:00.000Z", got)
			}
		}
	}
}

// TestNonTextIdentitiesAreRefused: SQLite never finds a BLOB equal to the
// TEXT of the same bytes, so a BLOB event_id passes the unique index beside
// the TEXT id it spells and would be dropped by the broker as its duplicate
// (the row marked done, its event lost), and a BLOB ordering_key would be a
// second key to the claim while its messages say the first. Both rows are
// dead-lettered at once with the reason; the TEXT rows flow in order.
func TestNonTextIdentitiesAreRefused(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('abc', 'Thing', 'text id')`)
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (X'616263', 'Thing', 'blob id')`)
	for i, key := range []string{"'k1'", "X'6b31'", "'k1'", "'k1'"} {
		testenv.MustExec(t, app, fmt.Sprintf(`INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES ('key-%d', 'Thing', 'x', %s)`, i, key))
	}
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 6, 20*time.Second)
	var blobIDStatus, blobIDError string
	if err := app.QueryRow(`SELECT status, last_error FROM event_queue WHERE typeof(event_id) = 'blob'`).Scan(&blobIDStatus, &blobIDError); err != nil {
		t.Fatal(err)
	}
	if blobIDStatus != "dead_lettered" || !strings.Contains(blobIDError, "event_id is a BLOB") {
		t.Errorf("the BLOB event_id row: %s %q; want dead_lettered naming event_id as a BLOB", blobIDStatus, blobIDError)
	}
	if r := rowByEventID(t, app, "key-1"); r.status != "dead_lettered" || !strings.Contains(r.lastError, "ordering_key is a BLOB") {
		t.Errorf("the BLOB ordering_key row: %s %q; want dead_lettered naming ordering_key as a BLOB", r.status, r.lastError)
	}
	// status and the parked-keys gauge agree: the BLOB-keyed dead letter
	// parks no key.
	var parked int
	if err := app.QueryRow(`SELECT count(*) FROM (` + schema.ParkedKeysSQL("event_queue") + `)`).Scan(&parked); err != nil || parked != 0 {
		t.Errorf("%d keys parked (%v), want none", parked, err)
	}
	var got []string
	for _, m := range testenv.StreamMessages(t, n.JetStream(t), "EVENTS") {
		got = append(got, m.Header.Get(publish.HeaderMsgID)+"="+string(m.Data))
	}
	if want := "abc=text id,key-0=x,key-2=x,key-3=x"; strings.Join(got, ",") != want {
		t.Errorf("stream holds %v, want %s", got, want)
	}
}

// TestCreatedAtOutsideRFC3339IsRefused: Outbox-Created-At is RFC 3339,
// which writes the years 0000 to 9999 only; a created_at past them (a time
// in microseconds, say) is dead-lettered with the reason, not published
// with a header no consumer can parse.
func TestCreatedAtOutsideRFC3339IsRefused(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	ins := `INSERT INTO event_queue (event_id, event_type, payload, created_at, available_at) VALUES (?, 'Thing', 'x', ?, 0)`
	testenv.MustExec(t, app, ins, "now", time.Now().UnixMilli())
	testenv.MustExec(t, app, ins, "year-10000", time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC).UnixMilli()+2000)
	testenv.MustExec(t, app, ins, "microseconds", time.Now().UnixMicro())
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 3, 20*time.Second)
	if r := rowByEventID(t, app, "now"); r.status != "done" {
		t.Errorf("row now: %s %q, want done", r.status, r.lastError)
	}
	for _, id := range []string{"year-10000", "microseconds"} {
		if r := rowByEventID(t, app, id); r.status != "dead_lettered" || !strings.Contains(r.lastError, "created_at") {
			t.Errorf("row %s: %s %q; want dead_lettered naming created_at", id, r.status, r.lastError)
		}
	}
}
