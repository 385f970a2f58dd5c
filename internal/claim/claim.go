package claim

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// queries are the statements on the outbox table, built once for its name.
type queries struct {
	claim, assignID, done, retry, deadLetter, release, reclaim string
}

// owned is the condition every settle carries: the row is still held by the
// claim (claimed_at, owner) that the relay presents.
const owned = `id = ? AND status = 'processing' AND claimed_at = ? AND claimed_by = ?`

func newQueries(t string) queries {
	return queries{
		// One statement claims atomically; the subquery walks the pending
		// index in id order and stops at the limit.
		// event_id is not in the SET list: SQLite then leaves the unique
		// index on it alone, instead of rewriting a random-key entry per row.
		claim: fmt.Sprintf(`UPDATE %[1]s
SET status = 'processing', claimed_at = ?1, claimed_by = ?2
WHERE id IN (SELECT id FROM %[1]s WHERE status = 'pending' AND available_at <= ?1 ORDER BY id LIMIT ?3)
RETURNING id, event_id, event_type, payload, attempts, created_at`, t),
		assignID: fmt.Sprintf(`UPDATE %s SET event_id = %s WHERE id = ? AND event_id IS NULL RETURNING event_id`, t, uuidSQL),
		done:       fmt.Sprintf(`UPDATE %s SET status = 'done', processed_at = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
		retry:      fmt.Sprintf(`UPDATE %s SET status = 'pending', attempts = ?, available_at = ?, last_error = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
		deadLetter: fmt.Sprintf(`UPDATE %s SET status = 'dead_lettered', attempts = ?, last_error = ?, processed_at = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
		release:    fmt.Sprintf(`UPDATE %s SET status = 'pending', available_at = ?, claimed_at = NULL, claimed_by = NULL WHERE `+owned, t),
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

// Claim claims up to limit due rows in id order in one short BEGIN
// IMMEDIATE transaction: status becomes processing, claimed_at the current
// millisecond (the lease start and owner token), and a NULL event_id gets a
// fresh UUID. The rows are returned in id order.
func (s *Store) Claim(ctx context.Context, limit int) ([]event.Row, error) {
	now := nowMs()
	tx, err := s.write.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	defer tx.Rollback()
	rows, err := tx.QueryContext(ctx, s.q.claim, now, s.instance, limit)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	// The open RETURNING result holds the write lock: read it all at once.
	out := make([]event.Row, 0, limit)
	var noID []int // rows a foreign writer left without an event id
	for rows.Next() {
		var (
			r         event.Row
			eventID   sql.NullString
			eventType sql.NullString
			attempts  sql.NullInt64
			created   sql.NullInt64
		)
		if err := rows.Scan(&r.ID, &eventID, &eventType, &r.Payload, &attempts, &created); err != nil {
			rows.Close()
			return nil, fmt.Errorf("claim rows: %w", err)
		}
		if !eventID.Valid {
			noID = append(noID, len(out))
		}
		r.EventID, r.EventType, r.Attempts, r.CreatedAt, r.ClaimedAt = eventID.String, eventType.String, int(attempts.Int64), created.Int64, now
		out = append(out, r)
	}
	if err := rows.Close(); err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	for _, i := range noID {
		if err := tx.QueryRowContext(ctx, s.q.assignID, out[i].ID).Scan(&out[i].EventID); err != nil {
			return nil, fmt.Errorf("assign event id to row %d: %w", out[i].ID, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	slices.SortFunc(out, func(a, b event.Row) int { return int(a.ID - b.ID) })
	return out, nil
}

// Settle writes outcomes in one transaction. Each update is conditioned on
// the claim it was made under, so a relay that lost its lease changes
// nothing; stale lists the indexes of those outcomes.
func (s *Store) Settle(ctx context.Context, outs []event.Outcome) (stale []int, err error) {
	if len(outs) == 0 {
		return nil, nil
	}
	now := nowMs()
	tx, err := s.write.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	defer tx.Rollback()
	stmts := map[event.Settlement]*sql.Stmt{}
	for i, o := range outs {
		st := stmts[o.Settlement]
		if st == nil {
			q := map[event.Settlement]string{event.Done: s.q.done, event.Retry: s.q.retry, event.DeadLetter: s.q.deadLetter, event.Release: s.q.release}[o.Settlement]
			if q == "" {
				return nil, fmt.Errorf("settle row %d: unknown settlement %v", o.Row.ID, o.Settlement)
			}
			if st, err = tx.PrepareContext(ctx, q); err != nil {
				return nil, fmt.Errorf("settle rows: %w", err)
			}
			defer st.Close()
			stmts[o.Settlement] = st
		}
		var args []any
		switch o.Settlement {
		case event.Done:
			args = []any{now}
		case event.Retry:
			args = []any{o.Attempts, o.AvailableAt.UnixMilli(), o.Error}
		case event.DeadLetter:
			args = []any{o.Attempts, o.Error, now}
		case event.Release:
			args = []any{o.AvailableAt.UnixMilli()}
		}
		res, err := st.ExecContext(ctx, append(args, o.Row.ID, o.Row.ClaimedAt, s.instance)...)
		if err != nil {
			return nil, fmt.Errorf("settle row %d: %w", o.Row.ID, err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			stale = append(stale, i)
		}
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	return stale, nil
}

// Heartbeat records that this instance is alive and makes claims
// reclaimable whose lease expired or whose owner stopped heartbeating for
// staleAfter; it removes such owners' heartbeat rows. It returns how many
// rows went back to pending.
//
// When this heartbeat itself was held up (it waited a third of staleAfter
// for the lock, or the previous one is that old), the application has
// likely held the write lock, and every other relay's heartbeat waited
// too: their silence proves nothing, so this round judges nobody dead.
func (s *Store) Heartbeat(ctx context.Context, version string, lease, staleAfter time.Duration) (reclaimed int64, err error) {
	host, _ := os.Hostname()
	asked := time.Now()
	tx, err := s.write.BeginTx(ctx, nil) // BEGIN IMMEDIATE: waits for the lock
	if err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	defer tx.Rollback()
	now := nowMs() // taken with the lock held, so it is not already late
	heldUp := time.Since(asked) > staleAfter/3 || (!s.lastBeat.IsZero() && time.Since(s.lastBeat) > staleAfter/3)
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version)
VALUES (?1, ?2, ?2, ?3, ?4, ?5)
ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at`, s.instance, now, host, os.Getpid(), version); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	staleBefore := now - staleAfter.Milliseconds()
	if heldUp {
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
	if _, err := s.write.ExecContext(ctx, `DELETE FROM `+InstancesTable+` WHERE instance_id = ?`, s.instance); err != nil {
		return fmt.Errorf("remove instance: %w", err)
	}
	return nil
}
