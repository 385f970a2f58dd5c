package ledger

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// TableSource defaults.
const (
	// DefaultTable is the outbox table a TableSource consumes by default.
	DefaultTable = "event_queue"
	// DefaultMaxAttempts is the relay's relay.max_attempts default: an
	// event whose handlers fail this many deliveries is dead-lettered.
	DefaultMaxAttempts = 10
	// DefaultTableLease is how long a row a TableSource marked processing
	// stays its own before any TableSource takes it back: longer than any
	// handler runs.
	DefaultTableLease = 600 * time.Second
	// DefaultBatch is how many due rows a TableSource claims at once.
	DefaultBatch = 100
	// DefaultPollInterval is how often an idle TableSource looks for due
	// rows.
	DefaultPollInterval = time.Second
)

// RelayStaleAfter is how recent a heartbeat in outbox_relay_instances must
// be for a TableSource to take its relay for alive: the relay's own
// staleAfter, after which relays judge each other dead. Relays heartbeat
// every second.
const RelayStaleAfter = 6 * time.Second

// ErrRelayRunning is wrapped by TableSource.Run's error when an
// outbox-relay heartbeats on the file: the relay and a TableSource must not
// both consume the same table.
var ErrRelayRunning = errors.New("an outbox-relay is running on this file")

// TableOptions tune a TableSource.
type TableOptions struct {
	// Table is the outbox table, a plain SQL identifier (DefaultTable when
	// empty).
	Table string
	// MaxAttempts is how many deliveries an event gets before it is
	// dead-lettered: the relay's relay.max_attempts (DefaultMaxAttempts
	// when 0).
	MaxAttempts int
	// Lease is how long a claimed row stays processing before a
	// TableSource takes it back and delivers it again (DefaultTableLease
	// when 0).
	Lease time.Duration
	// Batch is how many due rows are claimed at once (DefaultBatch when 0).
	Batch int
	// PollInterval is how often an idle source looks for due rows
	// (DefaultPollInterval when 0).
	PollInterval time.Duration
	// Backoff is the delay before the next delivery after a failed one
	// (the package's Backoff when nil).
	Backoff func(deliveries int) time.Duration
	// Log receives the source's log lines (none when nil).
	Log *zap.Logger
	// Now is the clock the rows' times are read and written with
	// (time.Now when nil).
	Now func() time.Time
}

// TableSource feeds Handlers straight from the outbox table, for
// deployments that run no NATS. It claims due pending rows in id order by
// marking them processing with its own id (ID) in claimed_by, runs each
// row's handlers through Handlers.Dispatch, and settles the row by its
// Verdict, the way the relay settles a published row:
//
//   - every handler done or skipped: status done;
//   - a handler's ledger claim held elsewhere: back to pending, due when
//     that claim may be taken over, no attempt spent;
//   - a handler failed, or the ledger could not be read: one attempt
//     spent and last_error written; pending again after the Backoff, or
//     dead_lettered once MaxAttempts is reached.
//
// Every settle is conditioned on the row still being processing under
// the source's id: a row taken back meanwhile is left to whoever took it.
// Several TableSources may consume one table: each claims its own rows.
//
// A TableSource and outbox-relay must not both consume the same table:
// the relay publishes the pending rows the source would handle, and takes
// back, as a dead claimer's, rows the source holds processing. Run
// refuses to start while a relay heartbeats on the file, and stops when
// one begins to. A relay's heartbeat does not name its table, so any
// relay on the file counts.
//
// The database needs outbox-relay's migrations (outbox-relay migrate):
// the claimed_by column and the relay's heartbeat table. Give db a busy
// timeout (go-sqlite3: _busy_timeout=5000); claims and settles are short
// writes beside the application's own.
type TableSource struct {
	db  *sql.DB
	h   *Handlers
	o   TableOptions
	id  string
	log *zap.Logger
	q   tableQueries
}

// NewTableSource returns a TableSource on db, a pool on the application's
// SQLite file (usually the one its Handlers' Ledger writes), that runs h.
func NewTableSource(db *sql.DB, h *Handlers, o TableOptions) (*TableSource, error) {
	if db == nil || h == nil {
		return nil, errors.New("ledger table source: a database and Handlers are required")
	}
	if o.Table == "" {
		o.Table = DefaultTable
	}
	if !schema.PlainIdentifier(o.Table) {
		return nil, fmt.Errorf("ledger table source: table %q is not a plain SQL identifier (letters, digits, underscore)", o.Table)
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = DefaultMaxAttempts
	}
	if o.Lease <= 0 {
		o.Lease = DefaultTableLease
	}
	if o.Batch <= 0 {
		o.Batch = DefaultBatch
	}
	if o.PollInterval <= 0 {
		o.PollInterval = DefaultPollInterval
	}
	if o.Backoff == nil {
		o.Backoff = Backoff
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	s := &TableSource{db: db, h: h, o: o, id: "table-source-" + event.NewID(), q: newTableQueries(o.Table)}
	s.log = o.Log
	if s.log == nil {
		s.log = zap.NewNop()
	}
	s.log = s.log.With(zap.String("table", o.Table), zap.String("source", s.id))
	return s, nil
}

// ID is the source's claimed_by value on the rows it holds processing.
func (s *TableSource) ID() string { return s.id }

// tableQueries are the statements on the outbox table, built once for its
// name.
type tableQueries struct {
	stale, reclaim, due, claim, renew, done, later, retry, deadLetter, release string
}

// ownRow is the condition of every write on a claimed row: it is still
// processing under this source's id (?2), so a row taken back meanwhile is
// left alone.
const ownRow = `id = ?1 AND status = 'processing' AND claimed_by = ?2`

func newTableQueries(table string) tableQueries {
	t := `"` + table + `"`
	// A claimed_at that is no time counts as long ago: such a row is
	// taken back instead of staying processing forever.
	expired := `(claimed_at IS NULL OR coalesce(` + schema.MsSQL("claimed_at") + `, 0) < ?1)`
	const free = `status = 'pending', claimed_at = NULL, claimed_by = NULL`
	return tableQueries{
		stale:   `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE status = 'processing' AND ` + expired + `)`,
		reclaim: `UPDATE ` + t + ` SET ` + free + ` WHERE status = 'processing' AND ` + expired,
		due:     `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE status = 'pending' AND ` + schema.DueSQL("?1") + `)`,
		// One statement, so one short write transaction; fenced by the
		// relay's heartbeats (?4: the oldest heartbeat of a live relay).
		// +?3: a bare parameter in LIMIT makes SQLite compile a cached
		// statement again at every bind.
		claim: `UPDATE ` + t + ` SET status = 'processing', claimed_at = ?1, claimed_by = ?2
WHERE id IN (SELECT id FROM ` + t + ` WHERE status = 'pending' AND ` + schema.DueSQL("?1") + ` ORDER BY id LIMIT +?3)
	AND NOT EXISTS (SELECT 1 FROM ` + schema.InstancesTable + ` WHERE heartbeat_at >= ?4)
RETURNING id, event_id, CAST(coalesce(event_type, '') AS TEXT), CAST(payload AS BLOB), CAST(coalesce(attempts, 0) AS INTEGER)`,
		// A row's claim starts again when its handlers start: a batch that
		// takes longer than the lease keeps its later rows, and a row taken
		// back meanwhile is not handled.
		renew:      `UPDATE ` + t + ` SET claimed_at = ?3 WHERE ` + ownRow,
		done:       `UPDATE ` + t + ` SET status = 'done', processed_at = ?3, claimed_at = NULL, claimed_by = NULL WHERE ` + ownRow,
		later:      `UPDATE ` + t + ` SET ` + free + `, available_at = ?3 WHERE ` + ownRow,
		retry:      `UPDATE ` + t + ` SET ` + free + `, attempts = ?3, available_at = ?4, last_error = ?5 WHERE ` + ownRow,
		deadLetter: `UPDATE ` + t + ` SET status = 'dead_lettered', claimed_at = NULL, claimed_by = NULL, attempts = ?3, last_error = ?4, processed_at = ?5 WHERE ` + ownRow,
		release:    `UPDATE ` + t + ` SET ` + free + ` WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'processing' AND claimed_by = ?2`,
	}
}

// tableRow is a claimed row.
type tableRow struct {
	id       int64
	eventID  sql.NullString
	typ      string
	payload  []byte
	attempts int
	// invalid says why the row's event_id cannot be its events' key in
	// the ledger ("": it can).
	invalid string
}

// readEventID reads a claimed row's event_id as the relay does: TEXT that
// could be a Nats-Msg-Id, or NULL (no id: the handlers run without the
// ledger). Anything else is why the row is dead-lettered: a BLOB or a
// number would share its key in the ledger with the TEXT of its bytes.
func readEventID(v any) (id sql.NullString, invalid string) {
	if invalid = event.EventIDNotText(v); invalid != "" || v == nil {
		return id, invalid
	}
	s := v.(string)
	if err := event.ValidateEventID(s); err != nil {
		return id, err.Error()
	}
	return sql.NullString{String: s, Valid: true}, ""
}

// Run consumes the table until ctx ends. Each round it takes back rows
// whose claim is older than Lease, claims up to Batch due pending rows in
// id order, and handles them one at a time; it waits PollInterval when
// the table has no more due rows.
//
// When ctx ends, the row being handled is finished (handlers get a
// context that is not cancelled, as with the Worker) and settled, the
// rows claimed but not started go back to pending without spending an
// attempt, and Run returns nil.
//
// Run returns an error wrapping ErrRelayRunning, naming the relay, at once
// when an outbox-relay heartbeats on the file, and later when one begins
// to: it then finishes and settles the row being handled and puts the
// rest back first, so the relay finds nothing held. It returns an error
// at once when the table lacks the columns it needs. Other database
// errors are logged and the round tried again after PollInterval.
func (s *TableSource) Run(ctx context.Context) error {
	if err := s.checkSchema(ctx); err != nil {
		return err
	}
	s.log.Info("table source starting", zap.Int("max_attempts", s.o.MaxAttempts), zap.Duration("lease", s.o.Lease))
	for {
		if ctx.Err() != nil {
			return nil
		}
		rows, claimErr := s.claim(ctx)
		if errors.Is(claimErr, ErrRelayRunning) {
			return claimErr
		}
		if claimErr != nil && ctx.Err() == nil {
			s.log.Warn("claim rows", zap.Error(claimErr))
		}
		if err := s.handle(ctx, rows); err != nil {
			return err
		}
		if claimErr == nil && len(rows) == s.o.Batch {
			continue // more may be due
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(s.o.PollInterval):
		}
	}
}

// requiredColumns are the outbox columns a TableSource reads or writes.
var requiredColumns = []string{"id", "event_id", "event_type", "payload", "status", "attempts", "available_at", "claimed_at", "claimed_by", "processed_at", "last_error"}

func (s *TableSource) checkSchema(ctx context.Context) error {
	cols, err := sqlitedb.Columns(ctx, s.db, s.o.Table)
	if err != nil {
		return fmt.Errorf("ledger table source: %w", err)
	}
	if len(cols) == 0 {
		return fmt.Errorf("ledger table source: table %s does not exist: create it with outbox-relay migrate", s.o.Table)
	}
	var missing []string
	for _, c := range requiredColumns {
		if !cols[c] {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("ledger table source: table %s lacks column(s) %s: upgrade it with outbox-relay migrate", s.o.Table, strings.Join(missing, ", "))
	}
	inst, err := sqlitedb.Columns(ctx, s.db, schema.InstancesTable)
	if err != nil {
		return fmt.Errorf("ledger table source: %w", err)
	}
	if !inst["heartbeat_at"] {
		return fmt.Errorf("ledger table source: table %s (the relay's heartbeats) is missing: create it with outbox-relay migrate", schema.InstancesTable)
	}
	return nil
}

// relayAliveSince is the oldest heartbeat of a relay still taken for alive.
func (s *TableSource) relayAliveSince() int64 {
	return s.o.Now().Add(-RelayStaleAfter).UnixMilli()
}

// checkRelay returns an error wrapping ErrRelayRunning when a relay has
// heartbeated within RelayStaleAfter.
func (s *TableSource) checkRelay(ctx context.Context) error {
	var id string
	var host sql.NullString
	var pid sql.NullInt64
	var beat int64
	err := s.db.QueryRowContext(ctx, `SELECT instance_id, CAST(hostname AS TEXT), CAST(pid AS INTEGER), heartbeat_at FROM `+schema.InstancesTable+`
WHERE heartbeat_at >= ? ORDER BY heartbeat_at DESC LIMIT 1`, s.relayAliveSince()).Scan(&id, &host, &pid, &beat)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		if ctx.Err() != nil {
			return nil // stopping; the caller sees ctx
		}
		return fmt.Errorf("ledger table source: look for a running relay in %s: %w", schema.InstancesTable, err)
	}
	ago := s.o.Now().Sub(time.UnixMilli(beat)).Round(time.Millisecond)
	return fmt.Errorf("ledger table source on table %s: %w (instance %s on host %q, pid %d, heartbeated %v ago): the relay and a TableSource must not both consume the same table; stop the relay, or consume its stream with a Worker",
		s.o.Table, ErrRelayRunning, id, host.String, pid.Int64, ago)
}

// claim looks for a relay's heartbeat, takes back expired claims, then
// claims due rows. The writes happen only when a read found something to
// do, so an idle source takes no write lock.
func (s *TableSource) claim(ctx context.Context) ([]tableRow, error) {
	if err := s.checkRelay(ctx); err != nil {
		return nil, err
	}
	// The writes are not cut off by ctx: a claim interrupted half way
	// could leave rows processing that nobody handles until the lease
	// expires. busy_timeout bounds them.
	wctx := context.WithoutCancel(ctx)
	now := s.o.Now().UnixMilli()
	expiredBefore := now - s.o.Lease.Milliseconds()
	var stale bool
	if err := s.db.QueryRowContext(ctx, s.q.stale, expiredBefore).Scan(&stale); err != nil {
		return nil, fmt.Errorf("look for expired claims: %w", err)
	}
	if stale {
		res, err := s.db.ExecContext(wctx, s.q.reclaim, expiredBefore)
		if err != nil {
			return nil, fmt.Errorf("take back expired claims: %w", err)
		}
		if n, _ := res.RowsAffected(); n > 0 {
			s.log.Warn("took back rows whose claim outlived the lease", zap.Int64("rows", n), zap.Duration("lease", s.o.Lease))
		}
	}
	var due bool
	if err := s.db.QueryRowContext(ctx, s.q.due, now).Scan(&due); err != nil {
		return nil, fmt.Errorf("look for due rows: %w", err)
	}
	if !due || ctx.Err() != nil {
		return nil, nil
	}
	rows, err := s.db.QueryContext(wctx, s.q.claim, now, s.id, s.o.Batch, s.relayAliveSince())
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	defer rows.Close()
	var out []tableRow
	for rows.Next() {
		var r tableRow
		var eventID any
		if err := rows.Scan(&r.id, &eventID, &r.typ, &r.payload, &r.attempts); err != nil {
			return out, fmt.Errorf("claim rows: %w", err)
		}
		r.eventID, r.invalid = readEventID(eventID)
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return out, fmt.Errorf("claim rows: %w", err)
	}
	// RETURNING does not promise an order.
	slices.SortFunc(out, func(a, b tableRow) int { return cmp.Compare(a.id, b.id) })
	return out, nil
}

// handle runs the claimed rows in order, looking for a relay's heartbeat
// before each (one read of a small table, beside the ledger's writes). When
// ctx ends, or a relay starts heartbeating, it puts the rows not started
// back; it returns the relay's error then.
func (s *TableSource) handle(ctx context.Context, rows []tableRow) error {
	for i, r := range rows {
		var stop error
		if ctx.Err() == nil {
			stop = s.checkRelay(ctx)
			if stop != nil && !errors.Is(stop, ErrRelayRunning) {
				s.log.Warn("look for a running relay", zap.Error(stop))
				stop = nil // the next claim looks again
			}
		}
		if ctx.Err() != nil || stop != nil {
			s.release(ctx, rows[i:])
			return stop
		}
		s.handleRow(context.WithoutCancel(ctx), r)
	}
	return nil
}

// handleRow dispatches one claimed row and settles it. ctx is not
// cancelled: a graceful stop does not cut a handler off half way.
func (s *TableSource) handleRow(ctx context.Context, r tableRow) {
	delivery := r.attempts + 1
	ev := Event{ID: r.eventID.String, Type: r.typ, Data: r.payload, Delivery: delivery}
	log := s.log.With(zap.Int64("id", r.id), zap.String("event_id", ev.ID), zap.String("event_type", ev.Type), zap.Int("delivery", delivery))
	if res, err := s.db.ExecContext(ctx, s.q.renew, r.id, s.id, s.o.Now().UnixMilli()); err != nil {
		log.Warn("renew the row's claim; it waits for the lease to run out", zap.Error(err))
		return
	} else if n, _ := res.RowsAffected(); n == 0 {
		log.Warn("the row was taken back before its handlers started; it is not handled here")
		return
	}
	if r.invalid != "" {
		// As the relay does with such a row: no handler runs, and no
		// delivery again would change it.
		log.Error("dead-lettered invalid row", zap.String("reason", r.invalid))
		s.settle(ctx, log, "dead-letter", s.q.deadLetter, r.id, s.id, delivery, r.invalid, s.o.Now().UnixMilli())
		return
	}
	v, err := s.h.Dispatch(ctx, ev)
	failed := v.failures(err)
	now := s.o.Now()
	switch {
	case len(failed) > 0:
		reasons := make([]string, len(failed))
		for i, f := range failed {
			reasons[i] = f.Error()
		}
		reason := strings.Join(reasons, "; ")
		if delivery >= s.o.MaxAttempts {
			for _, f := range failed {
				log.Error("event exhausted max attempts; dead-lettered", zap.String("handler", f.Handler), zap.Int("max_attempts", s.o.MaxAttempts), zap.Error(f.Err))
			}
			s.settle(ctx, log, "dead-letter", s.q.deadLetter, r.id, s.id, delivery, reason, now.UnixMilli())
			return
		}
		wait := s.o.Backoff(delivery)
		for _, f := range failed {
			log.Warn("handler failed; delivering again after the backoff", zap.String("handler", f.Handler), zap.Duration("delay", wait), zap.Error(f.Err))
		}
		s.settle(ctx, log, "retry", s.q.retry, r.id, s.id, delivery, now.Add(wait).UnixMilli(), reason)
	case !v.BusyUntil.IsZero():
		// Not before a second from now: a claim that may be taken over
		// already would bring the row straight back.
		until := v.BusyUntil
		if floor := now.Add(time.Second); until.Before(floor) {
			until = floor
		}
		log.Info("handler busy elsewhere; delivering again when its claim may be taken over", zap.Time("until", until))
		s.settle(ctx, log, "defer", s.q.later, r.id, s.id, until.UnixMilli())
	default:
		s.settle(ctx, log, "mark done", s.q.done, r.id, s.id, now.UnixMilli())
	}
}

// settle writes a claimed row's outcome.
func (s *TableSource) settle(ctx context.Context, log *zap.Logger, what, q string, args ...any) {
	res, err := s.db.ExecContext(ctx, q, args...)
	if err != nil {
		// The row stays processing until the lease expires, then comes
		// again; handlers that finished are skipped by the ledger.
		log.Error("settle row: "+what+"; it is delivered again once its lease expires", zap.Duration("lease", s.o.Lease), zap.Error(err))
		return
	}
	if n, err := res.RowsAffected(); err == nil && n == 0 {
		log.Warn("settle row: "+what+": the row was taken back while it was handled (its lease expired, or a relay reclaimed it); left to whoever holds it now", zap.Duration("lease", s.o.Lease))
	}
}

// release puts claimed rows that were not started back to pending, as
// they were, without spending an attempt.
func (s *TableSource) release(ctx context.Context, rows []tableRow) {
	if len(rows) == 0 {
		return
	}
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.id
	}
	js, _ := json.Marshal(ids)
	res, err := s.db.ExecContext(context.WithoutCancel(ctx), s.q.release, string(js), s.id)
	if err != nil {
		s.log.Error("put unstarted rows back to pending; they come again once their lease expires", zap.Int("rows", len(rows)), zap.Duration("lease", s.o.Lease), zap.Error(err))
		return
	}
	n, _ := res.RowsAffected()
	s.log.Info("put unstarted rows back to pending", zap.Int64("rows", n))
}
