package daemon_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

var eventTypes = []string{"ReviewLogged", "ReviewDeleted", "MovieDeleted", "watchlist.item.added", "WrapUpCompleted"}

// TestEndToEnd: an application inserts 5,000 rows on its own connection
// while the relay runs; every row is published once, byte for byte, with
// its headers, and marked done.
func TestEndToEnd(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{})

	const total = 5000
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(1, 2))
		for written := 0; written < total; {
			k := min(1+rng.IntN(20), total-written)
			evs := make([]testenv.Event, k)
			for i := range evs {
				payload := make([]byte, rng.IntN(300))
				for j := range payload {
					payload[j] = byte(rng.IntN(256)) // binary, zero bytes included
				}
				evs[i] = testenv.NewEvent(eventTypes[rng.IntN(len(eventTypes))], payload)
				if rng.IntN(10) == 0 {
					evs[i].EventID = nil // a foreign writer's row: the relay assigns the id
				}
			}
			if err := testenv.Insert(app, evs...); err != nil {
				t.Error(err)
				return
			}
			written += k
			if rng.IntN(4) == 0 {
				time.Sleep(time.Millisecond)
			}
		}
	}()
	wg.Wait()
	counts := waitAllSettled(t, app, total, 60*time.Second)
	if counts["done"] != total {
		t.Fatalf("counts %v, want %d done", counts, total)
	}

	type rowData struct {
		id                  int64
		eventID, eventType  string
		payload             []byte
		createdAt           int64
		processedAt         sql.NullInt64
		claimedAt, claimedB sql.NullString
	}
	rows, err := app.Query(`SELECT id, event_id, event_type, payload, created_at, processed_at, claimed_at, claimed_by FROM event_queue`)
	if err != nil {
		t.Fatal(err)
	}
	byEventID := map[string]rowData{}
	for rows.Next() {
		var r rowData
		if err := rows.Scan(&r.id, &r.eventID, &r.eventType, &r.payload, &r.createdAt, &r.processedAt, &r.claimedAt, &r.claimedB); err != nil {
			t.Fatal(err)
		}
		if r.eventID == "" || !r.processedAt.Valid || r.claimedAt.Valid || r.claimedB.Valid {
			t.Fatalf("row %d after done: %+v", r.id, r)
		}
		byEventID[r.eventID] = r
	}
	rows.Close()
	if len(byEventID) != total {
		t.Fatalf("%d distinct event ids, want %d", len(byEventID), total)
	}

	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	if len(msgs) != total {
		t.Fatalf("stream holds %d messages, want %d", len(msgs), total)
	}
	seen := map[string]bool{}
	for _, m := range msgs {
		id := m.Header.Get(publish.HeaderMsgID)
		r, ok := byEventID[id]
		if !ok {
			t.Fatalf("message %d has Nats-Msg-Id %q matching no row", m.Sequence, id)
		}
		if seen[id] {
			t.Fatalf("event %s stored twice", id)
		}
		seen[id] = true
		if m.Subject != "events."+r.eventType {
			t.Errorf("row %d: subject %q, want events.%s", r.id, m.Subject, r.eventType)
		}
		if !bytes.Equal(m.Data, r.payload) {
			t.Errorf("row %d: body differs from payload", r.id)
		}
		if got := m.Header.Get(publish.HeaderEventType); got != r.eventType {
			t.Errorf("row %d: %s %q", r.id, publish.HeaderEventType, got)
		}
		if got := m.Header.Get(publish.HeaderRowID); got != strconv.FormatInt(r.id, 10) {
			t.Errorf("row %d: %s %q", r.id, publish.HeaderRowID, got)
		}
		created, err := time.Parse(time.RFC3339Nano, m.Header.Get(publish.HeaderCreatedAt))
		if err != nil || created.UnixMilli() != r.createdAt || !strings.HasSuffix(m.Header.Get(publish.HeaderCreatedAt), "Z") {
			t.Errorf("row %d: %s %q (%v), want %d in UTC", r.id, publish.HeaderCreatedAt, m.Header.Get(publish.HeaderCreatedAt), err, r.createdAt)
		}
	}
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	// Counters move after the commit that settles their rows: read them
	// once the relay has stopped.
	if got := metrics.Value(h.metrics.Published); got != total {
		t.Errorf("published_total %v, want %d", got, total)
	}
	h.noLockErrors()
}

// TestRedeliveryIsHarmless: rows whose ack was lost (reset to pending) are
// found in the stream by the next leader's reconciliation, or published
// again and answered as duplicates: nothing new is stored.
func TestRedeliveryIsHarmless(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	var evs []testenv.Event
	for i := 0; i < 1000; i++ {
		evs = append(evs, testenv.NewEvent("ReviewLogged", []byte(fmt.Sprint(i))))
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 1000, 30*time.Second)
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := app.Exec(`UPDATE event_queue SET status = 'pending', processed_at = NULL WHERE id % 3 = 0`); err != nil {
		t.Fatal(err)
	}
	h2 := startRelay(t, path, n.URL(), harnessOptions{})
	counts := waitAllSettled(t, app, 1000, 30*time.Second)
	if counts["done"] != 1000 {
		t.Fatalf("counts %v", counts)
	}
	if msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS"); len(msgs) != 1000 {
		t.Fatalf("stream holds %d messages after redelivery, want 1000", len(msgs))
	}
	if err := h2.stop(); err != nil {
		t.Fatal(err)
	}
	dups, published, reconciled := metrics.Value(h2.metrics.Duplicates), metrics.Value(h2.metrics.Published), metrics.Value(h2.metrics.Reconciled)
	if dups+reconciled != 333 || published != dups {
		t.Fatalf("duplicates_total %v, published_total %v, reconciled_rows_total %v: want the 333 rows reconciled or published as duplicates", dups, published, reconciled)
	}
}

// TestLegacyTableUpgradedAndPublished: a pre-0101 table with rows gets
// event ids, and the relay then publishes every row under its id.
func TestLegacyTableUpgradedAndPublished(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	path := dir + "/legacy.db"
	legacy, err := sql.Open("sqlite3", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	defer legacy.Close()
	for _, q := range []string{
		`CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_type TEXT NOT NULL, payload BLOB NOT NULL,
			status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
			available_at INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL DEFAULT 0,
			processed_at INTEGER, last_error TEXT)`,
		`WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 300)
			INSERT INTO event_queue (event_type, payload) SELECT 'LegacyThing', 'legacy ' || i FROM n`,
	} {
		if _, err := legacy.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := schema.Migrate(context.Background(), testenv.OpenDB(t, path)); err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	rows, err := legacy.Query(`SELECT event_id FROM event_queue`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		rows.Scan(&id)
		ids[id] = true
	}
	rows.Close()
	if len(ids) != 300 {
		t.Fatalf("%d distinct ids after upgrade, want 300", len(ids))
	}
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, legacy, 300, 30*time.Second)
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	if len(msgs) != 300 {
		t.Fatalf("stream holds %d, want 300", len(msgs))
	}
	for _, m := range msgs {
		if !ids[m.Header.Get(publish.HeaderMsgID)] {
			t.Fatalf("message with id %q not from the backfill", m.Header.Get(publish.HeaderMsgID))
		}
	}
}

// TestCoreMode publishes to a plain subscriber and settles the rows.
func TestCoreMode(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	sub, err := n.Conn(t).SubscribeSync("events.>")
	if err != nil {
		t.Fatal(err)
	}
	var evs []testenv.Event
	for i := 0; i < 200; i++ {
		evs = append(evs, testenv.NewEvent("CoreThing", []byte(fmt.Sprint("core ", i))))
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	startRelay(t, path, n.URL(), harnessOptions{mode: config.ModeCore})
	counts := waitAllSettled(t, app, 200, 30*time.Second)
	if counts["done"] != 200 {
		t.Fatalf("counts %v", counts)
	}
	got := map[string]bool{}
	for i := 0; i < 200; i++ {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("subscriber got %d of 200: %v", i, err)
		}
		if m.Subject != "events.CoreThing" || m.Header.Get(publish.HeaderMsgID) == "" {
			t.Fatalf("message %q %v", m.Subject, m.Header)
		}
		got[string(m.Data)] = true
	}
	if len(got) != 200 {
		t.Fatalf("%d distinct bodies", len(got))
	}
}

// TestInvalidEventTypesDeadLettered: rows whose type cannot form a subject
// are dead-lettered at once with the reason; the rows around them flow.
func TestInvalidEventTypesDeadLettered(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	bad := []string{"", "has space", "wild.*", "wild>", "double..dot", ".leading", "trailing.", strings.Repeat("long", 1250)}
	var evs []testenv.Event
	for i, b := range bad {
		evs = append(evs, testenv.NewEvent("Good", []byte(fmt.Sprint("before ", i))), testenv.NewEvent(b, []byte("bad")))
	}
	empty := ""
	evs = append(evs, testenv.Event{EventID: &empty, EventType: "EmptyID", Payload: []byte("no id")})
	evs = append(evs, testenv.NewEvent("Good", []byte("last")))
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{})
	counts := waitAllSettled(t, app, len(evs), 30*time.Second)
	if counts["done"] != len(bad)+1 || counts["dead_lettered"] != len(bad)+1 {
		t.Fatalf("counts %v", counts)
	}
	rows, err := app.Query(`SELECT event_type, last_error, attempts, processed_at IS NOT NULL FROM event_queue WHERE status = 'dead_lettered'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var typ, reason string
		var attempts int
		var processed bool
		rows.Scan(&typ, &reason, &attempts, &processed)
		if typ == "EmptyID" {
			if !strings.Contains(reason, "event_id is empty") {
				t.Errorf("empty event_id dead-lettered with %q", reason)
			}
			continue
		}
		if !strings.Contains(reason, "cannot form a subject") || !strings.Contains(reason, fmt.Sprintf("%.40q", typ)) || !processed {
			t.Errorf("dead letter %q: last_error %q processed %v", typ, reason, processed)
		}
	}
	metricsReach(t, h, map[string]float64{`outbox_relay_dead_lettered_total{reason="invalid"}`: float64(len(bad) + 1)})
	if msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS"); len(msgs) != len(bad)+1 {
		t.Fatalf("stream holds %d, want %d", len(msgs), len(bad)+1)
	}
}
