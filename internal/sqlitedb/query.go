package sqlitedb

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"
)

// RetryBusy runs fn again while it fails with a lock error that outlasted
// busy_timeout, or one SQLite reports without waiting (switching a new file
// to WAL): 100 ms doubling to 1 s, 5 retries.
func RetryBusy(ctx context.Context, fn func() error) error {
	wait := 100 * time.Millisecond
	for retry := 0; ; retry++ {
		err := fn()
		if err == nil || !Busy(err) || retry == 5 {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait + rand.N(wait/2)):
		}
		wait = min(2*wait, time.Second)
	}
}

// Querier is what reads take: a pool, a connection or a transaction.
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Columns returns the lower-cased column names of table t (none if it does not exist).
func Columns(ctx context.Context, q Querier, t string) (map[string]bool, error) {
	rows, err := q.QueryContext(ctx, `SELECT name FROM pragma_table_info(?)`, t)
	if err != nil {
		return nil, fmt.Errorf("read columns of %s: %w", t, err)
	}
	defer rows.Close()
	cols := map[string]bool{}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			return nil, err
		}
		cols[strings.ToLower(name)] = true
	}
	return cols, rows.Err()
}

// ObjectExists reports whether the schema has an object of the type
// ("table", "index") and name.
func ObjectExists(ctx context.Context, q Querier, typ, name string) (bool, error) {
	var n int
	if err := q.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = ? AND name = ?`, typ, name).Scan(&n); err != nil {
		return false, fmt.Errorf("read schema: %w", err)
	}
	return n > 0, nil
}
