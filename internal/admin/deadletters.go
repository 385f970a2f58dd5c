package admin

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Filter narrows the dead letters an operation applies to; its zero value
// takes them all.
type Filter struct {
	Type         string    // event_type, exactly
	Since, Until time.Time // dead-lettered (processed_at) at or after Since, before Until
	Error        string    // last_error contains it
}

// where returns f as SQL conditions to AND with the rest, and their
// arguments.
func (f Filter) where() (string, []any) {
	var w string
	var args []any
	if f.Type != "" {
		w, args = w+` AND event_type = ?`, append(args, f.Type)
	}
	if !f.Since.IsZero() {
		w, args = w+` AND `+schema.MsSQL("processed_at")+` >= ?`, append(args, f.Since.UnixMilli())
	}
	if !f.Until.IsZero() {
		w, args = w+` AND `+schema.MsSQL("processed_at")+` < ?`, append(args, f.Until.UnixMilli())
	}
	if f.Error != "" {
		w, args = w+` AND instr(coalesce(CAST(last_error AS TEXT), ''), ?) > 0`, append(args, f.Error)
	}
	return w, args
}

// DeadLetters lists the dead letters f takes, most recently dead-lettered
// first, up to limit.
func DeadLetters(ctx context.Context, s *sqlitedb.DB, f Filter, limit int) ([]DeadLetter, error) {
	return deadLetters(ctx, s.Reader(), s.Table(), f, limit)
}

// Row is a whole outbox row, as show prints it.
type Row struct {
	DeadLetter
	Status      string `json:"status"`
	OrderingKey string `json:"ordering_key,omitempty"`
	Headers     string `json:"headers,omitempty"`
	// AtomicGroup, StreamSeq, ClaimedBy and ClaimedAt are as stored, as
	// text ("": NULL, or no such column).
	AtomicGroup string    `json:"atomic_group,omitempty"`
	StreamSeq   string    `json:"stream_seq,omitempty"`
	ClaimedBy   string    `json:"claimed_by,omitempty"`
	ClaimedAt   string    `json:"claimed_at,omitempty"`
	CreatedAt   time.Time `json:"created_at"`
	AvailableAt time.Time `json:"available_at"`
	Payload     []byte    `json:"-"`
}

// ErrNoRow means no row has the id asked for.
var ErrNoRow = errors.New("no such row")

// ReadRow reads the row with id, whatever its status (foreign shapes read
// as well as they can be).
func ReadRow(ctx context.Context, s *sqlitedb.DB, id int64) (Row, error) {
	cols, err := sqlitedb.Columns(ctx, s.Reader(), s.Table())
	if err != nil {
		return Row{}, fmt.Errorf("read row %d: %w", id, err)
	}
	optional := func(c string) string {
		if cols[c] {
			return `coalesce(CAST(` + c + ` AS TEXT), '')`
		}
		return `''`
	}
	rows, err := s.Reader().QueryContext(ctx, `SELECT `+deadLetterColumns+`, coalesce(CAST(status AS TEXT), ''), `+optional("ordering_key")+`, `+optional("headers")+`,
	`+optional("atomic_group")+`, `+optional("stream_seq")+`, `+optional("claimed_by")+`, `+optional("claimed_at")+`,
	coalesce(`+schema.MsSQL("created_at")+`, 0), coalesce(`+schema.MsSQL("available_at")+`, 0), payload FROM `+s.Table()+` WHERE id = ?`, id)
	if err != nil {
		return Row{}, fmt.Errorf("read row %d: %w", id, err)
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return Row{}, fmt.Errorf("read row %d: %w", id, err)
		}
		return Row{}, fmt.Errorf("row %d in %s: %w", id, s.Table(), ErrNoRow)
	}
	var r Row
	var created, avail int64
	var payload any
	if err := scanDeadLetter(rows, &r.DeadLetter, &r.Status, &r.OrderingKey, &r.Headers, &r.AtomicGroup, &r.StreamSeq, &r.ClaimedBy, &r.ClaimedAt, &created, &avail, &payload); err != nil {
		return Row{}, fmt.Errorf("read row %d: %w", id, err)
	}
	r.CreatedAt, r.AvailableAt = time.UnixMilli(created), time.UnixMilli(avail)
	switch p := payload.(type) {
	case []byte:
		r.Payload = p
	case string:
		r.Payload = []byte(p)
	case nil:
	default:
		r.Payload = []byte(fmt.Sprint(p))
	}
	return r, rows.Err()
}

// Selection is the dead letters a bulk operation takes: all of them, or
// those of IDs; either way only those Filter takes.
type Selection struct {
	All    bool
	IDs    []int64
	Filter Filter
}

// Bulk is what a bulk operation did.
type Bulk struct {
	// Matched counts the dead letters selected; Changed those written (a
	// dry run writes none).
	Matched int64 `json:"matched"`
	Changed int64 `json:"changed"`
	// Transactions is how many write transactions it took, and
	// LongestLockMs the longest time one held the write lock.
	Transactions  int     `json:"transactions"`
	LongestLockMs float64 `json:"longest_lock_ms"`
	DryRun        bool    `json:"dry_run"`
}

// Bulk operations write in transactions of bulkFirst rows at first, sized
// after that so that each holds the write lock for about bulkHold (between
// bulkMin and bulkMax rows), and leave the lock to the application after
// each for as long as they held it.
const (
	bulkFirst = 200
	bulkMin   = 20
	bulkMax   = 2000
	bulkHold  = 2 * time.Millisecond
)

// Requeue puts the selected dead letters back to pending with attempts 0,
// available now; last_error stays until the next attempt.
func Requeue(ctx context.Context, s *sqlitedb.DB, sel Selection, dryRun bool) (Bulk, error) {
	return bulk(ctx, s, sel, dryRun, `UPDATE `+s.Table()+` SET status = 'pending', attempts = 0, available_at = ?2, processed_at = NULL
WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'dead_lettered'`)
}

// Discard deletes the selected dead letters.
func Discard(ctx context.Context, s *sqlitedb.DB, sel Selection, dryRun bool) (Bulk, error) {
	return bulk(ctx, s, sel, dryRun, `DELETE FROM `+s.Table()+` WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'dead_lettered' AND ?2 IS NOT NULL`)
}

// bulk runs stmt (?1: a JSON array of ids, ?2: now in Unix ms) over the
// selected dead letters in id order: each batch is found on the read
// connection (no lock), then written in a short transaction of its own
// that checks again that each row is a dead letter. A batch takes with it
// the selected dead letters of the atomic groups its rows belong to,
// wherever they are in the table: a group retried in two transactions
// would reach a running relay in two parts, and be published in part.
// Open s with sqlitedb.Options.OwnCheckpoints: bulk checkpoints between
// its transactions, outside the lock.
func bulk(ctx context.Context, s *sqlitedb.DB, sel Selection, dryRun bool, stmt string) (Bulk, error) {
	b := Bulk{DryRun: dryRun}
	where, args := sel.Filter.where()
	if !sel.All {
		j, _ := json.Marshal(sel.IDs)
		where, args = ` AND id IN (SELECT value FROM json_each(?))`+where, append([]any{string(j)}, args...)
	}
	// +status keeps SQLite on the table's id order (one pass over the
	// table in all) rather than sorting the dead letters' index per batch.
	find := `SELECT id FROM ` + s.Table() + ` WHERE +status = 'dead_lettered' AND id > ?` + where + ` ORDER BY id LIMIT ?`
	cols, err := sqlitedb.Columns(ctx, s.Reader(), s.Table())
	if err != nil {
		return b, fmt.Errorf("find dead letters: %w", err)
	}
	// The rest of a batch's groups: past the batch (its last id, ?), of
	// the groups of its rows (a JSON array, ?).
	groupRest := ""
	if cols["atomic_group"] && !dryRun {
		groupRest = `SELECT id FROM ` + s.Table() + ` WHERE +status = 'dead_lettered' AND id > ?
AND atomic_group IN (SELECT atomic_group FROM ` + s.Table() + ` WHERE id IN (SELECT value FROM json_each(?)) AND atomic_group IS NOT NULL)` + where + ` ORDER BY id`
	}
	size := bulkFirst
	var after int64 = -1 << 63
	for {
		q := append(append([]any{after}, args...), size)
		ids, err := readIDs(ctx, s.Reader(), find, q...)
		if err != nil {
			return b, err
		}
		if len(ids) == 0 {
			return b, nil
		}
		// Rows taken with a batch's group are no dead letters once
		// written, and are not found again.
		after = ids[len(ids)-1]
		if groupRest != "" {
			j, _ := json.Marshal(ids)
			rest, err := readIDs(ctx, s.Reader(), groupRest, append([]any{after, string(j)}, args...)...)
			if err != nil {
				return b, err
			}
			ids = append(ids, rest...)
		}
		b.Matched += int64(len(ids))
		if dryRun {
			continue
		}
		j, _ := json.Marshal(ids)
		var n int64
		var locked time.Time
		err = s.InTx(ctx, func(tx *sql.Tx) error {
			locked = time.Now() // BEGIN IMMEDIATE has the lock
			res, err := tx.ExecContext(ctx, stmt, string(j), sqlitedb.NowMs())
			if err == nil {
				n, _ = res.RowsAffected()
			}
			return err
		})
		held := time.Since(locked) // until the commit let it go
		if err != nil {
			return b, fmt.Errorf("write dead letters %d to %d, after %d were written in %d transactions (the command takes the rest when run again): %w",
				ids[0], ids[len(ids)-1], b.Changed, b.Transactions, err)
		}
		b.Changed += n
		b.Transactions++
		b.LongestLockMs = max(b.LongestLockMs, float64(held.Microseconds())/1000)
		size = max(bulkMin, min(bulkMax, 2*size, int(float64(size)*float64(bulkHold)/float64(max(held, 100*time.Microsecond)))))
		// Leave the lock to the application for as long as it was held,
		// and copy the WAL into the database meanwhile (s should have its
		// own checkpoints: a commit's automatic one holds it up).
		s.Checkpoint(ctx) // best effort: the next transaction finds out if the file is gone
		select {
		case <-ctx.Done():
			return b, ctx.Err()
		case <-time.After(max(held, time.Millisecond)):
		}
	}
}

func readIDs(ctx context.Context, q sqlitedb.Querier, query string, args ...any) ([]int64, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("find dead letters: %w", err)
	}
	defer rows.Close()
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("find dead letters: %w", err)
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}
