package housekeeping

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Backlog reads the unfinished rows' counts in one short read through the
// partial indexes: its cost follows the backlog, not the table. Its
// OldestPending is when the longest-waiting due row became due (see
// schema.OldestDue); rows scheduled for later do not age the backlog.
// With parks (ordering.on_dead_letter: hold) it counts the ordering keys
// dead letters park (schema.ParkedKeysSQL); without, none is parked and
// ParkedKeys is 0.
func Backlog(ctx context.Context, s *sqlitedb.DB, parks bool) (event.Backlog, error) {
	var b event.Backlog
	if err := s.SameFile(); err != nil {
		return b, err
	}
	parked := "0"
	if parks {
		parked = "SELECT count(*) FROM (" + schema.ParkedKeysSQL(s.Table()) + ")"
	}
	// One read transaction: OldestDue reads a row it saw due again, and
	// a settle may delete it in between (retention.done_rows: delete).
	tx, err := s.Reader().BeginTx(ctx, nil)
	if err != nil {
		return event.Backlog{}, fmt.Errorf("read backlog: %w", err)
	}
	defer tx.Rollback()
	err = tx.QueryRowContext(ctx, fmt.Sprintf(`SELECT
	(SELECT count(*) FROM %[1]s WHERE status = 'pending'),
	(SELECT count(*) FROM %[1]s WHERE status = 'processing'),
	(SELECT count(*) FROM %[1]s WHERE status = 'dead_lettered'),
	(%[2]s)`, s.Table(), parked)).
		Scan(&b.Pending, &b.Processing, &b.DeadLettered, &b.ParkedKeys)
	if err != nil {
		return event.Backlog{}, fmt.Errorf("read backlog: %w", err)
	}
	oldest, err := schema.OldestDue(ctx, tx, s.Table(), s.DueMs())
	if err != nil {
		return event.Backlog{}, fmt.Errorf("read backlog: %w", err)
	}
	if oldest.Valid {
		b.OldestPending = time.UnixMilli(oldest.Int64)
	}
	return b, nil
}
