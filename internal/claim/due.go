package claim

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// NextDue reports whether a pending row of db's outbox table is due now,
// as a claim reads available_at (NULL, or text that is no time, means now;
// SQLite's date-time text the time it names), else when the earliest
// pending row comes due (zero: none pending). A fleet looks at a file
// this way before it serves it. A keyed row due now counts only when a
// claim could take it: the row before it of its key is done (or, unless
// parks, dead-lettered): the rows behind a dead letter that parks its key
// wait for an operator, and opening the file would not publish them.
func NextDue(ctx context.Context, db *sqlitedb.DB, parks bool) (time.Time, bool, error) {
	t := db.Table()
	passed := `'done'`
	if !parks {
		passed = `'done', 'dead_lettered'`
	}
	now := db.DueMs()
	keyed := fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %[1]s AS r WHERE r.status = 'pending' AND %[2]s
	AND (coalesce(r.ordering_key, '') = '' OR typeof(r.ordering_key) = 'blob'
		OR coalesce((SELECT p.status FROM %[1]s AS p WHERE p.ordering_key = r.ordering_key AND p.id < r.id ORDER BY p.id DESC LIMIT 1), 'done') IN (%[3]s)))`,
		t, schema.DueSQL("?1"), passed)
	var due bool
	if err := db.Reader().QueryRowContext(ctx, keyed, now).Scan(&due); err != nil {
		// A table without ordering_key (schema.mode off): any due row.
		plain := fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE %s)`, t, schema.DueRow)
		if err := db.Reader().QueryRowContext(ctx, plain, now).Scan(&due); err != nil {
			return time.Time{}, false, fmt.Errorf("read the next due row: %w", err)
		}
	}
	if due {
		return time.Now(), true, nil
	}
	var at sql.NullInt64
	next := fmt.Sprintf(`SELECT min(%s) FROM %s WHERE status = 'pending' AND NOT %s`, schema.MsSQL("available_at"), t, schema.DueSQL("?1"))
	if err := db.Reader().QueryRowContext(ctx, next, now).Scan(&at); err != nil {
		return time.Time{}, false, fmt.Errorf("read the next due row: %w", err)
	}
	if !at.Valid {
		return time.Time{}, false, nil
	}
	return time.Now().Add(time.Duration(at.Int64-now) * time.Millisecond), true, nil
}
