package schema

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// instanceColumns are the heartbeat table's columns added after its
// creation, which Verify requires.
var instanceColumns = []string{"in_flight", "outbox_table", "process_scope", "atomic_batch_limit"}

// migrateInstancesPerTable adds to each heartbeat row the outbox table its
// relay serves, so that relays of two outbox tables in one file lead each
// their own (NULL: a relay from before, taken to serve any table), and the
// scope in which its pid means a process (the host's boot and the pid
// namespace), so that a relay can tell at once that a predecessor on the
// same host is gone.
func migrateInstancesPerTable(ctx context.Context, s steps) error {
	return s.tx(ctx, func(tx *sql.Tx) error {
		cols, err := sqlitedb.Columns(ctx, tx, InstancesTable)
		if err != nil {
			return err
		}
		for _, c := range []string{"outbox_table", "process_scope"} {
			if cols[c] {
				continue
			}
			if _, err = tx.ExecContext(ctx, `ALTER TABLE `+InstancesTable+` ADD COLUMN `+c+` TEXT`); err != nil {
				return fmt.Errorf("migrate %s: %w", InstancesTable, err)
			}
		}
		return nil
	})
}

// migrateInstancesBatchLimit adds to each heartbeat row how many rows of
// an ordering key its relay sends as one atomic batch (0: one at a time;
// NULL: a relay from before, or one publishing to core NATS), so that
// status can say how a key's rows go.
func migrateInstancesBatchLimit(ctx context.Context, s steps) error {
	return addInstanceColumn(ctx, s, "atomic_batch_limit", "INTEGER")
}

// addInstanceColumn adds column col of type typ to the heartbeat table,
// unless it has it.
func addInstanceColumn(ctx context.Context, s steps, col, typ string) error {
	return s.tx(ctx, func(tx *sql.Tx) error {
		cols, err := sqlitedb.Columns(ctx, tx, InstancesTable)
		if err != nil || cols[col] {
			return err
		}
		if _, err = tx.ExecContext(ctx, `ALTER TABLE `+InstancesTable+` ADD COLUMN `+col+` `+typ); err != nil {
			return fmt.Errorf("migrate %s: %w", InstancesTable, err)
		}
		return nil
	})
}
