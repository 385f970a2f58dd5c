package claim

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// insertKeyed inserts one row per key in keys ("" for none) and returns
// their ids.
func insertKeyed(t *testing.T, db *sql.DB, keys ...string) []int64 {
	t.Helper()
	evs := make([]testenv.Event, len(keys))
	for i, k := range keys {
		evs[i] = testenv.NewEvent("Keyed", []byte(k))
		evs[i].OrderingKey = k
	}
	return testenv.InsertIDs(t, db, evs...)
}

// claimIDs claims up to 100 rows and returns their ids.
func claimIDs(t *testing.T, s *Store) []int64 {
	t.Helper()
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	ids := []int64{}
	for _, r := range rows {
		ids = append(ids, r.ID)
	}
	return ids
}

func wantIDs(t *testing.T, what string, got []int64, want ...int64) {
	t.Helper()
	if want == nil {
		want = []int64{}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("%s: claimed %v, want %v", what, got, want)
	}
}

// settleAll settles rows: done unless outs says otherwise.
func settleAll(t *testing.T, s *Store, rows []event.Row, outs map[int64]event.Outcome) {
	t.Helper()
	var all []event.Outcome
	for _, r := range rows {
		o, ok := outs[r.ID]
		if !ok {
			o = event.Outcome{Settlement: event.Done}
		}
		o.Row = r
		all = append(all, o)
	}
	if stale, err := s.Settle(context.Background(), all, 0); err != nil || len(stale) > 0 {
		t.Fatalf("settle: stale %v, %v", stale, err)
	}
}

// TestRowSettledDuringTheReadIsInFlight: a claim's read can show a row
// pending that a settle committed meanwhile and let go of; the next row of
// its key may still follow it (it was in flight when the read began),
// instead of waiting a rescan interval. Only until the next claim begins:
// by then the table shows what the row became.
func TestRowSettledDuringTheReadIsInFlight(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "a")
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil || len(rows) != 1 {
		t.Fatal(rows, err)
	}
	settleAll(t, s, rows, nil) // committed after the read below began
	next := []event.Row{{ID: ids[0] + 1, OrderingKey: "a"}}
	asRead := []prevRow{{ID: sql.NullInt64{Int64: ids[0], Valid: true}, Status: sql.NullString{String: "pending", Valid: true}}}
	if kept, _ := s.order(next, asRead, nil, len(next), nil); len(kept) != 1 {
		t.Fatalf("the row after one settled during the read waits: kept %v", kept)
	}
	// The next claim begins: a row the table shows pending and no claim
	// holds is one to wait for (retried for later, say).
	if _, err := s.Claim(context.Background(), 100, 0); err != nil {
		t.Fatal(err)
	}
	if kept, _ := s.order(next, asRead, nil, len(next), nil); len(kept) != 0 {
		t.Fatalf("the row after a pending row nobody holds is kept: %v", kept)
	}
}

// TestKeyWaitsBehindItsRetriedRow: the rows of a key come in id order in
// one claim; after its first row is retried, the rest of the key waits
// (also rows written later) while other keys and unordered rows go on,
// and once the row is due the key comes back in order.
func TestKeyWaitsBehindItsRetriedRow(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	const a = `o"r.d[e]r $1 ü` // a key is any text: quotes, dots, brackets
	ids := insertKeyed(t, db, a, "b", a, "", a)
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil || len(rows) != 5 || rows[0].OrderingKey != a || rows[1].OrderingKey != "b" || rows[3].OrderingKey != "" {
		t.Fatalf("first claim %+v %v", rows, err)
	}
	later := time.Now().Add(time.Hour)
	settleAll(t, s, rows, map[int64]event.Outcome{
		ids[0]: {Settlement: event.Retry, Attempts: 1, AvailableAt: later, Error: "denied"},
		ids[2]: {Settlement: event.Release, AvailableAt: time.Now(), Reason: "ordering"},
		ids[4]: {Settlement: event.Release, AvailableAt: time.Now(), Reason: "ordering"},
	})
	more := insertKeyed(t, db, "b", a, "")
	wantIDs(t, "behind the retried row", claimIDs(t, s), more[0], more[2])
	// The retried row becomes due: its key follows in order.
	testenv.MustExec(t, db, `UPDATE event_queue SET available_at = 0 WHERE id = ?`, ids[0])
	s.Rescan()
	wantIDs(t, "once the retried row is due", claimIDs(t, s), ids[0], ids[2], ids[4], more[1])
}

// TestDeadLetterHoldsItsKey: by default a dead letter keeps its key's
// later rows waiting until it is retried; with SkipDeadLetters they go on.
func TestDeadLetterHoldsItsKey(t *testing.T) {
	for _, skip := range []bool{false, true} {
		t.Run(fmt.Sprintf("skip=%v", skip), func(t *testing.T) {
			s := New(testenv.MigratedDB(t), Options{SkipDeadLetters: skip})
			db := testenv.AppDB(t, s.db.Path())
			ids := insertKeyed(t, db, "a", "a", "b")
			rows, err := s.Claim(context.Background(), 100, 0)
			if err != nil || len(rows) != 3 {
				t.Fatal(rows, err)
			}
			settleAll(t, s, rows, map[int64]event.Outcome{
				ids[0]: {Settlement: event.DeadLetter, Attempts: 10, Error: "rejected"},
				ids[1]: {Settlement: event.Release, AvailableAt: time.Now(), Reason: "ordering"},
			})
			more := insertKeyed(t, db, "a")
			if skip {
				wantIDs(t, "past a skipped dead letter", claimIDs(t, s), ids[1], more[0])
				return
			}
			wantIDs(t, "behind a held dead letter", claimIDs(t, s))
			// An operator's retry: the row is pending again, and first.
			testenv.MustExec(t, db, `UPDATE event_queue SET status = 'pending', attempts = 0, processed_at = NULL WHERE id = ?`, ids[0])
			s.Rescan()
			wantIDs(t, "after the retry", claimIDs(t, s), ids[0], ids[1], more[0])
		})
	}
}

// TestRowOfAnotherStatusHoldsItsKey: a row in a status the relay does not
// write (queued, the application's own) is not done: the rows after it of
// its key wait, while other keys go on; once it is pending again, the key
// follows in order.
func TestRowOfAnotherStatusHoldsItsKey(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "a", "a", "b")
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'queued' WHERE id = ?`, ids[0])
	wantIDs(t, "behind a queued row", claimIDs(t, s), ids[2])
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'pending' WHERE id = ?`, ids[0])
	s.Rescan()
	wantIDs(t, "once it is pending", claimIDs(t, s), ids[0], ids[1])
}

// TestDueRowBelowTheCursorKeepsItsKey: a row of a key that became due
// below the rows in flight is not read by a claim past them, so a later
// row of its key waits for the claim that reads it (which takes both, in
// order).
func TestDueRowBelowTheCursorKeepsItsKey(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "a", "", "a", "")
	testenv.MustExec(t, db, `UPDATE event_queue SET available_at = ? WHERE id = ?`, time.Now().Add(time.Hour).UnixMilli(), ids[2])
	wantIDs(t, "first claim", claimIDs(t, s), ids[0], ids[1], ids[3])
	// Still in flight; the scheduled row becomes due, and a new row of its
	// key arrives past the rows in flight.
	testenv.MustExec(t, db, `UPDATE event_queue SET available_at = 0 WHERE id = ?`, ids[2])
	more := insertKeyed(t, db, "a", "")
	wantIDs(t, "past the rows in flight", claimIDs(t, s), more[1])
	s.Rescan()
	wantIDs(t, "the whole index", claimIDs(t, s), ids[2], more[0])
}

// TestKeyDepthLeavesRoom: a key holds at most KeyDepth rows in flight;
// the rows left behind (and later rows of the key) wait, other rows do
// not, and the claim takes them again once the key has drained to half.
func TestKeyDepthLeavesRoom(t *testing.T) {
	s := New(testenv.MigratedDB(t), Options{KeyDepth: 2})
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "a", "a", "a", "a", "", "a")
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := []int64{}
	for _, r := range rows {
		got = append(got, r.ID)
	}
	wantIDs(t, "a key of depth 2", got, ids[0], ids[1], ids[4])
	if !s.Waiting() {
		t.Fatal("rows left behind, but not Waiting")
	}
	more := insertKeyed(t, db, "a", "b")
	// The full key's rows do not use up the claim's limit, even in a
	// claim that reads the whole index.
	s.Rescan()
	if next, err := s.Claim(context.Background(), 1, 0); err != nil || len(next) != 1 || next[0].ID != more[1] {
		t.Fatalf("claim of 1 while the key is full: %+v %v, want row %d", next, err, more[1])
	}
	settleAll(t, s, rows[:1], nil) // one of the key settles: half the room is free
	if !s.Waiting() {
		t.Fatal("the key drained to half, but not Waiting: the relay would claim only at the next poll")
	}
	wantIDs(t, "once the key has room", claimIDs(t, s), ids[2])
	if !s.Waiting() {
		t.Fatal("rows left behind again, but not Waiting")
	}
}

// TestFullKeyIsWaiting: a key filled to KeyDepth by claims that each took
// all they read leaves nothing behind that a claim saw (the next claim
// leaves the key out unread), yet its later rows wait for room: the relay
// must claim again as rows settle, not at the next poll.
func TestFullKeyIsWaiting(t *testing.T) {
	s := New(testenv.MigratedDB(t), Options{KeyDepth: 2})
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "a", "a", "a")
	var held []event.Row
	for i := range 2 {
		rows, err := s.Claim(context.Background(), 1, 0)
		if err != nil || len(rows) != 1 || rows[0].ID != ids[i] {
			t.Fatalf("claim %d of one row: %+v %v", i, rows, err)
		}
		held = append(held, rows...)
	}
	if rows, err := s.Claim(context.Background(), 10, 0); err != nil || len(rows) != 0 {
		t.Fatalf("claim while the key is full: %+v %v", rows, err)
	}
	if !s.Waiting() {
		t.Fatal("the key is full and has a row due, but not Waiting")
	}
	settleAll(t, s, held[:1], nil)
	wantIDs(t, "once the key has room", claimIDs(t, s), ids[2])
}

// TestWaitingKeyDoesNotStarveOthers: a parked key with many rows at the
// front of the table costs the others nothing: a claim that reads only
// rows of keys that wait reads again past them, and the key is left alone
// until the store looks again. That holds for a claim of one row too (a
// broker's trial after an outage), and when the byte budget cuts the read.
func TestWaitingKeyDoesNotStarveOthers(t *testing.T) {
	for _, c := range []struct {
		limit    int
		maxBytes int64
	}{{10, 0}, {1, 0}, {10, 5}} { // the last: the byte budget cuts the read
		limit := c.limit
		s := newStore(t)
		db := testenv.AppDB(t, s.db.Path())
		keys := make([]string, 31)
		for i := range keys {
			keys[i] = "a"
		}
		ids := insertKeyed(t, db, keys...)
		testenv.MustExec(t, db, `UPDATE event_queue SET status = 'dead_lettered', attempts = 10 WHERE id = ?`, ids[0])
		others := insertKeyed(t, db, "", "b", "")
		got := []int64{}
		rows, err := s.Claim(context.Background(), limit, c.maxBytes)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			got = append(got, r.ID)
		}
		wantIDs(t, fmt.Sprintf("a claim of %d rows, %d bytes", limit, c.maxBytes), got, others[:min(limit, len(others))]...)
	}
}

// TestTrialRowFoundBehindManyWaitingKeys: after an outage the relay tries
// one row. With thousands of keys parked behind dead letters at the head of
// the table, a claim of one row still finds the due row behind them
// (before, it gave up after 32 reads of one row each, and the outage
// lasted until the deferred rows came due, a minute later).
func TestTrialRowFoundBehindManyWaitingKeys(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
		INSERT INTO event_queue (event_id, event_type, payload, status, ordering_key) SELECT 'dead-' || i, 'T', 'x', 'dead_lettered', 'k' || i FROM n`)
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
		INSERT INTO event_queue (event_id, event_type, payload, ordering_key) SELECT 'parked-' || i, 'T', 'x', 'k' || i FROM n`)
	free := insertKeyed(t, db, "", "free")
	rows, err := s.Claim(context.Background(), 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := []int64{}
	for _, r := range rows {
		got = append(got, r.ID)
	}
	wantIDs(t, "a claim of one row behind 2,000 parked keys", got, free[0])
	wantIDs(t, "the next claim", claimIDs(t, s), free[1])
}

// TestParkedKeysAreNotReadAgainUntilDeadLettersChange: a key parked behind
// a dead letter waits until an operator retries or discards it, so claims
// do not read its rows again at every look (an idle relay with 10,000
// parked keys spent 15 % of a core reading them); a retry brings the key
// back at the next look.
func TestParkedKeysAreNotReadAgainUntilDeadLettersChange(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)
		INSERT INTO event_queue (event_id, event_type, payload, status, ordering_key) SELECT 'dead-' || i, 'T', 'x', 'dead_lettered', 'k' || i FROM n`)
	testenv.MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)
		INSERT INTO event_queue (event_id, event_type, payload, ordering_key) SELECT 'parked-' || i, 'T', 'x', 'k' || i FROM n`)
	look := func() []int64 {
		s.mu.Lock()
		s.held.nextLook = time.Time{}
		s.mu.Unlock()
		return claimIDs(t, s)
	}
	for i := 0; i < 3; i++ { // the first looks find the keys and note the dead letters
		wantIDs(t, "a look at the parked keys", look())
	}
	before := s.rowsRead.Load()
	wantIDs(t, "a look with the dead letters unchanged", look())
	if read := s.rowsRead.Load() - before; read > 0 {
		t.Fatalf("a look with the dead letters unchanged read %d rows again", read)
	}
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'pending', attempts = 0 WHERE event_id = 'dead-7'`)
	var retried, behind int64
	db.QueryRow(`SELECT id FROM event_queue WHERE event_id = 'dead-7'`).Scan(&retried)
	db.QueryRow(`SELECT id FROM event_queue WHERE event_id = 'parked-7'`).Scan(&behind)
	wantIDs(t, "the look after a retry", look(), retried, behind)
}

// forceLook makes the next claim a look (as if Options.Rescan had passed).
func forceLook(s *Store) {
	s.mu.Lock()
	s.held.nextLook = time.Time{}
	s.mu.Unlock()
}

// TestRequeueSoonAfterALookIsSeen: an operator requeues the dead
// letter that parks a key less than Options.Rescan after the relay's last
// look (for instance the second batch of `dead-letters retry`, or right
// after any application commit). The wake-up claim is not a look, so the
// key stays set aside and the claim takes nothing; Quiet then says nothing
// can come for an hour, so the relay's idle waits maxQuiet (1 min) instead
// of Rescan (1 s).
func TestRequeueSoonAfterALookIsSeen(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "k", "k")
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'dead_lettered' WHERE id = ?`, ids[0])
	// Two looks: the key is parked and the dead letters' print recorded.
	wantIDs(t, "first look", claimIDs(t, s))
	forceLook(s)
	wantIDs(t, "second look", claimIDs(t, s))
	// An application commit wakes the relay: a look (nextLook passed).
	forceLook(s)
	insertKeyed(t, db, "k") // a row behind the parked key
	wantIDs(t, "claim after the application's commit", claimIDs(t, s))
	// Within Rescan of that look, the operator requeues the dead letter
	// (what admin.Requeue writes); the watch wakes the claimer.
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'pending', attempts = 0, available_at = ?, processed_at = NULL WHERE id = ?`,
		time.Now().UnixMilli(), ids[0])
	if got := claimIDs(t, s); len(got) == 0 || got[0] != ids[0] {
		t.Fatalf("the claim after the requeue took %v, want the requeued dead letter %d first", got, ids[0])
	}
}

// TestDeadLetterPrintSeesAnEqualSum: dead letters 10 and 30 park keys k1 and
// k2; within one look interval the relay dead-letters rows 15 and 25 (rows
// without a key, invalid) and an operator discards 10 and 30. Count and id
// sum are unchanged, so the parked keys are never read again, although
// nothing holds them any more (until some other dead letter changes).
func TestDeadLetterPrintSeesAnEqualSum(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ins := func(id int64, key, status string) {
		var k any
		if key != "" {
			k = key
		}
		testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, ordering_key) VALUES (?, ?, 'T', 'x', ?, ?)`,
			id, event.NewID(), status, k)
	}
	ins(10, "k1", "dead_lettered")
	ins(11, "k1", "pending")
	ins(15, "", "pending")
	ins(25, "", "pending")
	ins(30, "k2", "dead_lettered")
	ins(31, "k2", "pending")
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, r := range rows {
		got = append(got, r.ID)
	}
	wantIDs(t, "first claim", got, 15, 25)
	forceLook(s)
	wantIDs(t, "a look that records the print (2 dead letters, sum 40)", claimIDs(t, s))
	// The relay dead-letters 15 and 25 (say max attempts), the operator
	// discards 10 and 30: 2 dead letters, sum 40 again.
	settleAll(t, s, rows, map[int64]event.Outcome{
		15: {Settlement: event.DeadLetter, Error: "x"}, 25: {Settlement: event.DeadLetter, Error: "x"}})
	testenv.MustExec(t, db, `DELETE FROM event_queue WHERE id IN (10, 30) AND status = 'dead_lettered'`)
	for i := 0; i < 3; i++ {
		forceLook(s)
		if got := claimIDs(t, s); len(got) == 0 {
			if i == 2 {
				t.Fatalf("rows 11 and 31 are never claimed: nothing holds k1 and k2, but the dead letters' print did not change")
			}
			continue
		}
		return
	}
}

// TestDeadLetterPrintOfLargeIDs: sum(id) is SQLite's integer sum,
// which raises "integer overflow" instead of wrapping. With large ids (an
// application that sets them, schema.mode off), every look fails the claim,
// and the relay never claims again while a key is parked.
func TestDeadLetterPrintOfLargeIDs(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	for i, id := range []int64{5e18, 5e18 + 1, 5e18 + 2} {
		status := "dead_lettered"
		if i > 0 {
			status = "pending"
		}
		testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, ordering_key) VALUES (?, ?, 'T', 'x', ?, 'k')`,
			id, event.NewID(), status)
	}
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status) VALUES (6e18, 'd2', 'T', 'x', 'dead_lettered')`)
	claimIDs(t, s) // parks k
	forceLook(s)
	_, err := s.Claim(context.Background(), 100, 0)
	if err != nil && strings.Contains(err.Error(), "overflow") {
		t.Fatalf("every look now fails: %v", err)
	}
}

// TestIntegerOrderingKeyColumn: an application table (schema.mode
// verify or off; Verify checks only the time columns' affinity) whose
// ordering_key column is declared INTEGER, keyed by an aggregate's integer
// id. Before 7d0cafe such keys were consistent in SQL (42 = 42, and the
// skip list's '42' takes the column's affinity); now every keyed row comes
// back with Problem and is dead-lettered at once.
func TestIntegerOrderingKeyColumn(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	testenv.MustExec(t, db, `DROP INDEX IF EXISTS event_queue_ordering`)
	testenv.MustExec(t, db, `ALTER TABLE event_queue DROP COLUMN ordering_key`)
	testenv.MustExec(t, db, `ALTER TABLE event_queue ADD COLUMN ordering_key INTEGER`)
	testenv.MustExec(t, db, `CREATE INDEX event_queue_ordering ON event_queue (ordering_key, id) WHERE ordering_key IS NOT NULL`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES ('a', 'T', 'x', 42), ('b', 'T', 'x', 42)`)
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) == 0 {
		t.Fatal("no row of key 42 claimed")
	}
	for _, r := range rows {
		if r.Problem != "" || r.OrderingKey != "42" {
			t.Errorf("row %d (key 42 in an INTEGER column): key %q, problem %q", r.ID, r.OrderingKey, r.Problem)
		}
	}
}

// TestRowLeftOutKeepsTheOthersIDs: a claim that leaves out a row without
// an event_id (its key waits) still gives the rows it takes after it
// theirs.
func TestRowLeftOutKeepsTheOthersIDs(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "a")
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil || len(rows) != 1 {
		t.Fatal(rows, err)
	}
	settleAll(t, s, rows, map[int64]event.Outcome{ids[0]: {Settlement: event.Retry, Attempts: 1, Error: "refused", AvailableAt: time.Now().Add(time.Hour)}})
	testenv.InsertIDs(t, db, testenv.Event{EventType: "T", Payload: []byte("x"), OrderingKey: "a"}, testenv.Event{EventType: "T", Payload: []byte("x")})
	rows, err = s.Claim(context.Background(), 100, 0)
	if err != nil || len(rows) != 1 || rows[0].ID != ids[0]+2 || rows[0].EventID == "" {
		t.Fatalf("claimed %+v (%v): want the row without a key, with an event id", rows, err)
	}
}
