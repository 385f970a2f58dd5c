package claim

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// leadsIn reports whether this store may write settlements: it has never
// heartbeated (a store used on its own), or it is the leader now.
func (s *Store) leadsIn(ctx context.Context, tx *sql.Tx) (bool, error) {
	if !s.registered.Load() {
		return true, nil
	}
	var leader string
	err := tx.QueryRowContext(ctx, leaderSQL).Scan(&leader)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return leader == s.instance, err
}

// Heartbeat records that this instance is alive, with how many rows it
// has in flight, and makes rows marked processing by a writing claimer
// reclaimable whose lease expired or whose owner stopped heartbeating for
// staleAfter; it removes such owners' heartbeat rows, and with them their
// lead. It returns how many rows went back to pending. From the first
// heartbeat on, Settle writes only while this store leads.
//
// Another relay is judged dead only when this one has itself been
// heartbeating on time for a whole staleAfter: a heartbeat held up for a
// third of staleAfter (waiting for the lock, or following a late one) means
// the application likely held the write lock, every relay's heartbeat
// waited too, and their silence proves nothing until they have had as long
// again to catch up.
func (s *Store) Heartbeat(ctx context.Context, version string, lease, staleAfter time.Duration) (reclaimed int64, err error) {
	defer func() { err = sqlitedb.NotWritable(s.db.Path(), err) }()
	host, _ := os.Hostname()
	asked := time.Now()
	tx, err := s.db.Begin(ctx) // BEGIN IMMEDIATE: waits for the lock
	if err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	defer tx.Rollback()
	now := sqlitedb.NowMs() // taken with the lock held, so it is not already late
	heldUp := time.Since(asked) > staleAfter/3 || (!s.lastBeat.IsZero() && time.Since(s.lastBeat) > staleAfter/3)
	if heldUp || s.beatingSince.IsZero() {
		s.beatingSince = time.UnixMilli(now)
	}
	// Judge others only after beating on time for a whole staleness window
	// ourselves: then a silent relay was silent while the lock was to be had.
	judge := !heldUp && time.UnixMilli(now).Sub(s.beatingSince) >= staleAfter
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, in_flight)
VALUES (?1, ?2, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at, in_flight = excluded.in_flight`,
		s.instance, now, host, os.Getpid(), version, s.inFlight()); err != nil {
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
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+schema.InstancesTable+` WHERE heartbeat_at < ?`, staleBefore); err != nil {
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
	s.registered.Store(true)
	s.leads.Store(leader == s.instance)
	if reclaimed > 0 {
		s.rescanAll()
	}
	return reclaimed, nil
}

// leaderSQL names the relay that leads: the longest-running one among the
// heartbeat rows. A relay that stops heartbeating loses its row (and the
// lead) once another has judged it dead (see Heartbeat), so a standby
// takes over in about the time crash recovery takes.
const leaderSQL = `SELECT instance_id FROM ` + schema.InstancesTable + ` ORDER BY started_at, instance_id LIMIT 1`

// Leads reports whether this relay led at its latest heartbeat. Only the
// leader claims rows; the others stand by.
func (s *Store) Leads() bool { return s.leads.Load() }

// Leave removes this instance's heartbeat row, and with it the lead; call
// it after the rows in flight have been settled.
func (s *Store) Leave(ctx context.Context) error {
	if _, err := s.db.Exec(ctx, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = ?`, s.instance); err != nil {
		return fmt.Errorf("remove instance: %w", err)
	}
	return nil
}

// Instance returns the id of this store's heartbeat row.
func (s *Store) Instance() string { return s.instance }
