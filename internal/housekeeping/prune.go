package housekeeping

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// pruneScan is how many rows one pruning step reads; the delete that
// follows holds the write lock for a few milliseconds at most.
const pruneScan = 500

// pruneBytes is how much payload one delete transaction frees at most
// (one row at least): deleting a row frees its overflow pages under the
// write lock, and 500 rows of 64 KiB held it for about 90 ms.
const pruneBytes = 1 << 20

// pruneBudget is how many rows one Prune call reads at most: a table of a
// million rows is swept every ten calls, at a few tens of milliseconds of
// CPU a call (rows without large payloads).
const pruneBudget = 100_000

// A Sweep says where a Prune call starts and how far it goes.
type Sweep struct {
	From int64 // the rowid it starts after (0: the table's start, where rowids below 0 are read too)
	Rows int   // how many rows it goes through at most
	// New ends the outbox's sweep at the first row written after the
	// cutoff (see Prune).
	New bool
}

// Swept is what a Prune call did.
type Swept struct {
	Deleted int64 // rows deleted
	// Next is the rowid the next sweep starts after: the last row read
	// (-1 for row 0), or 0 (the table's start) when the sweep read the
	// table's last row or ended at a row written after the cutoff. After
	// an error, the rows it had not deleted yet are read again.
	Next int64
	Read int64 // rows read
}

// Prune deletes finished rows older than before from table of db
// (event.PruneOutbox: done rows by processed_at, or created_at where a
// legacy row has none; event.PruneDoneRecords: the records of done rows
// deleted when settled, by processed_at; event.PruneProcessedEvents: ledger rows by
// processed_at, or started_at for abandoned claims). It sweeps the table in
// rowid order from the rowid after sw.From, through sw.Rows rows at most,
// reading a few hundred rows at a time without a lock and deleting the old
// finished ones among them by rowid in short write transactions, with a
// pause between them so that the application's writers get the lock. No
// index is needed, and rows finished out of insertion order (requeued dead
// letters, rows scheduled late) are found on a later sweep. It returns how
// many rows it deleted and read, and where the next sweep starts.
//
// With sw.New the outbox's sweep ends, and says to start over, at the first
// row written after the cutoff (its created_at later than before by more
// than event.ClockSkew, and not in the future). While SQLite numbers the
// rows, each row after it was written after it, so settled after the
// cutoff too: the sweep reads the rows written before the cutoff and a
// few minutes' more, not every row kept. Rows an application writes with
// ids of its own, and old rows inserted late, may lie beyond it: a sweep
// without New finds them.
func Prune(ctx context.Context, db *sqlitedb.DB, table string, before time.Time, pause time.Duration, sw Sweep) (r Swept, err error) {
	var name, finished, when string
	size := "0"      // a row's payload bytes
	unfinished := "" // a query for the rows in a rowid range [?1, ?2] known unfinished without reading them
	written := "0"   // whether a row was written after the cutoff (?4) and not in the future (?5)
	cutoff := before.UnixMilli()
	args := []any{cutoff} // ?3 on
	switch table {
	case event.PruneOutbox:
		name, finished, when = db.Table(), `status = 'done'`, fmt.Sprintf(`coalesce(processed_at, %s)`, schema.MsSQL("created_at"))
		size = `octet_length(payload)`
		// status and processed_at come after the payload, in the last of a
		// large row's overflow pages: reading them reads the whole
		// payload. Pending rows are found in the pending index instead, so
		// that a sweep does not read a backlog of large rows, and a sweep
		// with New ends at the first row written after the cutoff, so that
		// it does not read every row kept.
		unfinished = fmt.Sprintf(`SELECT id FROM %s WHERE status = 'pending' AND id >= ?1 AND id <= ?2`, name)
		if sw.New {
			written = fmt.Sprintf(`(%[1]s > ?4 AND %[1]s <= ?5)`, schema.MsSQL("created_at"))
			args = append(args, before.Add(event.ClockSkew).UnixMilli(), time.Now().Add(event.ClockSkew).UnixMilli())
		}
	case event.PruneDoneRecords:
		name, finished, when = schema.DoneTable(db.Table()), `1`, `processed_at`
		// A file that never had a relay delete its done rows may lack it.
		if ok, err := sqlitedb.ObjectExists(ctx, db.Reader(), "table", name); err != nil || !ok {
			return Swept{Next: sw.From}, err
		}
	case event.PruneProcessedEvents:
		name, finished, when = "processed_events", `1`, `coalesce(processed_at, started_at)`
	default:
		return Swept{Next: sw.From}, fmt.Errorf("prune: unknown table %q", table)
	}
	// A step reads the rowids of the next pruneScan rows, then the rows
	// among them that may be finished.
	window := fmt.Sprintf(`SELECT count(*), coalesce(max(rowid), 0) FROM (SELECT rowid FROM %s WHERE rowid >= ?1 ORDER BY rowid LIMIT %d)`, name, pruneScan)
	old := fmt.Sprintf(`%s AND %s < ?3`, finished, when)
	scan := fmt.Sprintf(`SELECT rowid, coalesce(%s, 0), coalesce(%s, 0), coalesce(%s, 0) FROM %s WHERE rowid >= ?1 AND rowid <= ?2`, old, written, size, name) // NULL times: neither
	if unfinished != "" {
		scan += ` AND rowid NOT IN (` + unfinished + `)` // tested first: SQLite tests the terms in order
	}
	scan += fmt.Sprintf(` AND (%s OR %s) ORDER BY rowid`, old, written)
	del := fmt.Sprintf(`DELETE FROM %s WHERE rowid = ? AND %s AND %s < ?`, name, finished, when)
	r.Next = sw.From
	lo := int64(math.MinInt64) // the window's first rowid: the table's start, rowids below 0 too
	if sw.From != 0 {
		lo = sw.From + 1
	}
	for r.Read < int64(sw.Rows) {
		var n, end int64
		if err := db.Reader().QueryRowContext(ctx, window, lo).Scan(&n, &end); err != nil {
			return r, fmt.Errorf("prune %s: %w", name, err)
		}
		ids, last, err := victims(ctx, db, scan, append([]any{lo, end}, args...))
		if err != nil {
			return r, fmt.Errorf("prune %s: %w", name, err)
		}
		for i, part := range ids {
			if i > 0 {
				if err := sleepCtx(ctx, pause); err != nil {
					return r, err
				}
			}
			k, err := deleteRows(ctx, db, del, part, cutoff)
			r.Deleted += k
			if err != nil { // the window again next time
				return r, fmt.Errorf("prune %s: %w", name, err)
			}
		}
		r.Read += n
		if n < pruneScan || last || end == math.MaxInt64 {
			r.Next = 0 // the table's end, or its rows written after the cutoff: the next sweep starts over
		} else {
			r.Next, lo = end, end+1
			if end == 0 {
				r.Next = -1 // after 0 would be the table's start: row 0 is read again
			}
		}
		if len(ids) > 0 {
			if err := sleepCtx(ctx, pause); err != nil {
				return r, err
			}
		}
		if r.Next == 0 {
			return r, nil
		}
	}
	return r, nil
}

// Span returns the highest rowid of db's outbox table less its lowest (0:
// empty): about how many rows it holds while SQLite numbers them, read
// from the table's two ends. Rowids an application wrote far apart make
// it larger than that.
func Span(ctx context.Context, db *sqlitedb.DB) (int64, error) {
	var span sql.NullFloat64 // rowids far apart overflow an integer
	q := fmt.Sprintf(`SELECT CAST((SELECT max(rowid) FROM %[1]s) AS REAL) - (SELECT min(rowid) FROM %[1]s)`, db.Table())
	if err := db.Reader().QueryRowContext(ctx, q).Scan(&span); err != nil {
		return 0, fmt.Errorf("read the span of %s: %w", db.Table(), err)
	}
	return int64(min(span.Float64, math.MaxInt64/2)), nil
}

// sleepCtx waits d, or returns ctx's error if it ends first.
func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// victims runs scan over a window of rowids for its old finished rows, up
// to the first row written after the cutoff, and says whether it met one.
// The rows come in parts of pruneBytes of payload at most (see split), one
// delete transaction each.
func victims(ctx context.Context, db *sqlitedb.DB, scan string, args []any) (parts [][]int64, written bool, err error) {
	rows, err := db.Reader().QueryContext(ctx, scan, args...)
	if err != nil {
		return nil, false, err
	}
	defer rows.Close()
	var ids, sizes []int64
	for rows.Next() {
		var id, size int64
		var old, late bool
		if err := rows.Scan(&id, &old, &late, &size); err != nil {
			return nil, false, err
		}
		if late {
			written = true
			break // the rows after it are younger still: not read
		}
		if old {
			ids, sizes = append(ids, id), append(sizes, size)
		}
	}
	return split(ids, sizes, pruneBytes), written, rows.Err()
}

// split cuts ids into runs whose sizes add up to max at most, a row at
// least each.
func split(ids, sizes []int64, max int64) [][]int64 {
	var parts [][]int64
	start, bytes := 0, int64(0)
	for i, size := range sizes {
		if i > start && bytes+size > max {
			parts, start, bytes = append(parts, ids[start:i:i]), i, 0
		}
		bytes += size
	}
	if start < len(ids) {
		parts = append(parts, ids[start:])
	}
	return parts
}

// deleteRows deletes the given rowids in one short write transaction,
// re-checking the condition (a row may have changed since it was read).
func deleteRows(ctx context.Context, s *sqlitedb.DB, del string, ids []int64, cutoff int64) (int64, error) {
	tx, err := s.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback()
	st, err := tx.PrepareContext(ctx, del)
	if err != nil {
		return 0, err
	}
	defer st.Close()
	var n int64
	for _, id := range ids {
		res, err := st.ExecContext(ctx, id, cutoff)
		if err != nil {
			return 0, err
		}
		k, _ := res.RowsAffected()
		n += k
	}
	return n, tx.Commit()
}
