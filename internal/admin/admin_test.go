package admin

import (
	"context"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/claim"
	"github.com/outbox-relay/outbox-relay/internal/lead"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestOneRelayLeads: of the relays heartbeating on one file, the
// longest-running leads; status marks it, and when it leaves the next one
// leads.
func TestOneRelayLeads(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	first, second := lead.New(db), lead.New(testenv.OpenDB(t, db.Path()))
	for _, l := range []*lead.Lease{first, second, first} {
		inFlight := 0
		if l == first {
			inFlight = 3
		}
		if _, err := l.Heartbeat(ctx, "test", inFlight, time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // started_at orders the relays
	}
	if !first.Leads() || second.Leads() {
		t.Fatalf("first leads %v, second leads %v; want the first only", first.Leads(), second.Leads())
	}
	st, err := ReadStatus(ctx, db, StatusOptions{LastDead: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Relays) != 2 || !st.Relays[0].Leader || st.Relays[0].ID != first.Instance() || st.Relays[1].Leader {
		t.Fatalf("status relays %+v; want the first marked leader", st.Relays)
	}
	if st.Relays[0].InFlight != 3 || st.Relays[1].InFlight != 0 {
		t.Fatalf("status relays %+v; want 3 rows in flight at the leader", st.Relays)
	}
	if err := first.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := second.Heartbeat(ctx, "test", 0, time.Hour, time.Minute); err != nil || !second.Leads() {
		t.Fatalf("after the leader left, the second leads %v (%v)", second.Leads(), err)
	}
}

// TestSilentRelayIsPresumedDead: a relay killed without cleaning up
// leaves its heartbeat row, the longest-running one; past StaleAfter it is
// presumed dead and does not lead, and the live relay beside it is not
// taken for the leader either until the dead one's row is gone (the
// relays' own rule). Without StaleAfter nothing is judged.
func TestSilentRelayIsPresumedDead(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	live := lead.New(testenv.OpenDB(t, db.Path()))
	now := time.Now()
	testenv.MustExec(t, testenv.AppDB(t, db.Path()), `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, in_flight)
		VALUES ('killed', ?, ?, 'host', 4242, 'test', 7)`, now.Add(-time.Hour).UnixMilli(), now.Add(-35*time.Second).UnixMilli())
	if _, err := live.Heartbeat(ctx, "test", 0, time.Hour, time.Hour); err != nil {
		t.Fatal(err)
	}
	st, err := ReadStatus(ctx, db, StatusOptions{StaleAfter: 6 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Relays) != 2 || st.Relays[0].ID != "killed" || !st.Relays[0].PresumedDead || st.Relays[0].Leader ||
		st.Relays[1].PresumedDead || st.Relays[1].Leader {
		t.Fatalf("relays %+v; want the killed one presumed dead, and neither leading", st.Relays)
	}
	if st, err = ReadStatus(ctx, db, StatusOptions{}); err != nil || st.Relays[0].PresumedDead || !st.Relays[0].Leader {
		t.Fatalf("without StaleAfter: %+v %v; want the longest-running one leading", st.Relays, err)
	}
}

// TestStatusListsTheTablesRelays: relays of another outbox table in the
// same file lead their own table and are not listed; a row from a relay
// that predates outbox_table counts for every table.
func TestStatusListsTheTablesRelays(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	app := testenv.AppDB(t, db.Path())
	now := time.Now()
	for i, table := range []any{"orders_outbox", nil, "EVENT_QUEUE"} {
		testenv.MustExec(t, app, `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, in_flight, outbox_table)
			VALUES (?, ?, ?, 'host', 1, 'test', 0, ?)`, fmt.Sprint("relay-", i), now.Add(time.Duration(i)*time.Second).UnixMilli(), now.UnixMilli(), table)
	}
	st, err := ReadStatus(ctx, db, StatusOptions{StaleAfter: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Relays) != 2 || st.Relays[0].ID != "relay-1" || !st.Relays[0].Leader || st.Relays[1].ID != "relay-2" || st.Relays[1].Leader {
		t.Fatalf("relays of event_queue %+v; want relay-1 (no table named) leading, relay-2 standing by", st.Relays)
	}
}

// TestStatusShowsTheStreamPosition: status says from where the next
// leader reconciles, the table's own row of outbox_relay_published; none
// before a relay first reconciled it.
func TestStatusShowsTheStreamPosition(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	app := testenv.AppDB(t, db.Path())
	report := func() (Status, string) {
		st, err := ReadStatus(ctx, db, StatusOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		StatusReport{Status: st}.Print(&b, time.Now())
		return st, b.String()
	}
	if st, text := report(); st.Position != nil || strings.Contains(text, "reconciles from") {
		t.Fatalf("a table never reconciled: %+v\n%s", st.Position, text)
	}
	testenv.MustExec(t, app, `INSERT INTO `+schema.PublishedTable+` (outbox_table, origin, stream, stream_created, scan_from, updated_at) VALUES
		('orders_outbox', 'other', 'ORDERS', 1, 7, 1), ('event_queue', 'o-1', 'EVENTS', 1, 1201, 1)`)
	st, text := report()
	if st.Position == nil || *st.Position != (Position{Origin: "o-1", Stream: "EVENTS", ScanFrom: 1201, Updated: time.UnixMilli(1)}) {
		t.Fatalf("position %+v", st.Position)
	}
	if want := "reconciles from     sequence 1201 of stream EVENTS, when a relay next begins to lead (origin o-1)"; !strings.Contains(text, want) {
		t.Fatalf("status says:\n%s\nwant a line %q", text, want)
	}
}

// parked returns a ParkedKey as testenv.InsertParkedKeys writes them.
func parked(key string, id, processed int64, lastError string, waiting int64) ParkedKey {
	return ParkedKey{OrderingKey: key, WaitingRows: waiting, DeadLetter: DeadLetter{ID: id, EventID: fmt.Sprint("e", id), EventType: fmt.Sprint("T", id),
		LastError: lastError, ProcessedAt: time.UnixMilli(processed)}}
}

// TestStatusListsParkedKeys: status counts and lists the keys a dead
// letter parks, longest parked first, each with its earliest dead letter
// and the pending rows after it; none when dead letters park nothing
// (skip) or no ordering_key column. A retried or deleted dead letter
// releases its key, and the key's next dead letter, if any, parks it.
func TestStatusListsParkedKeys(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	app := testenv.AppDB(t, db.Path())
	testenv.InsertParkedKeys(t, app)
	check := func(o StatusOptions, count int64, want ...ParkedKey) {
		t.Helper()
		st, err := ReadStatus(ctx, db, o)
		if err != nil {
			t.Fatal(err)
		}
		if st.ParkedKeyCount != count || st.ParkedKeys == nil || !reflect.DeepEqual(st.ParkedKeys, append([]ParkedKey{}, want...)) {
			t.Errorf("with %+v: %d parked keys %+v; want %d, listed %+v", o, st.ParkedKeyCount, st.ParkedKeys, count, want)
		}
	}
	a := parked("a", 2, 2000, "nats: permission denied", 2)
	b := parked("b", 8, 1000, "message size exceeds maximum allowed", 1)
	check(StatusOptions{Parks: true, ParkedKeys: 10}, 2, b, a)
	check(StatusOptions{Parks: true, ParkedKeys: 1}, 2, b)
	check(StatusOptions{ParkedKeys: 10}, 0)

	if b, err := Requeue(ctx, db, Selection{IDs: []int64{8}}, false); err != nil || b.Changed != 1 {
		t.Fatalf("retry row 8: %+v %v", b, err)
	}
	check(StatusOptions{Parks: true, ParkedKeys: 10}, 1, a)
	testenv.MustExec(t, app, `DELETE FROM event_queue WHERE id = 2`)
	check(StatusOptions{Parks: true, ParkedKeys: 10}, 1, parked("a", 4, 4000, "a later one", 1))

	// A file from before ordering keys (migration 105) has none parked.
	testenv.MustExec(t, app, `DROP INDEX event_queue_ordering`)
	testenv.MustExec(t, app, `ALTER TABLE event_queue DROP COLUMN ordering_key`)
	check(StatusOptions{Parks: true, ParkedKeys: 10}, 0)
}

// TestParkedKeysAreTheKeysThatWait: a key is parked when its rows wait
// behind a dead letter: one whose next row of the key is pending, or that
// is the key's last row (the next one written will wait). A dead letter
// that later rows of its key already passed (with ordering.on_dead_letter:
// skip, before a switch to hold) parks nothing, and a hold-mode claim
// takes the key's pending rows: status and the claim agree.
func TestParkedKeysAreTheKeysThatWait(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	app := testenv.AppDB(t, db.Path())
	for _, r := range []struct {
		id          int
		key, status string
	}{
		{1, "passed", "dead_lettered"}, {2, "passed", "done"}, {3, "passed", "pending"},
		{4, "last", "done"}, {5, "last", "dead_lettered"},
		{6, "twice", "dead_lettered"}, {7, "twice", "dead_lettered"}, {8, "twice", "pending"},
	} {
		testenv.MustExec(t, app, `INSERT INTO event_queue (id, event_id, event_type, payload, status, processed_at, ordering_key)
			VALUES (?1, 'e' || ?1, 'T' || ?1, 'x', ?2, CASE WHEN ?2 = 'pending' THEN NULL ELSE ?1 END, ?3)`, r.id, r.status, r.key)
	}
	st, err := ReadStatus(ctx, db, StatusOptions{Parks: true, ParkedKeys: 10})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range st.ParkedKeys {
		got = append(got, fmt.Sprintf("%s@%d+%d", p.OrderingKey, p.ID, p.WaitingRows))
	}
	if want := "[last@5+0 twice@6+1]"; st.ParkedKeyCount != 2 || fmt.Sprint(got) != want {
		t.Fatalf("%d parked keys %v; want 2: %s", st.ParkedKeyCount, got, want)
	}
	rows, err := claim.New(db, claim.Options{}).Claim(ctx, 10, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1 || rows[0].ID != 3 {
		t.Fatalf("a hold-mode claim took %v; want row 3 alone (its key is not parked)", rows)
	}
}

// TestParkedKeysReadTheOrderingIndex: on a table of many done rows,
// unordered dead letters and pending rows with keys (and statistics
// gathered), the parked keys are found through the dead letters' index,
// each one's next row and the waiting rows through the ordering index,
// without a scan of the table.
func TestParkedKeysReadTheOrderingIndex(t *testing.T) {
	db := testenv.MigratedDB(t)
	app := testenv.AppDB(t, db.Path())
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000)
		INSERT INTO event_queue (event_id, event_type, payload, status, processed_at, ordering_key) SELECT 'done-' || i, 'T', 'x', 'done', 1, 'k' || (i % 500) FROM n`)
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
		INSERT INTO event_queue (event_id, event_type, payload, status, processed_at) SELECT 'dead-' || i, 'T', 'x', 'dead_lettered', 1 FROM n`)
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20)
		INSERT INTO event_queue (event_id, event_type, payload, status, processed_at, ordering_key) SELECT 'parked-' || i, 'T', 'x', 'dead_lettered', 1, 'k' || i FROM n`)
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 10000)
		INSERT INTO event_queue (event_id, event_type, payload, ordering_key) SELECT 'pending-' || i, 'T', 'x', 'k' || (i % 500) FROM n`)
	testenv.MustExec(t, app, `ANALYZE`)

	n, keys, err := parkedKeys(context.Background(), db.Reader(), "event_queue", 5)
	if err != nil || n != 20 || len(keys) != 5 || keys[0].WaitingRows != 20 {
		t.Fatalf("%d parked keys, listed %+v (%v); want 20, 5 listed, 20 rows waiting behind each", n, keys, err)
	}
	for _, q := range []string{`SELECT count(*) FROM (` + schema.ParkedKeysSQL("event_queue") + `)`, parkedSQL("event_queue")} {
		plan := testenv.QueryPlan(t, db, q, 5)
		if !strings.Contains(plan, "SCAN d USING INDEX event_queue_dead_lettered") || regexp.MustCompile(`SCAN (event_queue|d|n)($|;)`).MatchString(plan) ||
			!strings.Contains(plan, "SEARCH n USING INDEX event_queue_ordering (ordering_key=? AND id>?)") {
			t.Errorf("parked keys plan %q: want the dead letters' index, each one's next row sought on the ordering index, no scan of the table", plan)
		}
	}
	if plan := testenv.QueryPlan(t, db, parkedSQL("event_queue"), 5); !strings.Contains(plan, "SEARCH w USING INDEX event_queue_ordering (ordering_key=? AND id>?)") {
		t.Errorf("parked keys plan %q: want the waiting rows counted on the ordering index", plan)
	}
}

// TestStatusSaysGroupsAreHeld: status counts the pending rows of atomic
// groups, and says they are held while the leading relay publishes no
// atomic batches.
func TestStatusSaysGroupsAreHeld(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	app := testenv.AppDB(t, db.Path())
	evs := []testenv.Event{testenv.NewEvent("T", []byte("x")), testenv.NewEvent("T", []byte("x")), testenv.NewEvent("T", []byte("x"))}
	evs[0].AtomicGroup, evs[1].AtomicGroup = "g", "g"
	testenv.InsertIDs(t, app, evs...)
	l := lead.New(db)
	for _, limit := range []int{0, 1000} {
		l.ReportBatches(func() int { return limit })
		if _, err := l.Heartbeat(ctx, "test", 0, time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
		st, err := ReadStatus(ctx, db, StatusOptions{})
		if err != nil || st.PendingGrouped != 2 {
			t.Fatalf("pending rows in groups %d (%v), want 2", st.PendingGrouped, err)
		}
		var out strings.Builder
		StatusReport{Status: st}.Print(&out, time.Now())
		held := strings.Contains(out.String(), "2 rows of atomic groups held: the leading relay publishes no atomic batches")
		if held != (limit == 0) || !strings.Contains(out.String(), "atomic groups") {
			t.Fatalf("batch limit %d, status says:\n%s", limit, out.String())
		}
	}
}
