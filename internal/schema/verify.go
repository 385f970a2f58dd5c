package schema

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// What the relay needs of the schema, for Verify and Usable.
var (
	requiredColumns = []string{"id", "event_id", "event_type", "payload", "status", "attempts", "available_at", "claimed_at", "created_at", "processed_at", "last_error", "claimed_by", "ordering_key", "headers", "stream_seq", "atomic_group"}
	requiredIndexes = []string{"_pending", "_processing", "_dead_lettered", "_ordering", "_atomic_group"}
	requiredTables  = []string{"processed_events", InstancesTable, ExhaustedTable, PublishedTable}
)

// Verify checks the schema without changing it and returns an error naming
// every missing table, column and index, an event_id that no UNIQUE index
// covers, and every time column that cannot hold integer milliseconds.
func Verify(ctx context.Context, s *sqlitedb.DB) error {
	t := s.Table()
	missing, wrong, err := unusable(ctx, s)
	if err != nil {
		return err
	}
	switch problem, absent, _, err := eventIDIndexProblem(ctx, s.Reader(), t); {
	case err != nil:
		return err
	case absent:
		missing = append(missing, problem)
	case problem != "":
		wrong = append(wrong, problem)
	}
	for _, suffix := range requiredIndexes {
		if ok, err := sqlitedb.ObjectExists(ctx, s.Reader(), "index", t+suffix); err != nil {
			return err
		} else if !ok {
			missing = append(missing, "index "+t+suffix)
		}
	}
	return schemaError(s, missing, wrong)
}

// Usable returns an error naming what the relay cannot work without, in
// Verify's words: every missing table and column it reads or writes, and
// every time column that cannot hold integer milliseconds. Without them
// every claim or settle fails, or no row is ever due. It leaves out what
// only Verify requires: indexes (without them claims read more of the
// table) and a UNIQUE index on event_id (without it two rows sharing an id
// reach JetStream as one message). It is the check for a relay that
// changes nothing and verifies nothing else (schema.mode off).
func Usable(ctx context.Context, s *sqlitedb.DB) error {
	missing, wrong, err := unusable(ctx, s)
	if err != nil {
		return err
	}
	return schemaError(s, missing, wrong)
}

// unusable lists the missing tables and columns, and the time columns
// that cannot hold integer milliseconds.
func unusable(ctx context.Context, s *sqlitedb.DB) (missing, wrong []string, err error) {
	t := s.Table()
	cols, err := sqlitedb.Columns(ctx, s.Reader(), t)
	if err != nil {
		return nil, nil, err
	}
	if len(cols) == 0 {
		missing = append(missing, "table "+t)
	} else {
		for _, c := range requiredColumns {
			if !cols[c] {
				missing = append(missing, "column "+t+"."+c)
			}
		}
		if wrong, err = timeColumnProblems(ctx, s.Reader(), t); err != nil {
			return nil, nil, err
		}
	}
	for _, name := range requiredTables {
		if ok, err := sqlitedb.ObjectExists(ctx, s.Reader(), "table", name); err != nil {
			return nil, nil, err
		} else if !ok {
			missing = append(missing, "table "+name)
		} else if name == InstancesTable {
			cols, err := sqlitedb.Columns(ctx, s.Reader(), name)
			if err != nil {
				return nil, nil, err
			}
			for _, c := range instanceColumns {
				if !cols[c] {
					missing = append(missing, "column "+name+"."+c)
				}
			}
		}
	}
	return missing, wrong, nil
}

// schemaError is the error (wrapping ErrSchema) that names what is
// missing and what is wrong, or nil when nothing is.
func schemaError(s *sqlitedb.DB, missing, wrong []string) error {
	var parts []string
	if len(missing) > 0 {
		parts = append(parts, "missing "+strings.Join(missing, ", ")+" (run `outbox-relay migrate` or use schema.mode auto)")
	}
	parts = append(parts, wrong...)
	if len(parts) > 0 {
		return fmt.Errorf("%w in %s: %s", ErrSchema, s.Path(), strings.Join(parts, "; "))
	}
	return nil
}

// DeleteDoneProblem says what keeps the relay from deleting the outbox
// table's rows once done (retention.done_rows: delete), or "": the table
// that keeps their records (DoneTable) is missing or not the relay's, or
// the table's ids may be
// given again (no AUTOINCREMENT), which would make a claim miss new rows
// and records replace each other.
func DeleteDoneProblem(ctx context.Context, s *sqlitedb.DB) (string, error) {
	t := s.Table()
	if ok, err := sqlitedb.ObjectExists(ctx, s.Reader(), "table", DoneTable(t)); err != nil {
		return "", err
	} else if !ok {
		return fmt.Sprintf("table %s, which keeps the records of deleted rows, is missing (run `outbox-relay migrate` or use schema.mode auto)", DoneTable(t)), nil
	}
	if err := doneTableProblem(ctx, s.Reader(), DoneTable(t)); errors.Is(err, ErrSchema) {
		return err.Error(), nil
	} else if err != nil {
		return "", err
	}
	if ok, err := IDsNeverReused(ctx, s.Reader(), t); err != nil {
		return "", err
	} else if !ok {
		return fmt.Sprintf("%s gives the ids of deleted rows again: deleting done rows needs `id INTEGER PRIMARY KEY AUTOINCREMENT` (SQLite cannot add it to an existing table: copy the table into one created with it, or keep retention.done_rows: keep)", t), nil
	}
	return "", nil
}
