package claim

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	sqlite3 "github.com/mattn/go-sqlite3"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// queries are the statements on the outbox table, built once for its name.
type queries struct {
	due, claim, assignIDs, claimed, settledAt, releaseClaim, doneClaim, done, retry, deadLetter, release, reclaim string
}

// owned is the condition every single-row settle carries: the row is still
// held by the claim (claimed_at, owner) that the relay presents.
const owned = `id = ? AND status = 'processing' AND claimed_at = ? AND claimed_by = ?`

// ofClaim selects the rows of one claim through the processing index (a
// claim's claimed_at is unique per owner).
const ofClaim = `status = 'processing' AND claimed_at = ?1 AND claimed_by = ?2`

// dueSQL is true for a pending row whose time has come (param is now in
// Unix milliseconds). A NULL available_at (a legacy row, or an explicit
// NULL) means now, and so does a value that is no time: such a row is taken
// so that it is dealt with (published, or dead-lettered with the reason)
// instead of waiting unseen forever. SQLite's own date-time text counts as
// the time it names. An integer available_at, the relay's own, is decided
// by the first comparison.
func dueSQL(param string) string {
	return fmt.Sprintf(`(available_at <= %[1]s OR (typeof(available_at) NOT IN ('integer', 'real') AND coalesce(%[2]s, 0) <= %[1]s))`,
		param, msSQL("available_at"))
}

func newQueries(t string) queries {
	return queries{
		due: fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE status = 'pending' AND %s)`, t, dueSQL("?1")),
		// One statement claims atomically; the innermost subquery walks the
		// pending index in id order and stops at the limit, and of those
		// rows the claim takes the ones that begin within the byte budget
		// (?5; at least one row), so large payloads are never read past it.
		// event_id is not in the SET list, so SQLite leaves its unique index
		// alone.
		claim: fmt.Sprintf(`UPDATE %[1]s SET status = 'processing', claimed_at = ?1, claimed_by = ?2
WHERE id IN (SELECT id FROM (
	SELECT id, sum(len) OVER (ORDER BY id) - len AS before FROM (
		SELECT id, coalesce(octet_length(payload), 0) AS len FROM %[1]s WHERE status = 'pending' AND %[2]s ORDER BY id LIMIT ?3))
	WHERE before < ?5)`, t, dueSQL("?4")),
		assignIDs: fmt.Sprintf(`UPDATE %s SET event_id = %s WHERE `+ofClaim+` AND event_id IS NULL`, t, uuidSQL),
		claimed: fmt.Sprintf(`SELECT id, event_id, event_type, payload, CAST(attempts AS INTEGER),
	%[2]s, created_at IS NOT NULL, %[3]s, available_at IS NOT NULL FROM %[1]s WHERE `+ofClaim+` ORDER BY id`, t, msSQL("created_at"), msSQL("available_at")),
		settledAt:    fmt.Sprintf(`SELECT id FROM %s WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'done' AND processed_at = ?2`, t),
		releaseClaim: fmt.Sprintf(`UPDATE %s SET status = 'pending', claimed_at = NULL, claimed_by = NULL WHERE `+ofClaim, t),
		doneClaim:    fmt.Sprintf(`UPDATE %s SET status = 'done', processed_at = ?3, claimed_at = NULL, claimed_by = NULL WHERE `+ofClaim, t),
		done:         fmt.Sprintf(`UPDATE %s SET status = 'done', processed_at = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
		retry:        fmt.Sprintf(`UPDATE %s SET status = 'pending', attempts = ?, available_at = ?, last_error = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
		deadLetter:   fmt.Sprintf(`UPDATE %s SET status = 'dead_lettered', attempts = ?, last_error = ?, processed_at = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
		release:      fmt.Sprintf(`UPDATE %s SET status = 'pending', available_at = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
		// A claim is reclaimable when its lease expired, or at once when its
		// owner stopped heartbeating (crashed); a live owner's claims are never
		// taken before the lease.
		reclaim: fmt.Sprintf(`UPDATE %s SET status = 'pending', claimed_at = NULL, claimed_by = NULL
WHERE status = 'processing' AND (
	claimed_at IS NULL OR claimed_at < ?1
	OR (claimed_by IS NOT NULL AND claimed_by <> ?2
		AND claimed_by NOT IN (SELECT instance_id FROM `+InstancesTable+` WHERE heartbeat_at >= ?3)))`, t),
	}
}

// claimTime returns the current millisecond and the claimed_at of a new
// claim: the current millisecond, or one more than the previous claim's
// when that is not earlier, so that (claimed_at, owner) identifies one
// claim. It never waits: a token may run a millisecond or so ahead of the
// clock, which only lengthens its lease by as much.
func (s *Store) claimTime() (now, token int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now = s.dueMs()
	token = max(nowMs(), s.lastClaim+1)
	s.lastClaim = token
	return now, token
}

// claimSize records (n > 0) or takes back (n == 0) how many rows the claim
// at claimed_at holds, so Settle knows when it has the whole claim.
func (s *Store) claimSize(at int64, n int) (size int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n > 0 {
		s.claims[at] = n
		return n
	}
	size = s.claims[at]
	delete(s.claims, at)
	return size
}

// Claim claims due rows in id order, up to limit rows and, past the first
// row, up to maxBytes of payload (0: no byte limit), in one short BEGIN
// IMMEDIATE transaction: status becomes processing, claimed_at the claim's
// millisecond (the lease start and, with the owner, the claim's token), and
// a NULL event_id gets a fresh UUID. The rows are then read through the
// read-only pool, outside the write lock, and returned in id order. A row
// whose columns cannot be read as the relay needs them comes back with
// Problem set, to be dead-lettered alone.
func (s *Store) Claim(ctx context.Context, limit int, maxBytes int64) ([]event.Row, error) {
	if maxBytes <= 0 {
		maxBytes = math.MaxInt64
	}
	// Most wake-ups find nothing due (they follow this relay's own
	// commits): find out with a read, without taking the write lock the
	// application needs.
	var due bool
	if err := s.read.QueryRowContext(context.WithoutCancel(ctx), s.q.due, s.dueMs()).Scan(&due); err != nil {
		return nil, fmt.Errorf("look for due rows: %w", err)
	}
	if !due {
		return nil, nil
	}
	now, at := s.claimTime()
	tx, err := s.begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx, s.q.claim, at, s.instance, limit, now, maxBytes)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return nil, nil
	}
	if _, err := tx.ExecContext(ctx, s.q.assignIDs, at, s.instance); err != nil {
		return nil, fmt.Errorf("assign event ids: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	out, err := s.readClaim(ctx, at)
	if err != nil {
		// Do not leave the rows held by a live relay until the lease ends.
		if _, rerr := s.exec(context.WithoutCancel(ctx), s.q.releaseClaim, at, s.instance); rerr != nil {
			err = errors.Join(err, fmt.Errorf("release the claim: %w", rerr))
		}
		return nil, err
	}
	if len(out) > 0 {
		s.claimSize(at, len(out))
	}
	return out, nil
}

// readClaim reads the rows of the claim at claimed_at, in id order. The
// columns are read as whatever SQLite holds, so that one row of a foreign
// shape (a text created_at, say) is reported on that row alone instead of
// failing the whole claim, which would take the same row first again.
func (s *Store) readClaim(ctx context.Context, at int64) ([]event.Row, error) {
	// A context that cannot be cancelled lets go-sqlite3 read each row in
	// one cgo call; the read is short and holds no lock.
	rows, err := s.read.QueryContext(context.WithoutCancel(ctx), s.q.claimed, at, s.instance)
	if err != nil {
		return nil, fmt.Errorf("read claimed rows: %w", err)
	}
	defer rows.Close()
	var out []event.Row
	for rows.Next() {
		var (
			r                           event.Row
			eventID, eventType, payload any
			attempts                    sql.NullInt64
			created, availAt            sql.NullInt64
			hasCreated, hasAvailAt      bool
		)
		if err := rows.Scan(&r.ID, &eventID, &eventType, &payload, &attempts, &created, &hasCreated, &availAt, &hasAvailAt); err != nil {
			return nil, fmt.Errorf("read claimed rows: %w", err)
		}
		r.ClaimedAt = at
		r.EventID, r.EventType, r.Payload = text(eventID), text(eventType), blob(payload)
		r.Attempts = int(max(0, min(attempts.Int64, math.MaxInt32)))
		// A NULL created_at leaves the claim as the earliest time known.
		r.CreatedAt = at
		if created.Valid {
			r.CreatedAt = created.Int64
		}
		var problems []string
		if hasCreated && !created.Valid {
			problems = append(problems, "created_at")
		}
		if hasAvailAt && !availAt.Valid {
			problems = append(problems, "available_at")
		}
		if len(problems) > 0 {
			r.Problem = fmt.Sprintf("cannot read the row: %s holds neither Unix milliseconds nor a date and time SQLite writes", strings.Join(problems, " and "))
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read claimed rows: %w", err)
	}
	return out, nil
}

// text returns a text column's value as the relay publishes it.
func text(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	}
	return fmt.Sprint(v)
}

// blob returns a payload's bytes as SQLite stores them.
func blob(v any) []byte {
	switch v := v.(type) {
	case nil:
		return nil
	case []byte:
		return v
	case string:
		return []byte(v)
	}
	return []byte(fmt.Sprint(v))
}

// Settle writes outcomes in one transaction. Each update is conditioned on
// the claim it was made under, so a relay that lost its lease changes
// nothing; stale lists the indexes of those outcomes. When every row of a
// claim that is still held is done, one statement settles them all.
func (s *Store) Settle(ctx context.Context, outs []event.Outcome) (stale []int, err error) {
	if len(outs) == 0 {
		return nil, nil
	}
	now := nowMs()
	tx, err := s.begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	defer tx.Rollback()
	done := map[int64][]int{} // claimed_at -> indexes of done outcomes
	stmts := map[event.Settlement]*sql.Stmt{}
	one := func(i int, q string, args ...any) error {
		o := outs[i]
		st := stmts[o.Settlement]
		if st == nil {
			var err error
			if st, err = tx.PrepareContext(ctx, q); err != nil {
				return fmt.Errorf("settle rows: %w", err)
			}
			stmts[o.Settlement] = st
		}
		res, err := st.ExecContext(ctx, append(args, o.Row.ID, o.Row.ClaimedAt, s.instance)...)
		if err != nil {
			return fmt.Errorf("settle row %d: %w", o.Row.ID, err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			stale = append(stale, i)
		}
		return nil
	}
	defer func() {
		for _, st := range stmts {
			st.Close()
		}
	}()
	for i, o := range outs {
		var err error
		switch o.Settlement {
		case event.Done:
			done[o.Row.ClaimedAt] = append(done[o.Row.ClaimedAt], i)
		case event.Retry:
			err = one(i, s.q.retry, o.Attempts, o.AvailableAt.UnixMilli(), o.Error)
		case event.DeadLetter:
			err = one(i, s.q.deadLetter, o.Attempts, o.Error, now)
		case event.Release:
			err = one(i, s.q.release, o.AvailableAt.UnixMilli())
		default:
			err = fmt.Errorf("settle row %d: unknown settlement %v", o.Row.ID, o.Settlement)
		}
		if err != nil {
			return nil, err
		}
	}
	claimed := map[int64]int{} // claimed_at -> outcomes of that claim
	for _, o := range outs {
		claimed[o.Row.ClaimedAt]++
	}
	size := map[int64]int{} // claimed_at -> rows the claim took
	for at := range claimed {
		size[at] = s.claimSize(at, 0)
	}
	for at, idx := range done {
		if size[at] == claimed[at] {
			// These outcomes are the whole claim, and the rows it still
			// holds are all done: one statement settles them. Rows another
			// relay took meanwhile are not touched; find them if any.
			res, err := tx.ExecContext(ctx, s.q.doneClaim, at, s.instance, now)
			if err != nil {
				return nil, fmt.Errorf("settle rows: %w", err)
			}
			if n, _ := res.RowsAffected(); int(n) < len(idx) {
				lost, err := s.notSettled(ctx, tx, outs, idx, now)
				if err != nil {
					return nil, err
				}
				stale = append(stale, lost...)
			}
			continue
		}
		// Part of a claim: row by row.
		for _, i := range idx {
			if err := one(i, s.q.done, now); err != nil {
				return nil, err
			}
		}
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	slices.Sort(stale)
	return stale, nil
}

// notSettled returns the indexes among idx whose rows the bulk settle at
// now did not mark done (their claim was lost).
func (s *Store) notSettled(ctx context.Context, tx *sql.Tx, outs []event.Outcome, idx []int, now int64) ([]int, error) {
	settled := map[int64]bool{}
	ids := make([]byte, 0, 12*len(idx))
	ids = append(ids, '[')
	for k, i := range idx {
		if k > 0 {
			ids = append(ids, ',')
		}
		ids = strconv.AppendInt(ids, outs[i].Row.ID, 10)
	}
	ids = append(ids, ']')
	rows, err := tx.QueryContext(ctx, s.q.settledAt, string(ids), now)
	if err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("settle rows: %w", err)
		}
		settled[id] = true
	}
	var lost []int
	for _, i := range idx {
		if !settled[outs[i].Row.ID] {
			lost = append(lost, i)
		}
	}
	return lost, rows.Err()
}

// Heartbeat records that this instance is alive and makes claims
// reclaimable whose lease expired or whose owner stopped heartbeating for
// staleAfter; it removes such owners' heartbeat rows. It returns how many
// rows went back to pending.
//
// Another relay is judged dead only when this one has itself been
// heartbeating on time for a whole staleAfter: a heartbeat held up for a
// third of staleAfter (waiting for the lock, or following a late one) means
// the application likely held the write lock, every relay's heartbeat
// waited too, and their silence proves nothing until they have had as long
// again to catch up.
func (s *Store) Heartbeat(ctx context.Context, version string, lease, staleAfter time.Duration) (reclaimed int64, err error) {
	defer func() { err = NotWritable(s.path, err) }()
	host, _ := os.Hostname()
	asked := time.Now()
	tx, err := s.begin(ctx) // BEGIN IMMEDIATE: waits for the lock
	if err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	defer tx.Rollback()
	now := nowMs() // taken with the lock held, so it is not already late
	heldUp := time.Since(asked) > staleAfter/3 || (!s.lastBeat.IsZero() && time.Since(s.lastBeat) > staleAfter/3)
	if heldUp || s.beatingSince.IsZero() {
		s.beatingSince = time.UnixMilli(now)
	}
	// Judge others only after beating on time for a whole staleness window
	// ourselves: then a silent relay was silent while the lock was to be had.
	judge := !heldUp && time.UnixMilli(now).Sub(s.beatingSince) >= staleAfter
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version)
VALUES (?1, ?2, ?2, ?3, ?4, ?5)
ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at`, s.instance, now, host, os.Getpid(), version); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	staleBefore := now - staleAfter.Milliseconds()
	if !judge {
		staleBefore = 0 // judge nobody dead this round; expired leases still count
	}
	res, err := tx.ExecContext(ctx, s.q.reclaim, now-lease.Milliseconds(), s.instance, staleBefore)
	if err != nil {
		return 0, fmt.Errorf("reclaim rows: %w", err)
	}
	reclaimed, _ = res.RowsAffected()
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+InstancesTable+` WHERE heartbeat_at < ?`, staleBefore); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	var leader string
	if err := tx.QueryRowContext(ctx, leaderSQL).Scan(&leader); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	s.lastBeat = time.UnixMilli(now)
	s.leads.Store(leader == s.instance)
	return reclaimed, nil
}

// leaderSQL names the relay that leads: the longest-running one among the
// heartbeat rows. A relay that stops heartbeating loses its row (and the
// lead) once another has judged it dead (see Heartbeat), so a standby
// takes over in about the time crash recovery takes.
const leaderSQL = `SELECT instance_id FROM ` + InstancesTable + ` ORDER BY started_at, instance_id LIMIT 1`

// Leads reports whether this relay led at its latest heartbeat. Only the
// leader claims rows; the others stand by.
func (s *Store) Leads() bool { return s.leads.Load() }

// NotWritable marks err with event.ErrNotWritable when SQLite says this
// process may not write the file at path, naming what the relay needs.
func NotWritable(path string, err error) error {
	var se sqlite3.Error
	if !errors.As(err, &se) || (se.Code != sqlite3.ErrReadonly && se.Code != sqlite3.ErrPerm && se.Code != sqlite3.ErrCantOpen) {
		return err
	}
	return fmt.Errorf("%w: %s: %w (the relay runs as uid %d and needs to write the file, its -wal and -shm files and their directory %s)",
		event.ErrNotWritable, path, err, os.Geteuid(), filepath.Dir(path))
}

// Leave removes this instance's heartbeat row; call it after every claim
// of this instance has been settled.
func (s *Store) Leave(ctx context.Context) error {
	if _, err := s.exec(ctx, `DELETE FROM `+InstancesTable+` WHERE instance_id = ?`, s.instance); err != nil {
		return fmt.Errorf("remove instance: %w", err)
	}
	return nil
}

// TableExists returns an error naming the outbox table when the file has
// no such table.
func (s *Store) TableExists(ctx context.Context) error {
	ok, err := objectExists(ctx, s.read, "table", s.table)
	if err != nil {
		return fmt.Errorf("look for table %s: %w", s.table, err)
	}
	if !ok {
		return fmt.Errorf("database %s has no table %s", s.path, s.table)
	}
	return nil
}
