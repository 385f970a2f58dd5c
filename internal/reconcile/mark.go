package reconcile

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Mark is an outbox table's row of schema.PublishedTable: its origin and
// where in the stream the messages of its unsettled rows can begin.
type Mark struct {
	Origin string
	// AdoptedAt (Unix ms) is when the origin was given to a table that
	// had rows already (from before the origin, or a restored backup
	// from before it): a message stored before then may carry another
	// origin and still be a row's own. 0: the table was empty.
	AdoptedAt int64
	// Stream, Created (its creation time, Unix nanoseconds) and ScanFrom
	// (a sequence) are zero until a relay first reconciled.
	Stream   string
	Created  int64
	ScanFrom uint64
}

// Origin returns the origin of db's outbox table, the Outbox-Origin of
// its messages, giving the table one (a random id) the first time. The
// origin is in the file, so a restored copy keeps it.
func Origin(ctx context.Context, db *sqlitedb.DB) (string, error) {
	if _, err := db.Exec(ctx, `INSERT INTO `+schema.PublishedTable+` (outbox_table, origin, adopted_at, updated_at)
VALUES (?1, ?2, CASE WHEN EXISTS (SELECT 1 FROM `+db.Table()+`) THEN ?3 END, ?3)
ON CONFLICT (outbox_table) DO NOTHING`, db.Table(), event.NewID(), sqlitedb.NowMs()); err != nil {
		return "", fmt.Errorf("give outbox table %s an origin: %w", db.Table(), err)
	}
	m, err := readMark(ctx, db)
	return m.Origin, err
}

// readMark reads db's outbox table's mark.
func readMark(ctx context.Context, db *sqlitedb.DB) (Mark, error) {
	var m Mark
	var stream sql.NullString
	var created, from, adopted sql.NullInt64
	err := db.Reader().QueryRowContext(ctx, `SELECT origin, adopted_at, stream, stream_created, scan_from FROM `+schema.PublishedTable+` WHERE outbox_table = ?`,
		db.Table()).Scan(&m.Origin, &adopted, &stream, &created, &from)
	if errors.Is(err, sql.ErrNoRows) {
		return m, fmt.Errorf("outbox table %s has no origin in %s", db.Table(), schema.PublishedTable)
	}
	if err != nil {
		return m, fmt.Errorf("read %s: %w", schema.PublishedTable, err)
	}
	m.Stream, m.Created, m.AdoptedAt = stream.String, created.Int64, adopted.Int64
	if from.Int64 > 0 {
		m.ScanFrom = uint64(from.Int64)
	}
	return m, nil
}

// writeMark records that the messages of db's unsettled rows in stream
// (created at created) begin at from at the earliest.
func writeMark(ctx context.Context, db *sqlitedb.DB, stream string, created int64, from uint64) error {
	_, err := db.Exec(ctx, `UPDATE `+schema.PublishedTable+` SET stream = ?1, stream_created = ?2, scan_from = ?3, updated_at = ?4 WHERE outbox_table = ?5`,
		stream, created, int64(from), sqlitedb.NowMs(), db.Table())
	if err != nil {
		return fmt.Errorf("record the stream position in %s: %w", schema.PublishedTable, err)
	}
	return nil
}

// oldestPending returns the created_at (Unix milliseconds) of the oldest
// pending row; 0 when none is pending.
func oldestPending(ctx context.Context, db *sqlitedb.DB) (int64, error) {
	var ms sql.NullInt64
	err := db.Reader().QueryRowContext(ctx, fmt.Sprintf(`SELECT min(%s) FROM %s WHERE status = 'pending'`, schema.MsSQL("created_at"), db.Table())).Scan(&ms)
	if err != nil {
		return 0, fmt.Errorf("read the oldest pending row of %s: %w", db.Table(), err)
	}
	return ms.Int64, nil
}

// highestRow returns the highest row id of db's outbox table (0: none).
func highestRow(ctx context.Context, db *sqlitedb.DB) (int64, error) {
	var id sql.NullInt64
	if err := db.Reader().QueryRowContext(ctx, `SELECT max(id) FROM `+db.Table()).Scan(&id); err != nil {
		return 0, fmt.Errorf("read the highest row id of %s: %w", db.Table(), err)
	}
	return id.Int64, nil
}
