package housekeeping

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// pruneScan is how many rows one pruning step reads; the delete that
// follows holds the write lock for a few milliseconds at most.
const pruneScan = 500

// pruneBudget is how many rows one Prune call reads at most: a table of a
// million rows is swept every ten calls, at a few tens of milliseconds of
// CPU a call.
const pruneBudget = 100_000

// Prune deletes finished rows older than before from table of db
// (event.PruneOutbox: done rows by processed_at, or created_at where a
// legacy row has none; event.PruneDoneRecords: the records of done rows
// deleted when settled, by processed_at; event.PruneProcessedEvents: ledger rows by
// processed_at, or started_at for abandoned claims). It sweeps the table in
// rowid order from the rowid after from (where the previous sweep
// stopped), wrapping at the end,
// reading a few hundred rows at a time without a lock and deleting the old
// finished ones among them by rowid in short write transactions, with a
// pause between them so that the application's writers get the lock. No
// index is needed, and rows finished out of insertion order (requeued dead
// letters, rows scheduled late) are found on a later sweep. It returns how
// many rows it deleted and where the next sweep starts.
func Prune(ctx context.Context, db *sqlitedb.DB, table string, before time.Time, pause time.Duration, from int64) (deleted, next int64, err error) {
	var name, finished, when string
	unfinished := "" // a query for the rows in a rowid range (?1, ?2] known unfinished without reading them
	switch table {
	case event.PruneOutbox:
		name, finished, when = db.Table(), `status = 'done'`, `coalesce(processed_at, created_at)`
		// status and processed_at come after the payload, in the last of a
		// large row's overflow pages: reading them reads the whole
		// payload. Pending rows are found in the pending index instead, so
		// that a sweep does not read a backlog of large rows.
		unfinished = fmt.Sprintf(`SELECT id FROM %s WHERE status = 'pending' AND id > ?1 AND id <= ?2`, name)
	case event.PruneDoneRecords:
		name, finished, when = schema.DoneTable(db.Table()), `1`, `processed_at`
		// A file that never had a relay delete its done rows may lack it.
		if ok, err := sqlitedb.ObjectExists(ctx, db.Reader(), "table", name); err != nil || !ok {
			return 0, from, err
		}
	case event.PruneProcessedEvents:
		name, finished, when = "processed_events", `1`, `coalesce(processed_at, started_at)`
	default:
		return 0, from, fmt.Errorf("prune: unknown table %q", table)
	}
	// A step reads the rowids of the next pruneScan rows, then the rows
	// among them that may be finished.
	window := fmt.Sprintf(`SELECT count(*), coalesce(max(rowid), 0) FROM (SELECT rowid FROM %s WHERE rowid > ?1 ORDER BY rowid LIMIT %d)`, name, pruneScan)
	scan := fmt.Sprintf(`SELECT rowid FROM %s WHERE rowid > ?1 AND rowid <= ?2`, name)
	if unfinished != "" {
		scan += ` AND rowid NOT IN (` + unfinished + `)` // tested first: SQLite tests the terms in order
	}
	scan += fmt.Sprintf(` AND %s AND %s < ?3`, finished, when)
	del := fmt.Sprintf(`DELETE FROM %s WHERE rowid = ? AND %s AND %s < ?`, name, finished, when)
	cutoff := before.UnixMilli()
	next = from
	for read := 0; read < pruneBudget; {
		var n int
		var end int64
		if err := db.Reader().QueryRowContext(ctx, window, next).Scan(&n, &end); err != nil {
			return deleted, next, fmt.Errorf("prune %s: %w", name, err)
		}
		old, err := victims(ctx, db, scan, next, end, cutoff)
		if err != nil {
			return deleted, next, fmt.Errorf("prune %s: %w", name, err)
		}
		next = max(next, end)
		read += n
		if len(old) > 0 {
			k, err := deleteRows(ctx, db, del, old, cutoff)
			deleted += k
			if err != nil {
				return deleted, next, fmt.Errorf("prune %s: %w", name, err)
			}
			select {
			case <-ctx.Done():
				return deleted, next, ctx.Err()
			case <-time.After(pause):
			}
		}
		if n < pruneScan {
			return deleted, 0, nil // the end of the table: the next sweep starts over
		}
	}
	return deleted, next, nil
}

// victims runs scan over the rowids (from, to] for the old finished rows.
func victims(ctx context.Context, db *sqlitedb.DB, scan string, from, to, cutoff int64) ([]int64, error) {
	rows, err := db.Reader().QueryContext(ctx, scan, from, to, cutoff)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
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
