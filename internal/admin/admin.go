// Package admin owns the operator's queries on the outbox: the status at a
// glance, dead letters listed and requeued, and the messages JetStream
// consumers gave up on (recorded from the server's advisories). They are
// short reads, or short writes of their own, safe while relays and the
// application run. It also owns how the status and dead-letters commands
// print them for people (StatusReport, PrintDeadLetters, ShownRow, ...),
// which dead letters a filter and ids select (ParseWhen, Select), and the
// escaping of the values the application wrote, so that a terminal shows
// them rather than obeys them (Shown).
package admin

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// DeadLetter is a row the relay gave up on.
type DeadLetter struct {
	ID          int64     `json:"id"`
	EventID     string    `json:"event_id"`
	EventType   string    `json:"event_type"`
	Attempts    int       `json:"attempts"`
	LastError   string    `json:"last_error"`
	ProcessedAt time.Time `json:"processed_at"`
}

// ParkedKey is an ordering key a dead letter parks: its later rows wait
// until the dead letter is retried or deleted.
type ParkedKey struct {
	OrderingKey string `json:"ordering_key"`
	// WaitingRows counts the key's pending rows after the dead letter.
	WaitingRows int64 `json:"waiting_rows"`
	// DeadLetter is the key's earliest dead-lettered row, which the rest
	// wait behind; its ProcessedAt is when the key parked.
	DeadLetter
}

// Instance is a relay's heartbeat row.
type Instance struct {
	ID          string    `json:"instance"`
	Hostname    string    `json:"hostname"`
	PID         int64     `json:"pid"`
	Version     string    `json:"version"`
	StartedAt   time.Time `json:"started_at"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
	// Leader: this relay claims and publishes; the others stand by. A
	// relay presumed dead never leads.
	Leader bool `json:"leader"`
	// PresumedDead: the relay has not heartbeated for longer than
	// StatusOptions.StaleAfter (killed, or its host gone) and left its row
	// behind; the next relay to heartbeat takes its lead and its rows.
	PresumedDead bool `json:"presumed_dead"`
	// InFlight is how many rows the relay held in flight at its latest
	// heartbeat.
	InFlight int64 `json:"in_flight"`
	// AtomicBatchLimit is how many rows of an ordering key the relay sends
	// as one atomic batch (0: one at a time, the stream takes no atomic
	// batches); nil when it does not say (core NATS, an older relay).
	AtomicBatchLimit *int64 `json:"atomic_batch_limit,omitempty"`
}

// Exhausted is a message a JetStream consumer stopped delivering after
// max_deliver attempts.
type Exhausted struct {
	EventID    string    `json:"event_id"`
	Stream     string    `json:"stream"`
	Consumer   string    `json:"consumer"`
	StreamSeq  uint64    `json:"stream_seq"`
	Subject    string    `json:"subject"`
	Deliveries int64     `json:"deliveries"`
	ObservedAt time.Time `json:"observed_at"`
}

// Status is the outbox at a glance.
type Status struct {
	// Rows counts rows per status, including statuses the relay does not
	// know (written by someone else); a NULL status counts as "(null)".
	Rows map[event.Status]int64 `json:"rows"`
	// Of the pending rows: due now, and scheduled for later. A row whose
	// available_at is NULL or no time is due.
	PendingDue       int64 `json:"pending_due"`
	PendingScheduled int64 `json:"pending_scheduled"`
	// OldestPending is when the longest-waiting due row became due (see
	// Backlog); zero when no row is due.
	OldestPending     time.Time    `json:"oldest_pending_due_at,omitzero"`
	LastDeadLetters   []DeadLetter `json:"last_dead_letters"`
	Relays            []Instance   `json:"relays"`
	ConsumerExhausted int64        `json:"consumer_exhausted"`
	// ParkedKeyCount counts every parked ordering key; ParkedKeys lists the
	// longest parked of them (StatusOptions.ParkedKeys).
	ParkedKeyCount int64       `json:"parked_key_count"`
	ParkedKeys     []ParkedKey `json:"parked_keys"`
	// LastStreamSeq is the stream sequence recorded on the latest done row
	// (0: none recorded): compare it with the stream's last sequence, or
	// run audit.
	LastStreamSeq uint64 `json:"last_stream_seq"`
	// PendingGrouped counts the pending rows that have an atomic_group
	// (0 also on a table without the column).
	PendingGrouped int64 `json:"pending_in_atomic_groups"`
	// Position is where a relay that begins to lead reads the stream from
	// to find the rows published already (package reconcile); nil before
	// a relay first reconciled the table.
	Position *Position `json:"stream_position,omitempty"`
}

// Position is an outbox table's row of schema.PublishedTable.
type Position struct {
	Origin   string    `json:"origin"` // the Outbox-Origin of its messages
	Stream   string    `json:"stream"`
	ScanFrom uint64    `json:"scan_from"` // 0: from its oldest pending row's time
	Updated  time.Time `json:"updated_at"`
}

// StatusOptions say what ReadStatus lists besides the counts.
type StatusOptions struct {
	LastDead   int // the latest dead letters listed
	ParkedKeys int // parked keys listed at most; all are counted
	// Parks: dead letters park their ordering keys (ordering.on_dead_letter:
	// hold). Without it no key is parked.
	Parks bool
	// StaleAfter is how long a relay may go without a heartbeat before the
	// relays take it for dead (Instance.PresumedDead); 0 judges none.
	StaleAfter time.Duration
}

// NullStatus is the key Status.Rows counts rows with a NULL status under.
const NullStatus event.Status = "(null)"

// ReadStatus reads the outbox's state in one short read transaction, so it is
// consistent and safe while relays and the application write. Values of a
// foreign shape (a text created_at, a NULL status) are counted or read as
// well as they can be, never an error.
func ReadStatus(ctx context.Context, s *sqlitedb.DB, o StatusOptions) (Status, error) {
	st := Status{Rows: map[event.Status]int64{}, ParkedKeys: []ParkedKey{}}
	tx, err := s.Reader().BeginTx(ctx, nil)
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	defer tx.Rollback()
	for _, status := range event.Statuses {
		st.Rows[status] = 0
	}
	rows, err := tx.QueryContext(ctx, `SELECT CAST(status AS TEXT), count(*) FROM `+s.Table()+` GROUP BY 1`)
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	for rows.Next() {
		var status sql.NullString
		var n int64
		if err := rows.Scan(&status, &n); err != nil {
			rows.Close()
			return st, fmt.Errorf("read status: %w", err)
		}
		key := NullStatus
		if status.Valid {
			key = event.Status(status.String)
		}
		st.Rows[key] += n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	now := time.Now().UnixMilli()
	if err := tx.QueryRowContext(ctx, fmt.Sprintf(`SELECT
	(SELECT count(*) FROM %[1]s WHERE %[2]s),
	(SELECT count(*) FROM %[1]s WHERE status = 'pending' AND NOT %[3]s)`, s.Table(), schema.DueRow, schema.DueSQL("?1")), now).
		Scan(&st.PendingDue, &st.PendingScheduled); err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	oldest, err := schema.OldestDue(ctx, tx, s.Table(), now)
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	if oldest.Valid {
		st.OldestPending = time.UnixMilli(oldest.Int64)
	}
	if st.LastDeadLetters, err = deadLetters(ctx, tx, s.Table(), Filter{}, o.LastDead); err != nil {
		return st, err
	}
	if o.Parks {
		if st.ParkedKeyCount, st.ParkedKeys, err = parkedKeys(ctx, tx, s.Table(), o.ParkedKeys); err != nil {
			return st, err
		}
	}
	if st.Relays, err = instances(ctx, tx, s.Table(), time.UnixMilli(now), o.StaleAfter); err != nil {
		return st, err
	}
	done, records, err := doneSource(ctx, tx, s.Table())
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	if records {
		var n int64
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+schema.DoneTable(s.Table())).Scan(&n); err != nil {
			return st, fmt.Errorf("read status: %w", err)
		}
		st.Rows[event.StatusDone] += n
	}
	// The latest done row is near the end of each table: walked from it,
	// in each table alone (SQLite sorts the whole union otherwise).
	var latest int64
	for _, src := range done {
		var id, seq sql.NullInt64
		err = tx.QueryRowContext(ctx, `SELECT id, stream_seq FROM (`+src+`) ORDER BY id DESC LIMIT 1`).Scan(&id, &seq)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return st, fmt.Errorf("read status: %w", err)
		}
		if id.Valid && id.Int64 >= latest {
			latest, st.LastStreamSeq = id.Int64, uint64(max(seq.Int64, 0))
		}
	}
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+schema.ExhaustedTable).Scan(&st.ConsumerExhausted); err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	if st.Position, err = position(ctx, tx, s.Table()); err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	cols, err := sqlitedb.Columns(ctx, tx, s.Table())
	if err == nil && cols["atomic_group"] {
		err = tx.QueryRowContext(ctx, `SELECT count(*) FROM `+s.Table()+` WHERE atomic_group IS NOT NULL AND status = 'pending'`).Scan(&st.PendingGrouped)
	}
	if err != nil {
		return st, fmt.Errorf("read status: %w", err)
	}
	return st, nil
}

// position reads table's stream position; nil when a relay never
// reconciled it (or the file predates the table of positions).
func position(ctx context.Context, q sqlitedb.Querier, table string) (*Position, error) {
	if ok, err := sqlitedb.ObjectExists(ctx, q, "table", schema.PublishedTable); err != nil || !ok {
		return nil, err
	}
	var p Position
	var stream sql.NullString
	var from, updated sql.NullInt64
	err := q.QueryRowContext(ctx, `SELECT origin, stream, scan_from, updated_at FROM `+schema.PublishedTable+` WHERE outbox_table = ?`, table).
		Scan(&p.Origin, &stream, &from, &updated)
	if errors.Is(err, sql.ErrNoRows) || err == nil && !stream.Valid {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	p.Stream, p.ScanFrom, p.Updated = stream.String, uint64(max(from.Int64, 0)), time.UnixMilli(updated.Int64)
	return &p, nil
}

// deadLetterColumns are a dead letter's columns as scanDeadLetter reads
// them. A foreign writer's values (a text processed_at, a NULL event_type)
// are read as well as they can be rather than failing the listing.
var deadLetterColumns = `id, coalesce(CAST(event_id AS TEXT), ''), coalesce(CAST(event_type AS TEXT), ''), coalesce(CAST(attempts AS INTEGER), 0),
	coalesce(CAST(last_error AS TEXT), ''), coalesce(` + schema.MsSQL("processed_at") + `, 0)`

// scanDeadLetter reads the deadLetterColumns of a row into d, and the
// columns after them into more.
func scanDeadLetter(rows *sql.Rows, d *DeadLetter, more ...any) error {
	var processed int64
	if err := rows.Scan(append([]any{&d.ID, &d.EventID, &d.EventType, &d.Attempts, &d.LastError, &processed}, more...)...); err != nil {
		return err
	}
	d.ProcessedAt = time.UnixMilli(processed)
	return nil
}

func deadLetters(ctx context.Context, q sqlitedb.Querier, table string, f Filter, limit int) ([]DeadLetter, error) {
	where, args := f.where()
	rows, err := q.QueryContext(ctx, `SELECT `+deadLetterColumns+`
FROM `+table+` WHERE status = 'dead_lettered'`+where+` ORDER BY processed_at DESC, id DESC LIMIT ?`, append(args, limit)...)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	defer rows.Close()
	out := []DeadLetter{}
	for rows.Next() {
		var d DeadLetter
		if err := scanDeadLetter(rows, &d); err != nil {
			return nil, fmt.Errorf("list dead letters: %w", err)
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

// parkedSQL lists the parked keys of table t, longest parked first (up to
// ?1): each key's earliest dead letter, and how many pending rows of the
// key come after it, counted on the ordering index.
func parkedSQL(t string) string {
	return `SELECT ` + deadLetterColumns + `, p.parked_key,
	(SELECT count(*) FROM ` + t + ` AS w WHERE w.ordering_key = p.parked_key AND w.id > p.parked_id AND w.status = 'pending')
FROM (` + schema.ParkedKeysSQL(t) + `) AS p JOIN ` + t + ` ON id = p.parked_id
ORDER BY 6, 1 LIMIT ?1`
}

// parkedKeys counts the parked keys of table and lists up to limit of
// them, longest parked first. A table from before the ordering_key column
// has none.
func parkedKeys(ctx context.Context, q sqlitedb.Querier, table string, limit int) (int64, []ParkedKey, error) {
	out := []ParkedKey{}
	if cols, err := sqlitedb.Columns(ctx, q, table); err != nil {
		return 0, nil, fmt.Errorf("list parked keys: %w", err)
	} else if !cols["ordering_key"] {
		return 0, out, nil
	}
	var n int64
	if err := q.QueryRowContext(ctx, `SELECT count(*) FROM (`+schema.ParkedKeysSQL(table)+`)`).Scan(&n); err != nil {
		return 0, nil, fmt.Errorf("list parked keys: %w", err)
	}
	rows, err := q.QueryContext(ctx, parkedSQL(table), limit)
	if err != nil {
		return 0, nil, fmt.Errorf("list parked keys: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var p ParkedKey
		if err := scanDeadLetter(rows, &p.DeadLetter, &p.OrderingKey, &p.WaitingRows); err != nil {
			return 0, nil, fmt.Errorf("list parked keys: %w", err)
		}
		out = append(out, p)
	}
	return n, out, rows.Err()
}

// instances lists the heartbeat rows of the relays of the outbox table
// (each table in a file has its own leader; a row without outbox_table,
// from an older relay, counts for every table), the longest-running relay
// first. It leads unless its heartbeat is older than staleAfter at now:
// then it is presumed dead, and no relay leads until another has judged it
// so and removed its row (lead.Lease.Heartbeat), which takes a standby
// about staleAfter.
func instances(ctx context.Context, q sqlitedb.Querier, table string, now time.Time, staleAfter time.Duration) ([]Instance, error) {
	cols, err := sqlitedb.Columns(ctx, q, schema.InstancesTable)
	if err != nil {
		return nil, fmt.Errorf("list relays: %w", err)
	}
	inFlight := "0" // a heartbeat table from before migration 104
	if cols["in_flight"] {
		inFlight = "coalesce(in_flight, 0)"
	}
	batchLimit := "NULL" // from before migration 109
	if cols["atomic_batch_limit"] {
		batchLimit = "atomic_batch_limit"
	}
	ofTable, args := "", []any{} // from before migration 107: one lead per file
	if cols["outbox_table"] {
		ofTable, args = ` WHERE lower(coalesce(outbox_table, ?1)) = lower(?1)`, []any{table}
	}
	rows, err := q.QueryContext(ctx, `SELECT instance_id, coalesce(hostname, ''), coalesce(pid, 0), coalesce(version, ''), started_at, heartbeat_at, `+inFlight+`, `+batchLimit+`
FROM `+schema.InstancesTable+ofTable+` ORDER BY started_at, rowid`, args...)
	if err != nil {
		return nil, fmt.Errorf("list relays: %w", err)
	}
	defer rows.Close()
	out := []Instance{}
	for rows.Next() {
		var in Instance
		var started, beat int64
		var batchLimit sql.NullInt64
		if err := rows.Scan(&in.ID, &in.Hostname, &in.PID, &in.Version, &started, &beat, &in.InFlight, &batchLimit); err != nil {
			return nil, fmt.Errorf("list relays: %w", err)
		}
		if batchLimit.Valid {
			in.AtomicBatchLimit = &batchLimit.Int64
		}
		in.StartedAt, in.HeartbeatAt = time.UnixMilli(started), time.UnixMilli(beat)
		in.PresumedDead = staleAfter > 0 && now.Sub(in.HeartbeatAt) > staleAfter
		in.Leader = len(out) == 0 && !in.PresumedDead // the order of leaderSQL
		out = append(out, in)
	}
	return out, rows.Err()
}

// RecordExhausted stores a consumer's max-deliveries advisory; a repeat
// (another relay saw it too) is ignored. It reports whether it was new.
func RecordExhausted(ctx context.Context, s *sqlitedb.DB, e Exhausted) (bool, error) {
	res, err := s.Exec(ctx, `INSERT OR IGNORE INTO `+schema.ExhaustedTable+` (event_id, stream, consumer, stream_seq, subject, deliveries, observed_at)
VALUES (?, ?, ?, ?, ?, ?, ?)`, e.EventID, e.Stream, e.Consumer, int64(e.StreamSeq), e.Subject, e.Deliveries, e.ObservedAt.UnixMilli())
	if err != nil {
		return false, fmt.Errorf("record exhausted message: %w", err)
	}
	n, _ := res.RowsAffected()
	return n > 0, nil
}

// ExhaustedMessages lists what consumers gave up on, newest first.
func ExhaustedMessages(ctx context.Context, s *sqlitedb.DB, limit int) ([]Exhausted, error) {
	rows, err := s.Reader().QueryContext(ctx, `SELECT coalesce(event_id, ''), stream, consumer, stream_seq, coalesce(subject, ''), deliveries, observed_at
FROM `+schema.ExhaustedTable+` ORDER BY observed_at DESC, id DESC LIMIT ?`, limit)
	if err != nil {
		return nil, fmt.Errorf("list exhausted messages: %w", err)
	}
	defer rows.Close()
	out := []Exhausted{}
	for rows.Next() {
		var e Exhausted
		var seq, observed int64
		if err := rows.Scan(&e.EventID, &e.Stream, &e.Consumer, &seq, &e.Subject, &e.Deliveries, &observed); err != nil {
			return nil, fmt.Errorf("list exhausted messages: %w", err)
		}
		e.StreamSeq, e.ObservedAt = uint64(seq), time.UnixMilli(observed)
		out = append(out, e)
	}
	return out, rows.Err()
}

// DoneRow is a done row as the audit reads it.
type DoneRow struct {
	ID      int64
	EventID string
	// StreamSeq is the stream sequence recorded when the row was marked
	// done; 0 when none was (done before sequences were recorded, or
	// published with core NATS).
	StreamSeq uint64
}

// DoneRows reads up to limit done rows processed at or after since (Unix
// ms) with ids below before, newest first: one short read, safe while
// relays and the application write. A file from before the stream_seq
// column has none recorded.
func DoneRows(ctx context.Context, s *sqlitedb.DB, since, before int64, limit int) ([]DoneRow, error) {
	done, _, err := doneSource(ctx, s.Reader(), s.Table())
	if err != nil {
		return nil, fmt.Errorf("read done rows: %w", err)
	}
	rows, err := s.Reader().QueryContext(ctx, `SELECT id, coalesce(CAST(event_id AS TEXT), ''), coalesce(stream_seq, 0) FROM (`+strings.Join(done, " UNION ALL ")+`)
WHERE id < ?2 AND `+schema.MsSQL("processed_at")+` >= ?1 ORDER BY id DESC LIMIT ?3`, since, before, limit)
	if err != nil {
		return nil, fmt.Errorf("read done rows: %w", err)
	}
	defer rows.Close()
	var out []DoneRow
	for rows.Next() {
		var d DoneRow
		var seq int64
		if err := rows.Scan(&d.ID, &d.EventID, &seq); err != nil {
			return nil, fmt.Errorf("read done rows: %w", err)
		}
		d.StreamSeq = uint64(max(seq, 0))
		out = append(out, d)
	}
	return out, rows.Err()
}

// doneSource returns the done rows of outbox table t as subqueries of
// (id, event_id, stream_seq, processed_at), stream_seq an integer or
// NULL: the rows marked done in t, and, where t's records table exists
// (records), the records of the rows deleted when settled
// (retention.done_rows: delete). A file from before the stream_seq column
// has none recorded.
func doneSource(ctx context.Context, q sqlitedb.Querier, t string) (srcs []string, records bool, err error) {
	cols, err := sqlitedb.Columns(ctx, q, t)
	if err != nil {
		return nil, false, err
	}
	seq := "NULL"
	if cols["stream_seq"] {
		seq = "CAST(stream_seq AS INTEGER)"
	}
	srcs = []string{fmt.Sprintf(`SELECT id, event_id, %s AS stream_seq, processed_at FROM %s WHERE status = 'done'`, seq, t)}
	if records, err = sqlitedb.ObjectExists(ctx, q, "table", schema.DoneTable(t)); err != nil {
		return nil, false, err
	}
	if records {
		srcs = append(srcs, `SELECT id, event_id, stream_seq, processed_at FROM `+schema.DoneTable(t))
	}
	return srcs, records, nil
}
