package claim

// Atomic groups: rows that share an atomic_group are claimed together or
// not at all, so that the relay can publish them as one atomic batch.

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// withGroups adds to the rows read (in id order, with prev and noID as
// readRows returns them) the pending rows of their atomic groups that the
// read left out (cut by its row limit or byte budget, or not due), so
// that order sees every group whole, and returns, of those groups, the
// ones a row holds back (see takeGroup). Rows in flight, or let go since
// the claim began, are left out. now is the due clock (Unix ms).
func (s *Store) withGroups(ctx context.Context, read []event.Row, prev []prevRow, noID []int, now int64) ([]event.Row, []prevRow, []int, map[string]heldBy, error) {
	groups := map[string]bool{}
	for _, r := range read {
		if r.Group != "" {
			groups[r.Group] = true
		}
	}
	if len(groups) == 0 {
		return read, prev, noID, nil, nil
	}
	s.mu.Lock()
	known := jsonIDs(func(yield func(int64) bool) {
		for _, ids := range []map[int64]struct{}{s.held.ids, s.held.gone} {
			for id := range ids {
				if !yield(id) {
					return
				}
			}
		}
		for _, r := range read {
			if !yield(r.ID) {
				return
			}
		}
	})
	s.mu.Unlock()
	names, _ := json.Marshal(slices.Collect(maps.Keys(groups)))
	held, err := s.groupsHeld(ctx, string(names), now)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	// A group with rows in flight still (its rows requeued in two
	// transactions: the first part claimed, and to be dead-lettered,
	// before the rest was pending), or let go since the claim began,
	// waits: its rows in flight are pending in the table, and would not
	// hold it back, and what they were settled as may have come after
	// the read above.
	s.mu.Lock()
	for g := range groups {
		if _, ok := held[g]; !ok && (s.held.groups[g] > 0 || s.held.goneGroups[g]) {
			held[g] = heldBy{status: event.StatusProcessing}
		}
	}
	s.mu.Unlock()
	rows, err := s.db.Reader().QueryContext(context.WithoutCancel(ctx), s.q.groupRest, string(names), known)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	rest, restPrev, restNoID, err := readRows(rows, sqlitedb.NowMs(), 1)
	if err != nil || len(rest) == 0 {
		return read, prev, noID, held, err
	}
	// Merge the two id-ordered lists.
	n := len(read) + len(rest)
	rows2, prev2, noID2 := make([]event.Row, 0, n), make([]prevRow, 0, n), []int{}
	i, j := 0, 0
	for i < len(read) || j < len(rest) {
		if j == len(rest) || (i < len(read) && read[i].ID < rest[j].ID) {
			if len(noID) > 0 && noID[0] == i {
				noID, noID2 = noID[1:], append(noID2, len(rows2))
			}
			rows2, prev2 = append(rows2, read[i]), append(prev2, prev[i])
			i++
			continue
		}
		if len(restNoID) > 0 && restNoID[0] == j {
			restNoID, noID2 = restNoID[1:], append(noID2, len(rows2))
		}
		rows2, prev2 = append(rows2, rest[j]), append(prev2, restPrev[j])
		j++
	}
	return rows2, prev2, noID2, held, nil
}

// heldBy is the first row of an atomic group that holds it back: neither
// done nor pending (a dead letter, a processing row), or not due.
type heldBy struct {
	id     int64
	status event.Status
}

// groupsHeld returns, of the atomic groups names (a JSON array), those a
// row holds back at now (due clock, Unix ms), each with the first such
// row.
func (s *Store) groupsHeld(ctx context.Context, names string, now int64) (map[string]heldBy, error) {
	rows, err := s.db.Reader().QueryContext(ctx, s.q.groupHeld, names, now)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	held := map[string]heldBy{}
	for rows.Next() {
		var g string
		var h heldBy
		if err := rows.Scan(&g, &h.id, &h.status); err != nil {
			return nil, err
		}
		held[g] = h
	}
	return held, rows.Err()
}

// members returns the indexes in rows of each atomic group's rows.
func members(rows []event.Row) map[string][]int {
	var groups map[string][]int
	for i, r := range rows {
		if r.Group != "" {
			if groups == nil {
				groups = map[string][]int{}
			}
			groups[r.Group] = append(groups[r.Group], i)
		}
	}
	return groups
}

// takeGroup decides, at the first of its rows in a claim, whether the
// claim takes the atomic group whose rows are at indexes group (see
// order): whole, when every row of it that has an ordering key may follow
// the row before it of its key (mayFollow) or follows a row of the group;
// else not at all, and its keys are stopped for the rest of the claim.
// held is the group's first row that holds it back, if any (see
// groupsHeld): a row not due yet or in another claimer's hands makes the
// group wait; a dead letter (some of its rows retried, not all) makes the
// rest dead letters too.
//
// A group whose rows of one ordering key have another row of that key
// between them (or after its first row: rows another transaction wrote
// between the group's, which can happen only with ids the application
// chose) cannot be published whole without breaking the key's order, and
// two such groups would each wait for the other: it is no group. Its rows
// are handed back as rows of no group, each to be dead-lettered at its
// turn with a reason that says why. s.mu is held.
func (s *Store) takeGroup(rows []event.Row, prev []prevRow, group []int, held heldBy, kept map[int64]bool, stopped map[string]bool) bool {
	first := rows[group[0]]
	switch held.status {
	case "":
	case event.StatusDeadLettered:
		// Part of the group is a dead letter (an operator retried only
		// some of its rows): the rest can never be stored with it.
		why := fmt.Sprintf("atomic group %q: its row %d is dead-lettered, so the group can no longer be stored whole (retry the group's dead letters together)", first.Group, held.id)
		for _, i := range group {
			if rows[i].Problem == "" {
				rows[i].Problem = why
			}
		}
	default:
		// A row not due yet, or one another claimer holds: the group
		// waits for it.
		stopKeys(rows, group, stopped)
		return false
	}
	in := make(map[int64]bool, len(group))
	for _, i := range group {
		in[rows[i].ID] = true
	}
	for _, i := range group {
		p := prev[i]
		if rows[i].OrderingKey == "" || !p.ID.Valid || in[p.ID.Int64] || p.ID.Int64 < first.ID {
			continue
		}
		why := fmt.Sprintf("atomic group %q: row %d of ordering key %q lies between the group's rows %d and %d and is not in the group, so the group cannot be published whole in the key's order (write a group's rows in one transaction)",
			first.Group, p.ID.Int64, rows[i].OrderingKey, first.ID, rows[i].ID)
		for _, j := range group {
			rows[j].Group = ""
			if rows[j].Problem == "" {
				rows[j].Problem = why
			}
		}
		return false
	}
	for _, i := range group {
		k, p := rows[i].OrderingKey, prev[i]
		if k == "" || (p.ID.Valid && in[p.ID.Int64]) {
			continue
		}
		if !stopped[k] && s.mayFollow(p, kept) {
			continue
		}
		if !stopped[k] {
			s.held.wait(k, p)
		}
		stopKeys(rows, group, stopped)
		return false
	}
	return true
}

// stopKeys stops, for the rest of a claim, the ordering keys of the rows
// at indexes group: a group left for later holds them up.
func stopKeys(rows []event.Row, group []int, stopped map[string]bool) {
	for _, i := range group {
		if k := rows[i].OrderingKey; k != "" {
			stopped[k] = true
		}
	}
}
