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

// insertGrouped inserts one row per {key, group} in one transaction and
// returns their ids.
func insertGrouped(t *testing.T, db *sql.DB, rows ...[2]string) []int64 {
	t.Helper()
	evs := make([]testenv.Event, len(rows))
	for i, r := range rows {
		evs[i] = testenv.NewEvent("Grouped", []byte(r[0]+r[1]))
		evs[i].OrderingKey, evs[i].AtomicGroup = r[0], r[1]
	}
	return testenv.InsertIDs(t, db, evs...)
}

// TestGroupIsClaimedWhole: a claim cut by its row limit or its byte budget
// in the middle of an atomic group takes the group's other rows too; rows
// of no group stay within the limit.
func TestGroupIsClaimedWhole(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	insertGrouped(t, db, [2]string{"", ""}, [2]string{"", "g"}, [2]string{"a", "g"}, [2]string{"", "g"}, [2]string{"", ""})
	rows, err := s.Claim(context.Background(), 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for _, r := range rows {
		ids = append(ids, r.ID)
		if (r.ID >= 2 && r.ID <= 4) != (r.Group == "g") {
			t.Fatalf("row %d read with group %q", r.ID, r.Group)
		}
	}
	wantIDs(t, "a claim of 2 rows cut in the group", ids, 1, 2, 3, 4)
	wantIDs(t, "the next claim", claimIDs(t, s), 5)

	// A byte budget of one row, the group first.
	s2 := newStore(t)
	db2 := testenv.AppDB(t, s2.db.Path())
	insertGrouped(t, db2, [2]string{"", "h"}, [2]string{"", "h"}, [2]string{"", ""})
	rows, err = s2.Claim(context.Background(), 100, 1)
	if err != nil || len(rows) != 2 {
		t.Fatalf("claim with a byte budget of 1: %d rows, %v; want the group's 2", len(rows), err)
	}
}

// TestGroupWaitsForEachOfItsKeys: a group is claimed only when, for every
// ordering key it has rows of, the rows before it are done or in flight;
// while it waits, so do the rows of its keys behind it, and its rows of
// no key.
func TestGroupWaitsForEachOfItsKeysInTheTable(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertKeyed(t, db, "a", "b")
	first, err := s.Claim(context.Background(), 100, 0)
	if err != nil || len(first) != 2 {
		t.Fatal(first, err)
	}
	insertGrouped(t, db, [2]string{"a", "g"}, [2]string{"", "g"}, [2]string{"b", "g"}, [2]string{"b", ""}, [2]string{"c", ""})
	// Rows 1 and 2 in flight: the group may follow them.
	wantIDs(t, "group behind rows in flight", claimIDs(t, s), 3, 4, 5, 6, 7)

	// Row 2 (key b) is retried: a new group with a row of b waits, and
	// so do its row without a key and b's row behind it.
	s2 := newStore(t)
	db2 := testenv.AppDB(t, s2.db.Path())
	ids = insertKeyed(t, db2, "a", "b")
	rows, err := s2.Claim(context.Background(), 100, 0)
	if err != nil || len(rows) != 2 {
		t.Fatal(rows, err)
	}
	settleAll(t, s2, rows, map[int64]event.Outcome{ids[1]: {Settlement: event.Retry, Attempts: 1, Error: "refused", AvailableAt: time.Now().Add(time.Hour)}})
	insertGrouped(t, db2, [2]string{"a", "g"}, [2]string{"", "g"}, [2]string{"b", "g"}, [2]string{"b", ""}, [2]string{"a", ""}, [2]string{"", ""})
	wantIDs(t, "group behind a retried row", claimIDs(t, s2), 8)
}

// TestInterleavedGroupIsDeadLettered: rows of one ordering key between a
// group's rows that are not in it (ids chosen by the application) make
// the group impossible to publish whole in the key's order: its rows come
// as rows of no group, each with a reason naming the row in between.
func TestInterleavedGroupIsDeadLettered(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, ordering_key, atomic_group) VALUES
		(10, 'e10', 'T', x'', 'a', 'g1'), (11, 'e11', 'T', x'', 'b', 'g2'), (12, 'e12', 'T', x'', 'a', 'g2'), (13, 'e13', 'T', x'', 'b', 'g1')`)
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := map[int64]event.Row{}
	for _, r := range rows {
		got[r.ID] = r
	}
	for _, id := range []int64{10, 13} {
		r, ok := got[id]
		if !ok || r.Group != "" || !strings.Contains(r.Problem, `atomic group "g1": row 11 of ordering key "b" lies between the group's rows 10 and 13`) {
			t.Fatalf("row %d: claimed %v, group %q, problem %q", id, ok, r.Group, r.Problem)
		}
	}
	// g2 (11, 12) follows row 10 of key a in flight.
	if r := got[11]; r.Group != "g2" || got[12].Group != "g2" {
		t.Fatalf("claimed %v, want g2 whole", rows)
	}
}

// TestPartlyRetriedGroupIsNotClaimedInPart: a group dead-lettered whole
// (too large for a batch, say), of which an operator puts back one row
// (`dead-letters retry ID`, admin.Requeue's statement), is not claimed as
// a group of that one row, which would be published alone: the row comes
// with a reason to be dead-lettered again.
func TestPartlyRetriedGroupIsNotClaimedInPart(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertGrouped(t, db, [2]string{"", "g"}, [2]string{"", "g"}, [2]string{"", "g"})
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil || len(rows) != 3 {
		t.Fatal(rows, err)
	}
	dead := map[int64]event.Outcome{}
	for _, id := range ids {
		dead[id] = event.Outcome{Settlement: event.DeadLetter, Attempts: 1, Error: `atomic group "g" has 3 rows, more than the 2 the server stores in one atomic batch`}
	}
	settleAll(t, s, rows, dead)
	// The operator retries the first row only (admin.Requeue).
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'pending', attempts = 0, available_at = ?, processed_at = NULL WHERE id = ? AND status = 'dead_lettered'`,
		time.Now().UnixMilli(), ids[0])
	s.Rescan()
	got, err := s.Claim(context.Background(), 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range got {
		if r.Group == "g" && r.Problem == "" {
			t.Fatalf("claimed row %d of group %q alone (its rows %d and %d are dead letters): the relay would publish part of the group", r.ID, r.Group, ids[1], ids[2])
		}
		if r.Group == "g" && !strings.Contains(r.Problem, fmt.Sprintf("its row %d is dead-lettered", ids[1])) {
			t.Fatalf("row %d: problem %q", r.ID, r.Problem)
		}
	}
}

// TestGroupRowNotDueIsNotPublishedEarly: available_at is "do not publish
// before": a group one of whose rows the application scheduled for later
// waits for it.
func TestGroupRowNotDueIsNotPublishedEarly(t *testing.T) {
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	later := time.Now().Add(time.Hour).UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, atomic_group) VALUES (1, 'e1', 'T', x'', 'g')`)
	testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, atomic_group, available_at) VALUES (2, 'e2', 'T', x'', 'g', ?)`, later)
	for _, r := range claimRows(t, s) {
		if r.ID == 2 {
			t.Fatalf("row 2 (available_at in an hour) claimed now with its group: published before its available_at")
		}
	}
}

func claimRows(t *testing.T, s *Store) []event.Row {
	t.Helper()
	rows, err := s.Claim(context.Background(), 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

// TestGroupWaitsForItsRowsInFlight: an atomic group whose dead letters
// were requeued in two transactions. The rows of the first part are
// claimed, to be dead-lettered again (the rest was a dead letter then),
// and are still pending in the table when the rest is requeued: a claim
// then does not take the rest as the whole group. It waits for the rows
// in flight to settle, and the rest is dead-lettered after them.
func TestGroupWaitsForItsRowsInFlight(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	db := testenv.AppDB(t, s.db.Path())
	ids := insertGrouped(t, db, [2]string{"", "g"}, [2]string{"", "g"}, [2]string{"", "g"}, [2]string{"", "g"})
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'dead_lettered' WHERE id IN (?, ?)`, ids[2], ids[3])
	first, err := s.Claim(ctx, 100, 0)
	if err != nil || len(first) != 2 || !strings.Contains(first[0].Problem, "is dead-lettered") {
		t.Fatalf("first part: %+v, %v; want its 2 rows, to be dead-lettered", first, err)
	}
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'pending' WHERE id IN (?, ?)`, ids[2], ids[3])
	wantIDs(t, "the rest, while the first part is in flight", claimIDs(t, s))

	outs := []event.Outcome{event.Invalid(first[0], first[0].Problem), event.Invalid(first[1], first[1].Problem)}
	if _, err := s.Settle(ctx, outs, 0); err != nil {
		t.Fatal(err)
	}
	rest, err := s.Claim(ctx, 100, 0)
	if err != nil || len(rest) != 2 || rest[0].ID != ids[2] || !strings.Contains(rest[0].Problem, fmt.Sprintf("its row %d is dead-lettered", ids[0])) {
		t.Fatalf("the rest, once the first part settled: %+v, %v; want its 2 rows, to be dead-lettered", rest, err)
	}
}
