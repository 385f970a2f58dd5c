// Package lead owns this relay's heartbeat row in the database file and
// the lead: of the relays heartbeating on one file, the longest-running
// one claims and publishes, the others stand by. Heartbeats also take back
// rows that a claimer which writes its claims (marking rows processing)
// left behind when its lease expired or it stopped heartbeating.
package lead

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Lease is this relay's heartbeat row and its claim to the lead. One
// heartbeat loop calls Heartbeat; the other methods may be called from any
// goroutine.
type Lease struct {
	db       *sqlitedb.DB
	instance string
	reclaim  string      // the statement taking back rows left processing
	leads    atomic.Bool // this relay led at its latest heartbeat
	// started is its heartbeat row's started_at, as the latest heartbeat
	// committed it (a row written again gets another); ledWith is that
	// started_at while the latest heartbeat said it leads, else 0 (see
	// StillLeads). Only the heartbeat writes started.
	started int64
	ledWith atomic.Int64
	// registered: a heartbeat committed, so settles are fenced by the lead.
	registered atomic.Bool
	// beat is the heartbeat_at the latest committed heartbeat wrote;
	// floor is the least heartbeat_at a claim accepts (see ClaimFence):
	// beat, or lower while a heartbeat that writes a lower one (the clock
	// stepped back) commits. fenced is the started_at of the row claims
	// accept.
	beat, floor, fenced atomic.Int64
	lastBeat            time.Time // the last committed heartbeat (monotonic)
	beatingSince        time.Time // since when heartbeats have been on time (monotonic)
	// seen is what the heartbeat read of the others' heartbeats (see
	// buryStale); only the heartbeat touches it.
	seen map[string]sighting
	// scope is where this process's pid means this process (see
	// processScope); "" when it cannot be known.
	scope string
	// batchLimit, when set, says how many rows of an ordering key the
	// relay sends as one atomic batch, for the heartbeat row.
	batchLimit func() int
	// now is the wall clock heartbeats write, in Unix ms (tests skew it).
	now func() int64
}

// ReportBatches makes every heartbeat record limit(): how many rows of an
// ordering key the relay sends as one atomic batch (0: one at a time), for
// status. Without it the heartbeat records nothing (core NATS).
func (l *Lease) ReportBatches(limit func() int) { l.batchLimit = limit }

// New returns a Lease on db with a new instance id; nothing is written
// before the first Heartbeat.
func New(db *sqlitedb.DB) *Lease {
	return &Lease{db: db, instance: event.NewID(), scope: processScope(), now: sqlitedb.NowMs,
		// Rows marked processing by a claimer that writes its claims (an
		// older relay, or another implementation of the same design) are
		// taken back when their lease expired, or at once when their owner
		// stopped heartbeating (crashed); a live owner's claims are never
		// taken before the lease.
		reclaim: fmt.Sprintf(`UPDATE %s SET status = 'pending', claimed_at = NULL, claimed_by = NULL
WHERE status = 'processing' AND (
	claimed_at IS NULL OR claimed_at < ?1
	OR (claimed_by IS NOT NULL AND claimed_by <> ?2
		AND claimed_by NOT IN (SELECT instance_id FROM `+schema.InstancesTable+`)))`, db.Table()),
	}
}

// LeadsIn reports, inside tx, whether this relay may write settlements:
// it has never heartbeated (a relay alone, that keeps no heartbeat), or it
// is the leader now. Checked in the settle's own transaction, it fences a
// relay that was paused (SIGSTOP, a frozen VM) and lost the lead meanwhile.
func (l *Lease) LeadsIn(ctx context.Context, tx *sql.Tx) (bool, error) {
	if !l.registered.Load() {
		return true, nil
	}
	leads, _, err := l.leadsBy(ctx, tx)
	return leads, err
}

// leadsBy reports whether the table, as q reads it, names this relay its
// leader (leaderSQL), and the leader's started_at as SQLite quotes it.
func (l *Lease) leadsBy(ctx context.Context, q sqlitedb.Querier) (leads bool, started string, err error) {
	var leader string
	err = q.QueryRowContext(ctx, leaderSQL, l.db.Table()).Scan(&leader, &started)
	if errors.Is(err, sql.ErrNoRows) {
		return false, "", nil
	}
	if err != nil {
		return false, "", fmt.Errorf("read the lead: %w", err)
	}
	return leader == l.instance, started, nil
}

// Heartbeat records that this instance is alive, with the rows it has in
// flight, and makes rows marked processing by a writing claimer
// reclaimable whose lease expired or whose owner stopped heartbeating for
// staleAfter; it removes such owners' heartbeat rows, and with them their
// lead. It returns how many rows went back to pending. From the first
// heartbeat on, LeadsIn is true only while this relay leads.
//
// Another relay is judged dead only when this one has itself been
// heartbeating on time for a whole staleAfter: a heartbeat held up for a
// third of staleAfter (waiting for the lock, or following a late one) means
// the application likely held the write lock, every relay's heartbeat
// waited too, and their silence proves nothing until they have had as long
// again to catch up.
func (l *Lease) Heartbeat(ctx context.Context, version string, inFlight int, lease, staleAfter time.Duration) (reclaimed int64, err error) {
	defer func() { err = sqlitedb.Explain(l.db.Path(), sqlitedb.NotWritable(l.db.Path(), err)) }()
	host, _ := os.Hostname()
	asked := time.Now()
	tx, err := l.db.Begin(ctx) // BEGIN IMMEDIATE: waits for the lock
	if err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	defer tx.Rollback()
	now := l.now() // taken with the lock held, so it is not already late
	heldUp := time.Since(asked) > staleAfter/3 || (!l.lastBeat.IsZero() && time.Since(l.lastBeat) > staleAfter/3)
	if heldUp || l.beatingSince.IsZero() {
		l.beatingSince = time.Now()
	}
	// Judge others only after beating on time for a whole staleness window
	// ourselves: then a silent relay was silent while the lock was to be had.
	judge := !heldUp && time.Since(l.beatingSince) >= staleAfter
	if err := l.buryDead(ctx, tx); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	if err := l.buryStale(ctx, tx, staleAfter, judge); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	var batchLimit any // NULL: not reported
	if l.batchLimit != nil {
		batchLimit = l.batchLimit()
	}
	last, beat := l.beat.Load(), now
	if beat < l.floor.Load() {
		l.floor.Store(beat) // the clock stepped back: claims accept it before it commits
	}
	res, err := tx.ExecContext(ctx, `UPDATE `+schema.InstancesTable+` SET heartbeat_at = ?2, in_flight = ?3, atomic_batch_limit = ?4
WHERE instance_id = ?1 AND (?5 = 0 OR heartbeat_at = ?5)`,
		l.instance, beat, inFlight, batchLimit, last)
	if err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	// A relay whose row is gone after it had one was judged dead (paused
	// past the staleness, say), and another relay may have led since; one
	// whose row holds an earlier heartbeat than the last it wrote finds
	// the file gone back in time (a backup written into it in place),
	// with rows pending that it published since. Either way it lost the
	// lead, joins again with a new started_at, and does not lead at this
	// heartbeat. Leading at a later one, it begins to lead anew, and first
	// finds what was published meanwhile.
	rejoined, started := false, l.started
	if n, _ := res.RowsAffected(); n == 0 {
		started = now
		if started == l.started {
			started++ // another row than the one claims accepted (ClaimFence)
		}
		rejoined = l.registered.Load()
		if _, err := tx.ExecContext(ctx, `INSERT OR REPLACE INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, in_flight, outbox_table, process_scope, atomic_batch_limit)
VALUES (?1, ?2, ?10, ?3, ?4, ?5, ?6, ?7, ?8, ?9)`,
			l.instance, started, host, os.Getpid(), version, inFlight, l.db.Table(), l.scope, batchLimit, beat); err != nil {
			return 0, fmt.Errorf("heartbeat: %w", err)
		}
	}
	// The relays buried above lost their rows: their claims come back.
	res, err = tx.ExecContext(ctx, l.reclaim, now-lease.Milliseconds(), l.instance)
	if err != nil {
		return 0, fmt.Errorf("reclaim rows: %w", err)
	}
	reclaimed, _ = res.RowsAffected()
	var leader, leaderStarted string
	if err := tx.QueryRowContext(ctx, leaderSQL, l.db.Table()).Scan(&leader, &leaderStarted); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	l.lastBeat = time.Now()
	l.beat.Store(beat)
	l.floor.Store(beat)
	l.fenced.Store(started)
	l.registered.Store(true)
	l.started = started
	leads := leader == l.instance && !rejoined
	if leads {
		l.ledWith.Store(started)
	} else {
		l.ledWith.Store(0)
	}
	l.leads.Store(leads)
	return reclaimed, nil
}

// leaderSQL names the relay that leads on the outbox table ?1: the
// longest-running one among the heartbeat rows of relays of that table,
// the first registered of those started in the same millisecond
// (each outbox table in a file has its own leader; a row from a relay that
// predates outbox_table counts for every table). A relay that stops
// heartbeating loses its row (and the lead) once another has judged it
// dead (see Heartbeat), so a standby takes over in about the time crash
// recovery takes.
const leaderSQL = `SELECT instance_id, quote(started_at) FROM ` + schema.InstancesTable + `
WHERE lower(coalesce(outbox_table, ?1)) = lower(?1) ORDER BY started_at, rowid LIMIT 1`

// Leads reports whether this relay led at its latest heartbeat. Only the
// leader claims rows; the others stand by.
func (l *Lease) Leads() bool { return l.leads.Load() }

// StillLeads reports whether this relay's heartbeat row is there and leads
// now, reading the table without the write lock (the application may hold
// it). Another relay takes the lead by removing this one's row, or by
// writing its own with an earlier started_at (its clock behind this
// one's), in a write of its own: while the row is there and first, nobody
// else leads. The row must be the one the latest heartbeat led with: a
// relay judged dead and joined again (a row written again, with another
// started_at) does not lead until a heartbeat says so, and then begins to
// lead anew; read between the two, the new row alone would say it leads.
func (l *Lease) StillLeads(ctx context.Context) (bool, error) {
	led := l.ledWith.Load()
	if led == 0 {
		return false, nil
	}
	leads, started, err := l.leadsBy(ctx, l.db.Reader())
	return leads && started == strconv.FormatInt(led, 10), err
}

// ClaimFence returns this relay's instance id, its heartbeat row's
// started_at and the heartbeat_at its latest heartbeat wrote, or "" before
// its first: a claim reads rows only while the row holds that started_at
// and that heartbeat or a later one. Only this relay's heartbeats write
// the row, so a row gone (judged dead) or holding an earlier heartbeat
// (the file restored from a backup in place) stops claims; the next
// heartbeat joins again with another started_at, which the claims that
// took the fence before it do not accept, and does not lead at once (see
// Heartbeat).
func (l *Lease) ClaimFence() (instance string, started, beat int64) {
	if !l.registered.Load() {
		return "", 0, 0
	}
	return l.instance, l.fenced.Load(), l.floor.Load()
}

// Leave removes this instance's heartbeat row, and with it the lead; call
// it after the rows in flight have been settled.
func (l *Lease) Leave(ctx context.Context) error {
	if _, err := l.db.Exec(ctx, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = ?`, l.instance); err != nil {
		return fmt.Errorf("remove instance: %w", err)
	}
	return nil
}

// Instance returns the id of this relay's heartbeat row.
func (l *Lease) Instance() string { return l.instance }
