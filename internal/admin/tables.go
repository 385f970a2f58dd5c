package admin

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// ErrNoTable is wrapped by RequireTables's error when a table is missing.
var ErrNoTable = errors.New("no such table")

// Tables the operator's commands read besides the outbox table.
var (
	// StatusTables are what ReadStatus reads.
	StatusTables = []string{schema.InstancesTable, schema.ExhaustedTable}
	// ExhaustedTables are what ExhaustedMessages reads.
	ExhaustedTables = []string{schema.ExhaustedTable}
)

// RequireTables checks that s holds its outbox table and the relay's own
// tables named, before a command reads them: SQLite's "no such table"
// says neither which file was read nor what to do. The error names the
// table and the file, and says how to create it (outbox-relay migrate) or
// where the name came from (database.table).
func RequireTables(ctx context.Context, s *sqlitedb.DB, relayTables ...string) error {
	file := s.Path()
	if abs, err := filepath.Abs(file); err == nil {
		file = abs
	}
	for i, t := range append([]string{s.Table()}, relayTables...) {
		cols, err := sqlitedb.Columns(ctx, s.Reader(), t) // as SQL names it: case-insensitive
		if err != nil {
			return fmt.Errorf("look for table %s in %s: %w", t, file, err)
		}
		switch {
		case len(cols) > 0:
		case i == 0:
			return fmt.Errorf("%w: %s in %s: to create it, run outbox-relay migrate with the same configuration; or check database.path and database.table",
				ErrNoTable, t, file)
		default:
			return fmt.Errorf("%w: %s in %s (the relay's own table): to create it, run outbox-relay migrate with the same configuration, or start the relay with schema.mode auto",
				ErrNoTable, t, file)
		}
	}
	return nil
}
