package schema

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// oldestDueWindow is how many due rows, in claim order, OldestDue looks
// at, so that a backlog of a million rows costs a fraction of a
// millisecond instead of a scan of every row (a few hundred milliseconds,
// every stats interval). A row further back is missed only when a thousand
// due rows ahead of it became due after it (retried or released rows);
// they wait unclaimed too, so a stuck relay still shows, a little later.
const oldestDueWindow = 1000

// OldestDue returns when the longest-waiting due row of outbox table t
// became due at now (Unix milliseconds), or NULL when nothing is due: the
// later of created_at and available_at, since a row cannot be published
// before either, among the first oldestDueWindow due rows in id order
// (the order the relay claims them in). Where one of the two is no time
// (or NULL), the other counts alone.
//
// available_at comes from the pending index; created_at comes after the
// payload in the record, and reading it reads a large row's whole
// payload. So the rows are visited by available_at, earliest first, and
// their created_at read until the next row's available_at cannot beat
// the earliest found: one row's, when created_at is not after
// available_at (as the columns' defaults write them).
func OldestDue(ctx context.Context, q sqlitedb.Querier, t string, now int64) (sql.NullInt64, error) {
	var best sql.NullInt64
	type due struct {
		id int64
		a  sql.NullInt64 // available_at; NULL: no time, and no lower bound
	}
	rows, err := q.QueryContext(ctx, fmt.Sprintf(`SELECT id, %s FROM %s WHERE %s ORDER BY id LIMIT %d`, MsSQL("available_at"), t, DueRow, oldestDueWindow), now)
	if err != nil {
		return best, fmt.Errorf("read the oldest due row: %w", err)
	}
	var window []due
	for rows.Next() {
		var d due
		if err := rows.Scan(&d.id, &d.a); err != nil {
			rows.Close()
			return best, fmt.Errorf("read the oldest due row: %w", err)
		}
		window = append(window, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return best, fmt.Errorf("read the oldest due row: %w", err)
	}
	slices.SortStableFunc(window, func(x, y due) int {
		switch {
		case x.a.Valid == y.a.Valid:
			return cmp.Compare(x.a.Int64, y.a.Int64)
		case !x.a.Valid:
			return -1
		default:
			return 1
		}
	})
	created := fmt.Sprintf(`SELECT %s FROM %s WHERE id = ?`, MsSQL("created_at"), t)
	for _, d := range window {
		if best.Valid && d.a.Valid && d.a.Int64 >= best.Int64 {
			break // this row and every later one became due no earlier
		}
		var c sql.NullInt64
		if err := q.QueryRowContext(ctx, created, d.id).Scan(&c); errors.Is(err, sql.ErrNoRows) {
			continue // settled (deleted) since the window was read, outside a transaction
		} else if err != nil {
			return best, fmt.Errorf("read the oldest due row: %w", err)
		}
		v := d.a
		if c.Valid && (!v.Valid || c.Int64 > v.Int64) {
			v = c
		}
		if v.Valid && (!best.Valid || v.Int64 < best.Int64) {
			best = v
		}
	}
	return best, nil
}
