package claim

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"time"

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

func newQueries(t string) queries {
	return queries{
		due: fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE status = 'pending' AND available_at <= ?)`, t),
		// One statement claims atomically; the subquery walks the pending
		// index in id order and stops at the limit. event_id is not in the
		// SET list, so SQLite leaves its unique index alone.
		claim: fmt.Sprintf(`UPDATE %[1]s SET status = 'processing', claimed_at = ?1, claimed_by = ?2
WHERE id IN (SELECT id FROM %[1]s WHERE status = 'pending' AND available_at <= ?1 ORDER BY id LIMIT ?3)`, t),
		assignIDs:    fmt.Sprintf(`UPDATE %s SET event_id = %s WHERE `+ofClaim+` AND event_id IS NULL`, t, uuidSQL),
		claimed:      fmt.Sprintf(`SELECT id, event_id, event_type, payload, attempts, created_at FROM %s WHERE `+ofClaim+` ORDER BY id`, t),
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

// claimTime returns the claimed_at of a new claim: the current millisecond,
// or one more than the previous claim's, so that (claimed_at, owner)
// identifies one claim.
func (s *Store) claimTime() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	// A second claim in the same millisecond waits for the next one, so
	// claimed_at never runs ahead of the clock (it is also what available_at
	// is compared with). At most one claim a millisecond costs nothing: a
	// claim takes every due row, up to the batch size.
	now := nowMs()
	for now <= s.lastClaim {
		time.Sleep(time.Until(time.UnixMilli(s.lastClaim + 1)))
		now = nowMs()
	}
	s.lastClaim = now
	return now
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

// Claim claims up to limit due rows in id order in one short BEGIN
// IMMEDIATE transaction: status becomes processing, claimed_at the claim's
// millisecond (the lease start and, with the owner, the claim's token), and
// a NULL event_id gets a fresh UUID. The rows are then read through the
// read-only pool, outside the write lock, and returned in id order.
func (s *Store) Claim(ctx context.Context, limit int) ([]event.Row, error) {
	// Most wake-ups find nothing due (they follow this relay's own
	// commits): find out with a read, without taking the write lock the
	// application needs.
	var due bool
	if err := s.read.QueryRowContext(context.WithoutCancel(ctx), s.q.due, nowMs()).Scan(&due); err != nil {
		return nil, fmt.Errorf("look for due rows: %w", err)
	}
	if !due {
		return nil, nil
	}
	at := s.claimTime()
	tx, err := s.begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx, s.q.claim, at, s.instance, limit)
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

// readClaim reads the rows of the claim at claimed_at, in id order.
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
			r         event.Row
			eventID   sql.NullString
			eventType sql.NullString
			attempts  sql.NullInt64
			created   sql.NullInt64
		)
		if err := rows.Scan(&r.ID, &eventID, &eventType, &r.Payload, &attempts, &created); err != nil {
			return nil, fmt.Errorf("read claimed rows: %w", err)
		}
		r.EventID, r.EventType, r.Attempts, r.CreatedAt, r.ClaimedAt = eventID.String, eventType.String, int(attempts.Int64), created.Int64, at
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read claimed rows: %w", err)
	}
	return out, nil
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
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	s.lastBeat = time.UnixMilli(now)
	return reclaimed, nil
}

// Leave removes this instance's heartbeat row; call it after every claim
// of this instance has been settled.
func (s *Store) Leave(ctx context.Context) error {
	if _, err := s.exec(ctx, `DELETE FROM `+InstancesTable+` WHERE instance_id = ?`, s.instance); err != nil {
		return fmt.Errorf("remove instance: %w", err)
	}
	return nil
}
