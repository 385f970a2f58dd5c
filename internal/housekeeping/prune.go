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

// Pruner deletes finished rows, a sweep at a time; it remembers where each
// table's sweep stopped. It is not safe for concurrent use.
type Pruner struct {
	db      *sqlitedb.DB
	cursors map[string]int64 // table -> rowid where the last sweep stopped
}

// NewPruner returns a Pruner on db.
func NewPruner(db *sqlitedb.DB) *Pruner {
	return &Pruner{db: db, cursors: map[string]int64{}}
}

// Prune deletes finished rows older than before from table
// (event.PruneOutbox: done rows by processed_at, or created_at where a
// legacy row has none; event.PruneDoneRecords: the records of done rows
// deleted when settled, by processed_at; event.PruneProcessedEvents: ledger rows by
// processed_at, or started_at for abandoned claims). It sweeps the table in
// rowid order from where the previous call stopped, wrapping at the end,
// reading a few hundred rows at a time without a lock and deleting the old
// finished ones among them by rowid in short write transactions, with a
// pause between them so that the application's writers get the lock. No
// index is needed, and rows finished out of insertion order (requeued dead
// letters, rows scheduled late) are found on a later sweep. It returns how
// many rows it deleted.
func (p *Pruner) Prune(ctx context.Context, table string, before time.Time, pause time.Duration) (int64, error) {
	var name, finished, when string
	unfinished := "" // a query for the rows in a rowid range (?1, ?2] known unfinished without reading them
	switch table {
	case event.PruneOutbox:
		name, finished, when = p.db.Table(), `status = 'done'`, `coalesce(processed_at, created_at)`
		// status and processed_at come after the payload, in the last of a
		// large row's overflow pages: reading them reads the whole
		// payload. Pending rows are found in the pending index instead, so
		// that a sweep does not read a backlog of large rows.
		unfinished = fmt.Sprintf(`SELECT id FROM %s WHERE status = 'pending' AND id > ?1 AND id <= ?2`, name)
	case event.PruneDoneRecords:
		name, finished, when = schema.DoneTable(p.db.Table()), `1`, `processed_at`
		// A file that never had a relay delete its done rows may lack it.
		if ok, err := sqlitedb.ObjectExists(ctx, p.db.Reader(), "table", name); err != nil || !ok {
			return 0, err
		}
	case event.PruneProcessedEvents:
		name, finished, when = "processed_events", `1`, `coalesce(processed_at, started_at)`
	default:
		return 0, fmt.Errorf("prune: unknown table %q", table)
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
	cursor := p.cursors[table]
	defer func() { p.cursors[table] = cursor }()
	var deleted int64
	for read := 0; read < pruneBudget; {
		var n int
		var end int64
		if err := p.db.Reader().QueryRowContext(ctx, window, cursor).Scan(&n, &end); err != nil {
			return deleted, fmt.Errorf("prune %s: %w", name, err)
		}
		victims, err := p.victims(ctx, scan, cursor, end, cutoff)
		if err != nil {
			return deleted, fmt.Errorf("prune %s: %w", name, err)
		}
		cursor = max(cursor, end)
		read += n
		if len(victims) > 0 {
			k, err := deleteRows(ctx, p.db, del, victims, cutoff)
			deleted += k
			if err != nil {
				return deleted, fmt.Errorf("prune %s: %w", name, err)
			}
			select {
			case <-ctx.Done():
				return deleted, ctx.Err()
			case <-time.After(pause):
			}
		}
		if n < pruneScan {
			cursor = 0 // the end of the table: the next sweep starts over
			return deleted, nil
		}
	}
	return deleted, nil
}

// victims runs scan over the rowids (from, to] for the old finished rows.
func (p *Pruner) victims(ctx context.Context, scan string, from, to, cutoff int64) ([]int64, error) {
	rows, err := p.db.Reader().QueryContext(ctx, scan, from, to, cutoff)
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
