// Package ledger runs an application's event handlers on the events
// outbox-relay publishes, and records in a ledger which handler has handled
// which event, so that an event delivered again does not run a handler
// again.
//
// Three parts share one protocol. The Ledger records, in the
// processed_events table of the application's SQLite file, which handler
// has handled which event: a handler runs only after its (event_id,
// handler) row is claimed, and the row is marked done when the handler
// succeeds, or released when it fails. Handlers maps event types to
// handlers and runs them through the Ledger. A Worker feeds Handlers from a
// durable JetStream pull consumer, mapping each answer to an
// acknowledgement; a TableSource feeds the same Handlers straight from the
// outbox table, for deployments without NATS.
//
// Handlers still run at least once: a process that dies after a handler's
// effect and before its done mark leaves a claim that another process takes
// over once the claim's heartbeat stops (StaleAfter), and the handler runs
// again. HandleTx closes that window for effects written to the same SQLite
// file, by committing them in the transaction that marks the claim done.
package ledger

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
)

// Table is the ledger's table, created by outbox-relay's migrations:
//
//	CREATE TABLE processed_events (
//		event_id     TEXT NOT NULL,
//		handler      TEXT NOT NULL,
//		status       TEXT NOT NULL,   -- in_progress, done
//		started_at   INTEGER,         -- Unix ms; the claim's owner token
//		processed_at INTEGER,         -- Unix ms: once done, when; before, the holder's last heartbeat
//		PRIMARY KEY (event_id, handler)
//	)
const Table = "processed_events"

// DefaultLease is how long a claim is held at most before another process
// may take it over, even from a holder that is alive: longer than any
// handler runs.
const DefaultLease = 30 * time.Minute

// DefaultStaleAfter is how long a claim's holder may go without a
// heartbeat before another process takes it for dead and the claim over.
const DefaultStaleAfter = 15 * time.Second

// ErrClaimLost is returned when a claim's owner token no longer matches its
// row: another process took the claim over (its lease expired, or its
// heartbeat went stale), or an operator removed it. The done mark or the
// release changed nothing.
var ErrClaimLost = errors.New("ledger claim lost: another process took it over")

// Options tune a Ledger. Give every process on the file the same Lease and
// StaleAfter: each judges the others' claims by its own.
type Options struct {
	// Lease is how long a claim is held at most before another process
	// may take it over, however alive its holder (DefaultLease when 0):
	// longer than any handler runs.
	Lease time.Duration
	// StaleAfter is how long a claim's holder may go without heartbeating
	// it before another process takes the holder for dead and the claim
	// over (DefaultStaleAfter when 0). A Ledger heartbeats the claims it
	// holds every StaleAfter/5, by writing their processed_at.
	StaleAfter time.Duration
	// Now is the clock (time.Now when nil).
	Now func() time.Time
	// Log receives the heartbeat's failures, once per change (none when
	// nil).
	Log *zap.Logger
}

// Ledger claims and marks (event_id, handler) rows in processed_events on
// db, a pool on the application's SQLite file. Give db a busy timeout
// (go-sqlite3: _busy_timeout=5000): claims are short writes beside the
// application's own.
type Ledger struct {
	db         *sql.DB
	lease      time.Duration
	staleAfter time.Duration
	now        func() time.Time
	beats      heartbeat
}

// New returns a Ledger on db.
func New(db *sql.DB, o Options) *Ledger {
	l := &Ledger{db: db, lease: o.Lease, staleAfter: o.StaleAfter, now: o.Now}
	if l.lease <= 0 {
		l.lease = DefaultLease
	}
	if l.staleAfter <= 0 {
		l.staleAfter = DefaultStaleAfter
	}
	if l.now == nil {
		l.now = time.Now
	}
	l.beats.init(o.Log, l.staleAfter, l.lease)
	return l
}

// State is what a claim attempt found.
type State int

const (
	// Claimed: the caller holds the claim and runs the handler.
	Claimed State = iota
	// AlreadyDone: the handler has handled the event; skip it.
	AlreadyDone
	// Busy: another process holds a live claim; try again at the time
	// Claim returns, when it may be taken over.
	Busy
)

// String names the state.
func (s State) String() string {
	switch s {
	case Claimed:
		return "claimed"
	case AlreadyDone:
		return "already done"
	case Busy:
		return "busy"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Claim is a held claim on (EventID, Handler). Token is the claim's
// started_at in Unix milliseconds, which every later write is conditioned
// on. The Ledger heartbeats the claim until it is marked done or released.
type Claim struct {
	// EventID is the event's id (its message's Nats-Msg-Id).
	EventID string
	// Handler names the handler the claim is for.
	Handler string
	// Token is the claim's started_at in Unix milliseconds: the claim's
	// done mark, release and heartbeats write only while it is unchanged,
	// so a claim taken over writes nothing.
	Token int64
	l     *Ledger
}

// claimSQL inserts a fresh claim or takes over one whose holder is gone
// (?5: the oldest heartbeat, processed_at, of a live holder) or whose
// lease expired (?4: the oldest started_at still held), in one statement.
// A claim whose processed_at is NULL has a holder that does not heartbeat:
// only its lease ends it. A takeover's token is later than the old one
// even within the same millisecond.
const claimSQL = `INSERT INTO ` + Table + ` (event_id, handler, status, started_at, processed_at) VALUES (?1, ?2, 'in_progress', ?3, ?3)
ON CONFLICT (event_id, handler) DO UPDATE SET status = 'in_progress', processed_at = excluded.processed_at,
	started_at = max(excluded.started_at, coalesce(` + Table + `.started_at, 0) + 1)
WHERE ` + Table + `.status <> 'done'
	AND (` + Table + `.started_at IS NULL OR ` + Table + `.started_at < ?4 OR ` + Table + `.processed_at < ?5)
RETURNING started_at`

// Claim claims (eventID, handler). It returns the claim when the caller
// holds it (Claimed); AlreadyDone when the handler has handled the event;
// Busy, with the earliest time the other claim may be taken over, when
// another process holds a claim that is alive. An error means nothing is
// known: do not run the handler.
func (l *Ledger) Claim(ctx context.Context, eventID, handler string) (*Claim, State, time.Time, error) {
	if eventID == "" || handler == "" {
		return nil, 0, time.Time{}, errors.New("ledger claim: event id and handler must not be empty")
	}
	// A row released between the two statements below is claimed on the
	// next round; three rounds cover any such race.
	for range 3 {
		now := l.now().UnixMilli()
		var token int64
		err := l.db.QueryRowContext(ctx, claimSQL, eventID, handler, now, now-l.lease.Milliseconds(), now-l.staleAfter.Milliseconds()).Scan(&token)
		if err == nil {
			c := &Claim{EventID: eventID, Handler: handler, Token: token, l: l}
			l.beats.hold(l, c)
			return c, Claimed, time.Time{}, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return nil, 0, time.Time{}, fmt.Errorf("ledger claim %s/%s: %w", eventID, handler, err)
		}
		var status string
		var started, beat sql.NullInt64
		err = l.db.QueryRowContext(ctx, `SELECT status, started_at, processed_at FROM `+Table+` WHERE event_id = ? AND handler = ?`, eventID, handler).Scan(&status, &started, &beat)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			continue // released meanwhile
		case err != nil:
			return nil, 0, time.Time{}, fmt.Errorf("ledger claim %s/%s: %w", eventID, handler, err)
		case status == "done":
			return nil, AlreadyDone, time.Time{}, nil
		default:
			return nil, Busy, l.busyUntil(started.Int64, beat), nil
		}
	}
	return nil, 0, time.Time{}, fmt.Errorf("ledger claim %s/%s: the row keeps changing", eventID, handler)
}

// busyUntil is when a claim started at started, last heartbeated at beat
// (NULL: its holder does not heartbeat), may be taken over: a millisecond
// after its lease ends, or after its heartbeat goes stale if that comes
// first. A live holder's next heartbeat moves the second on.
func (l *Ledger) busyUntil(started int64, beat sql.NullInt64) time.Time {
	until := started + l.lease.Milliseconds()
	if beat.Valid {
		until = min(until, beat.Int64+l.staleAfter.Milliseconds())
	}
	return time.UnixMilli(until + 1)
}

type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// Done marks the claim done. ErrClaimLost means another process took the
// claim over: its handler may run (or have run) too.
func (c *Claim) Done(ctx context.Context) error { return c.done(ctx, c.l.db) }

// DoneTx marks the claim done inside tx, the transaction that holds the
// handler's own writes: they commit together or not at all. On
// ErrClaimLost roll tx back: another process holds the claim.
func (c *Claim) DoneTx(ctx context.Context, tx *sql.Tx) error { return c.done(ctx, tx) }

func (c *Claim) done(ctx context.Context, db execer) error {
	return c.write(ctx, db, "mark done", `UPDATE `+Table+` SET status = 'done', processed_at = ?4
WHERE event_id = ?1 AND handler = ?2 AND started_at = ?3 AND status = 'in_progress'`, c.l.now().UnixMilli())
}

// Release gives the claim up after the handler failed, so that the next
// delivery claims it at once. ErrClaimLost means another process had taken
// it over already.
func (c *Claim) Release(ctx context.Context) error {
	return c.write(ctx, c.l.db, "release", `DELETE FROM `+Table+`
WHERE event_id = ?1 AND handler = ?2 AND started_at = ?3 AND status = 'in_progress'`)
}

// write runs q, conditioned on the claim's token. Whatever the outcome, the
// claim is no longer heartbeated: marked done, released, lost, or left
// after an error for another process to take over once it goes stale.
func (c *Claim) write(ctx context.Context, db execer, what, q string, args ...any) error {
	c.l.beats.drop(c)
	res, err := db.ExecContext(ctx, q, append([]any{c.EventID, c.Handler, c.Token}, args...)...)
	if err != nil {
		return fmt.Errorf("ledger %s %s/%s: %w", what, c.EventID, c.Handler, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("ledger %s %s/%s: %w", what, c.EventID, c.Handler, err)
	} else if n == 0 {
		return fmt.Errorf("ledger %s %s/%s: %w", what, c.EventID, c.Handler, ErrClaimLost)
	}
	return nil
}
