package claim

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// NextDue returns when the earliest pending row of db's outbox table is
// due, and whether there is one: a fleet looks at a file this way before
// it serves it. A read through the pending index, which holds only
// pending rows.
func NextDue(ctx context.Context, db *sqlitedb.DB) (time.Time, bool, error) {
	var at sql.NullInt64
	if err := db.Reader().QueryRowContext(ctx, `SELECT min(available_at) FROM `+db.Table()+` WHERE status = 'pending'`).Scan(&at); err != nil {
		return time.Time{}, false, fmt.Errorf("read the next due row: %w", err)
	}
	return time.UnixMilli(at.Int64), at.Valid, nil
}
