// Package schema owns the outbox's schema as the relay needs it: the
// migrations that create or upgrade the outbox table and the relay's own
// tables, Verify for files the relay may not change, and the SQL that says
// what the columns mean (a due row, a time in Unix milliseconds), shared by
// every query on the outbox.
package schema

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"time"

	sqlite3 "github.com/mattn/go-sqlite3"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// MigrationsTable records the relay's own migrations, keyed by outbox table.
// The application's migration table (e.g. sqlx's _sqlx_migrations) is never
// touched: tools refuse to start when it holds versions they do not know.
const MigrationsTable = "outbox_relay_migrations"

// InstancesTable holds one heartbeat row per running relay.
const InstancesTable = "outbox_relay_instances"

// ErrSchema is wrapped by Verify's and Migrate's errors when the schema is
// incomplete, or has a column or index the relay cannot work with.
var ErrSchema = errors.New("outbox schema incomplete")

// migration is one schema step for the outbox table. apply runs it in as
// many short BEGIN IMMEDIATE transactions as it needs (steps.tx, backfill),
// each of them idempotent: a run killed half way leaves the version
// unrecorded, and the next run finishes the job. On a file without the
// table, steps.tx runs them all in createWhole's one transaction.
type migration struct {
	version int
	name    string
	apply   func(ctx context.Context, s steps) error
}

var migrations = []migration{
	{101, "outbox_event_id", migrateOutbox},
	{102, "relay_claims", migrateClaims},
	{103, "consumer_exhausted", migrateExhausted},
	{104, "relay_in_flight", migrateInFlight},
	{105, "ordering_key", migrateOrderingKey},
	{106, "message_metadata", migrateMetadata},
	{107, "instances_per_table", migrateInstancesPerTable},
	{108, "done_records", migrateDoneRecords},
	{109, "instances_batch_limit", migrateInstancesBatchLimit},
	{110, "atomic_group", migrateAtomicGroup},
	{111, "published", migratePublished},
}

// DoneTable is the name of the table that keeps a compact record of each
// row of outbox table t that the relay deleted when it settled it
// (retention.done_rows: delete).
func DoneTable(t string) string { return "outbox_relay_done_" + t }

// migrateDoneRecords creates the outbox table's records table: one row per
// settled row the relay deleted, with what status, audit, retention and
// a consumer need of it (no payload, no headers). Its id is the outbox
// row's, so records are appended in id order. It is created whatever
// retention.done_rows says, so that switching the setting needs no
// migration.
func migrateDoneRecords(ctx context.Context, s steps) error {
	t := DoneTable(s.Table())
	return s.tx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+t+` (
	id           INTEGER PRIMARY KEY,
	event_id     TEXT,
	event_type   TEXT,
	ordering_key TEXT,
	created_at   INTEGER,
	processed_at INTEGER NOT NULL,
	stream_seq   INTEGER
)`); err != nil {
			return fmt.Errorf("create table %s: %w", t, err)
		}
		return doneTableProblem(ctx, tx, t)
	})
}

// doneColumns are the columns of an outbox table's records table.
var doneColumns = []string{"id", "event_id", "event_type", "ordering_key", "created_at", "processed_at", "stream_seq"}

// doneTableProblem returns an error (wrapping ErrSchema) when the table
// named t, which exists, lacks a column of a records table: a table of
// that name that is not the relay's is never written or pruned.
func doneTableProblem(ctx context.Context, q sqlitedb.Querier, t string) error {
	cols, err := sqlitedb.Columns(ctx, q, t)
	if err != nil {
		return err
	}
	var missing []string
	for _, c := range doneColumns {
		if !cols[c] {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: table %s lacks column(s) %s: it is not the relay's table of done records; rename it", ErrSchema, t, strings.Join(missing, ", "))
	}
	return nil
}

// IDsNeverReused reports whether the outbox table's ids are never given
// again once their rows are deleted: its id is INTEGER PRIMARY KEY
// AUTOINCREMENT. Without it SQLite gives a new row the highest id plus
// one, the id of a deleted row when the highest rows were deleted.
func IDsNeverReused(ctx context.Context, q sqlitedb.Querier, t string) (bool, error) {
	var ddl string
	err := q.QueryRowContext(ctx, `SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = ?`, t).Scan(&ddl)
	if err != nil {
		return false, fmt.Errorf("read the definition of %s: %w", t, err)
	}
	return autoincrementRe.MatchString(sqlNotCode.ReplaceAllString(ddl, " ")), nil
}

var (
	autoincrementRe = regexp.MustCompile(`(?i)\bAUTOINCREMENT\b`)
	// sqlNotCode matches what in a statement is not code: comments, string
	// literals and quoted names (which may say AUTOINCREMENT).
	sqlNotCode = regexp.MustCompile(`--[^\n]*|/\*(?s:.*?)\*/|'(?:[^']|'')*'|"(?:[^"]|"")*"|\[[^\]]*\]|` + "`[^`]*`")
)

// migrateMetadata adds two optional columns: headers (NULL: none), a JSON
// object whose entries become the message's headers, and stream_seq, the
// stream sequence JetStream assigned a row's message, written when the row
// is marked done.
func migrateMetadata(ctx context.Context, s steps) error {
	t := s.Table()
	err := s.tx(ctx, func(tx *sql.Tx) error {
		cols, err := sqlitedb.Columns(ctx, tx, t)
		if err != nil {
			return err
		}
		for _, c := range []struct{ name, decl string }{{"headers", "TEXT"}, {"stream_seq", "INTEGER"}} {
			if !cols[c.name] {
				if _, err := tx.ExecContext(ctx, fmt.Sprintf(`ALTER TABLE %s ADD COLUMN %s %s`, t, c.name, c.decl)); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("migrate %s: %w", t, err)
	}
	return nil
}

// migrateOrderingKey adds the optional ordering_key column (NULL: the row
// is not ordered) and the index a claim uses to find, for a row with a
// key, the row of the same key before it. Rows without a key are not in
// the index, and a row's settlement does not change it (status is not in
// it): it costs one entry per keyed row, written by the application's
// INSERT.
func migrateOrderingKey(ctx context.Context, s steps) error {
	return addIndexedColumn(ctx, s, "ordering_key", "_ordering")
}

// addIndexedColumn adds the optional TEXT column col to the outbox table
// and the partial index <table><suffix> on (col, id) of the rows that have
// it. Each step is a transaction of its own (steps.tx): the index is built
// by reading the whole table under the lock.
func addIndexedColumn(ctx context.Context, s steps, col, suffix string) error {
	t := s.Table()
	err := s.tx(ctx, func(tx *sql.Tx) error {
		cols, err := sqlitedb.Columns(ctx, tx, t)
		if err != nil || cols[col] {
			return err
		}
		_, err = tx.ExecContext(ctx, fmt.Sprintf(`ALTER TABLE %s ADD COLUMN %s TEXT`, t, col))
		return err
	})
	if err == nil {
		err = s.tx(ctx, func(tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %[1]s%[2]s ON %[1]s (%[3]s, id) WHERE %[3]s IS NOT NULL`, t, suffix, col))
			return err
		})
	}
	if err != nil {
		return fmt.Errorf("migrate %s: %w", t, err)
	}
	return nil
}

// migrateAtomicGroup adds the optional atomic_group column (NULL: the row
// is in no group; rows that share a value are stored all or none) and the
// index a claim uses to take a group's rows whole. Rows without a group
// are not in the index.
func migrateAtomicGroup(ctx context.Context, s steps) error {
	return addIndexedColumn(ctx, s, "atomic_group", "_atomic_group")
}

// migrateInFlight adds the count of rows a relay holds in flight to its
// heartbeat row: claims are not written to the outbox table.
func migrateInFlight(ctx context.Context, s steps) error {
	return addInstanceColumn(ctx, s, "in_flight", "INTEGER")
}

// PublishedTable holds one row per outbox table: the origin stamped on
// its messages (Outbox-Origin), which a restored copy of the file keeps,
// and where in the stream the messages of its unsettled rows can begin
// (the stream, its creation time and a sequence): a relay that starts
// leading reads the stream from there and settles the rows whose
// messages it finds, publishing nothing twice.
const PublishedTable = "outbox_relay_published"

func migratePublished(ctx context.Context, s steps) error {
	return s.tx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+PublishedTable+` (
	outbox_table   TEXT PRIMARY KEY COLLATE NOCASE,
	origin         TEXT NOT NULL,
	adopted_at     INTEGER,
	stream         TEXT,
	stream_created INTEGER,
	scan_from      INTEGER,
	updated_at     INTEGER
)`)
		if err != nil {
			return fmt.Errorf("create table %s: %w", PublishedTable, err)
		}
		return nil
	})
}

// ExhaustedTable records messages a JetStream consumer gave up on after
// max_deliver deliveries (JetStream has no dead-letter queue).
const ExhaustedTable = "outbox_relay_exhausted"

func migrateExhausted(ctx context.Context, s steps) error {
	return s.tx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+ExhaustedTable+` (
	id          INTEGER PRIMARY KEY,
	event_id    TEXT,
	stream      TEXT NOT NULL,
	consumer    TEXT NOT NULL,
	stream_seq  INTEGER NOT NULL,
	subject     TEXT,
	deliveries  INTEGER NOT NULL,
	observed_at INTEGER NOT NULL,
	UNIQUE (stream, consumer, stream_seq)
)`)
		if err != nil {
			return fmt.Errorf("create table %s: %w", ExhaustedTable, err)
		}
		return nil
	})
}

// baseColumns are the columns an existing event_queue must already have for
// migration 101 to upgrade it.
var baseColumns = []string{"id", "event_type", "payload", "status", "available_at", "created_at"}

// addable are columns migration 101 adds to a legacy table when missing.
var addable = []struct{ name, decl string }{
	{"event_id", "TEXT"},
	{"claimed_at", "INTEGER"},
	{"attempts", "INTEGER NOT NULL DEFAULT 0"},
	{"processed_at", "INTEGER"},
	{"last_error", "TEXT"},
}

// migrateOutbox is migration 101: create the outbox
// on an empty file, or upgrade a legacy one: add event_id/claimed_at,
// backfill a distinct random UUID into every row and an available_at into
// every row without one, and create the unique index; and processed_events.
// Each part is a transaction of its own (steps.tx), and the backfill a
// series of short ones.
func migrateOutbox(ctx context.Context, s steps) error {
	t := s.Table()
	created := false
	err := s.tx(ctx, func(tx *sql.Tx) error {
		cols, err := sqlitedb.Columns(ctx, tx, t)
		if err != nil {
			return err
		}
		if len(cols) == 0 {
			created = true
			if _, err := tx.ExecContext(ctx, fmt.Sprintf(`CREATE TABLE %s (
	id           INTEGER PRIMARY KEY AUTOINCREMENT,
	event_id     TEXT,
	event_type   TEXT NOT NULL,
	payload      BLOB NOT NULL,
	status       TEXT NOT NULL DEFAULT 'pending',
	attempts     INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER NOT NULL DEFAULT (%[2]s),
	claimed_at   INTEGER,
	created_at   INTEGER NOT NULL DEFAULT (%[2]s),
	processed_at INTEGER,
	last_error   TEXT
)`, t, NowSQL)); err != nil {
				return fmt.Errorf("create table %s: %w", t, err)
			}
			if _, err := tx.ExecContext(ctx, fmt.Sprintf(`CREATE UNIQUE INDEX %[1]s_event_id ON %[1]s (event_id)`, t)); err != nil {
				return fmt.Errorf("create unique index on %s.event_id: %w", t, err)
			}
		} else {
			var missing []string
			for _, c := range baseColumns {
				if !cols[c] {
					missing = append(missing, c)
				}
			}
			if len(missing) > 0 {
				return fmt.Errorf("table %s lacks column(s) %s: it is not an outbox table this migration can upgrade", t, strings.Join(missing, ", "))
			}
			for _, c := range addable {
				if !cols[c.name] {
					if _, err := tx.ExecContext(ctx, fmt.Sprintf(`ALTER TABLE %s ADD COLUMN %s %s`, t, c.name, c.decl)); err != nil {
						return fmt.Errorf("add column %s.%s: %w", t, c.name, err)
					}
				}
			}
		}
		if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS processed_events (
	event_id     TEXT NOT NULL,
	handler      TEXT NOT NULL,
	status       TEXT NOT NULL,
	started_at   INTEGER,
	processed_at INTEGER,
	PRIMARY KEY (event_id, handler)
)`); err != nil {
			return fmt.Errorf("create table processed_events: %w", err)
		}
		return nil
	})
	if err != nil || created {
		return err
	}
	err = backfill(ctx, s.DB,
		// A distinct random UUID for every row without one.
		fmt.Sprintf(`UPDATE %s SET event_id = %s WHERE rowid > ?1 AND rowid <= ?2 AND event_id IS NULL`, t, uuidSQL),
		// A NULL available_at means "now" to the claim; give it its
		// created_at where that is a time, else now, so that the backlog
		// ages it from when it was written.
		fmt.Sprintf(`UPDATE %s SET available_at = CASE WHEN typeof(created_at) = 'integer' THEN created_at ELSE %s END
WHERE rowid > ?1 AND rowid <= ?2 AND available_at IS NULL`, t, NowSQL),
	)
	if err != nil {
		return err
	}
	// The unique index after the backfill: kept up to date during it, the
	// index would take a random page write per row (the ids are random),
	// twenty times the backfill's cost. Building it is the one step that
	// reads the whole table under the lock: SQLite builds an index in one
	// statement (about 2 s for 2.5 million rows).
	return s.tx(ctx, func(tx *sql.Tx) error { return createEventIDIndex(ctx, tx, t) })
}

// createEventIDIndex creates the unique index on event_id unless one
// exists. An index of the relay's name that does not make event_id unique
// is an error: IF NOT EXISTS would keep it. One of another name is left
// alone.
func createEventIDIndex(ctx context.Context, tx *sql.Tx, t string) error {
	problem, _, blocked, err := eventIDIndexProblem(ctx, tx, t)
	if err != nil || problem == "" {
		return err
	}
	if blocked {
		return fmt.Errorf("%w: %s", ErrSchema, problem)
	}
	_, err = tx.ExecContext(ctx, fmt.Sprintf(`CREATE UNIQUE INDEX %[1]s_event_id ON %[1]s (event_id)`, t))
	var se sqlite3.Error
	if errors.As(err, &se) && se.Code == sqlite3.ErrConstraint {
		var n int
		var example string
		if qerr := tx.QueryRowContext(ctx, fmt.Sprintf(`SELECT count(*), coalesce(min(event_id), '') FROM (SELECT event_id FROM %s WHERE event_id IS NOT NULL GROUP BY event_id HAVING count(*) > 1)`, t)).Scan(&n, &example); qerr == nil && n > 0 {
			return fmt.Errorf("create unique index on %s.event_id: %d event ids are each shared by more than one row (for one, %q): JetStream would publish only the first row of each; give every row its own id and migrate again", t, n, example)
		}
	}
	if err != nil {
		return fmt.Errorf("create unique index on %s.event_id: %w", t, err)
	}
	return nil
}

// migrateClaims adds what the relay needs beyond the outbox itself: the
// claim owner, the indexes that keep a claim proportional to the batch, and
// the instance heartbeat table. Each statement is a transaction of its own
// (steps.tx): an index is built by reading the whole table under the lock.
func migrateClaims(ctx context.Context, s steps) error {
	t := s.Table()
	err := s.tx(ctx, func(tx *sql.Tx) error {
		cols, err := sqlitedb.Columns(ctx, tx, t)
		if err != nil || cols["claimed_by"] {
			return err
		}
		_, err = tx.ExecContext(ctx, fmt.Sprintf(`ALTER TABLE %s ADD COLUMN claimed_by TEXT`, t))
		return err
	})
	if err != nil {
		return fmt.Errorf("migrate %s: %w", t, err)
	}
	for _, stmt := range []string{
		// Leading id matches the claim's ORDER BY id: no sort, stop at LIMIT.
		fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %[1]s_pending ON %[1]s (id, available_at) WHERE status = 'pending'`, t),
		fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %[1]s_processing ON %[1]s (claimed_at) WHERE status = 'processing'`, t),
		fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %[1]s_dead_lettered ON %[1]s (processed_at) WHERE status = 'dead_lettered'`, t),
		`CREATE TABLE IF NOT EXISTS ` + InstancesTable + ` (
	instance_id  TEXT PRIMARY KEY,
	started_at   INTEGER NOT NULL,
	heartbeat_at INTEGER NOT NULL,
	hostname     TEXT,
	pid          INTEGER,
	version      TEXT
)`,
	} {
		if err := s.tx(ctx, func(tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, stmt)
			return err
		}); err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		}
	}
	return nil
}

// A backfill transaction updates at most backfillBatch rows, and fewer
// where that would hold the lock for much longer than backfillHold: the
// batch size follows the time the last batch held the lock.
const (
	backfillBatch = 10_000
	backfillFirst = 1_000
	backfillHold  = 25 * time.Millisecond
)

// backfill runs the updates over the rows present when it starts, in
// rowid order, in short BEGIN IMMEDIATE transactions of up to
// backfillBatch rows (sized to hold the lock for about backfillHold); each
// update takes the batch's rowid range as ?1 (exclusive) and ?2
// (inclusive), and must only fill what is missing, so that a backfill cut
// short (kill -9) is finished by running it again. After each transaction
// the application has the lock for a while (migrationTx), at least 10 ms.
func backfill(ctx context.Context, s *sqlitedb.DB, updates ...string) error {
	var lo, end sql.NullInt64
	if err := s.Reader().QueryRowContext(ctx, fmt.Sprintf(`SELECT min(rowid) - 1, max(rowid) FROM %s`, s.Table())).Scan(&lo, &end); err != nil {
		return fmt.Errorf("backfill %s: %w", s.Table(), err)
	}
	if !end.Valid {
		return nil // no rows
	}
	next := fmt.Sprintf(`SELECT rowid FROM %s WHERE rowid > ?1 AND rowid <= ?2 ORDER BY rowid LIMIT 1 OFFSET ?3`, s.Table())
	batch := backfillFirst
	for from := lo.Int64; from < end.Int64; {
		// Found without the lock: the range holds the batch's rows whatever
		// the application does meanwhile.
		to := end.Int64
		var hi int64
		switch err := s.Reader().QueryRowContext(ctx, next, from, end.Int64, batch-1).Scan(&hi); {
		case err == nil:
			to = hi
		case !errors.Is(err, sql.ErrNoRows):
			return fmt.Errorf("backfill %s: %w", s.Table(), err)
		}
		var held time.Duration
		err := migrationTx(ctx, s, 10*time.Millisecond, &held, func(tx *sql.Tx) error {
			for _, u := range updates {
				if _, err := tx.ExecContext(ctx, u, from, to); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("backfill %s rows %d to %d: %w", s.Table(), from+1, to, err)
		}
		from = to
		batch = max(100, min(backfillBatch, 2*batch, int(float64(batch)*float64(backfillHold)/float64(max(held, time.Millisecond)))))
	}
	return nil
}

// migrationTx runs fn in a BEGIN IMMEDIATE transaction of its own, then
// leaves the lock to the application for as long as the transaction held
// it, at least minPause and at most 100 ms: the application's writers
// sleep in their busy handlers between tries (up to 100 ms at a time), and
// a relay that took the lock straight back would find them asleep again.
// Before pausing it checkpoints (the WAL stays small, and the application's
// commits do not pay for copying the migration into the database). held, if
// not nil, receives how long the transaction held the lock.
func migrationTx(ctx context.Context, s *sqlitedb.DB, minPause time.Duration, held *time.Duration, fn func(tx *sql.Tx) error) error {
	var start time.Time
	if err := s.InTx(ctx, func(tx *sql.Tx) error {
		start = time.Now()
		return fn(tx)
	}); err != nil {
		return err
	}
	d := time.Since(start)
	if held != nil {
		*held = d
	}
	pause := time.Now().Add(min(max(d, minPause), 100*time.Millisecond))
	if d > time.Millisecond {
		s.Checkpoint(ctx) // best effort: the next transaction finds out if the file is gone
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Until(pause)):
	}
	return nil
}

// Migrate applies the relay's pending migrations. A file without the
// outbox table gets all of them in one transaction (createWhole). On an
// existing table each runs in short BEGIN IMMEDIATE transactions, every
// one of them idempotent, and is recorded only once complete, so two
// processes migrating the same file at once both succeed and a migration
// cut short is finished by the next run.
// Persistent lock contention is retried with a bounded backoff (100 ms
// doubling to 1 s, 5 retries). It returns the versions it applied.
//
// It changes nothing, and says what to change, when an existing table has
// a time column that cannot hold integer milliseconds (SQLite cannot change
// a column's type or default in place) or an index of the relay's name for
// event_id that does not make it UNIQUE; and it fails, after migrating,
// when no UNIQUE index covers event_id.
func Migrate(ctx context.Context, s *sqlitedb.DB) ([]int, error) {
	var problems []string
	var exists bool
	var indexProblem string // as preconditions found it
	err := sqlitedb.RetryBusy(ctx, func() (err error) {
		problems, indexProblem, exists, err = preconditions(ctx, s)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w in %s: %s; nothing was changed", ErrSchema, s.Path(), strings.Join(problems, "; "))
	}
	recorded, err := recordedVersions(ctx, s)
	if err != nil {
		return nil, err
	}
	var applied []int
	changed := !exists // the table may not be as preconditions read it
	if !exists {
		created, err := createWhole(ctx, s)
		if err != nil {
			return nil, err
		}
		if created {
			for _, m := range migrations {
				recorded[m.version] = true
				applied = append(applied, m.version)
			}
		}
	}
	for _, m := range migrations {
		if recorded[m.version] {
			continue
		}
		changed = true // by this relay or, meanwhile, another
		ok, err := migrateOne(ctx, s, m)
		if err != nil {
			return applied, fmt.Errorf("migration %d (%s): %w", m.version, m.name, err)
		}
		if ok {
			applied = append(applied, m.version)
		}
	}
	problem := indexProblem
	if changed || problem != "" { // another process may have made it since
		if problem, _, _, err = eventIDIndexProblem(ctx, s.Reader(), s.Table()); err != nil {
			return applied, err
		}
	}
	if problem != "" {
		return applied, fmt.Errorf("%w in %s: %s", ErrSchema, s.Path(), problem)
	}
	return applied, nil
}

// recordedVersions are the migrations recorded complete for s's table, read
// without a transaction of the writer's: a file migrated already, as every
// file a relay opens again is, takes no write lock for them. One not
// recorded here is checked again in its own transaction (applyMigration).
func recordedVersions(ctx context.Context, s *sqlitedb.DB) (map[int]bool, error) {
	recorded := map[int]bool{}
	err := sqlitedb.RetryBusy(ctx, func() error {
		clear(recorded)
		if ok, err := sqlitedb.ObjectExists(ctx, s.Reader(), "table", MigrationsTable); err != nil || !ok {
			return err
		}
		rows, err := s.Reader().QueryContext(ctx, `SELECT version FROM `+MigrationsTable+` WHERE target = ?`, s.Table())
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var v int
			if err := rows.Scan(&v); err != nil {
				return err
			}
			recorded[v] = true
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("read the migrations recorded in %s: %w", s.Path(), err)
	}
	return recorded, nil
}

// preconditions lists what in an existing outbox table the migrations
// cannot fix, and reports whether the table exists.
func preconditions(ctx context.Context, s *sqlitedb.DB) (problems []string, indexProblem string, exists bool, err error) {
	cols, err := sqlitedb.Columns(ctx, s.Reader(), s.Table())
	if err != nil || len(cols) == 0 {
		return nil, "", false, err
	}
	if problems, err = timeColumnProblems(ctx, s.Reader(), s.Table()); err != nil {
		return nil, "", true, err
	}
	indexProblem, _, blocked, err := eventIDIndexProblem(ctx, s.Reader(), s.Table())
	if err != nil {
		return nil, "", true, err
	}
	if blocked {
		problems = append(problems, indexProblem)
	}
	return problems, indexProblem, true, nil
}

func migrateOne(ctx context.Context, s *sqlitedb.DB, m migration) (applied bool, err error) {
	err = sqlitedb.RetryBusy(ctx, func() error {
		applied, err = applyMigration(ctx, s, m)
		return err
	})
	return applied, err
}

// applyMigration applies m unless it is recorded, and records it once it
// is complete, unless another process recorded it meanwhile.
func applyMigration(ctx context.Context, s *sqlitedb.DB, m migration) (applied bool, err error) {
	var done bool
	err = migrationTx(ctx, s, 0, nil, func(tx *sql.Tx) error {
		var err error
		done, err = migrationRecorded(ctx, tx, s.Table(), m.version)
		return err
	})
	if err != nil || done {
		return false, err
	}
	if err := m.apply(ctx, steps{DB: s}); err != nil {
		return false, err
	}
	// Recorded only now that it is complete, and once.
	err = migrationTx(ctx, s, 0, nil, func(tx *sql.Tx) error {
		var err error
		if done, err = migrationRecorded(ctx, tx, s.Table(), m.version); err != nil || done {
			return err
		}
		return recordMigration(ctx, tx, s.Table(), m)
	})
	return err == nil && !done, err
}

// migrationRecorded creates the migrations table unless it exists, and
// reports whether it records migration version of outbox table target.
func migrationRecorded(ctx context.Context, tx *sql.Tx, target string, version int) (bool, error) {
	if err := createMigrationsTable(ctx, tx); err != nil {
		return false, err
	}
	var n int
	err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+MigrationsTable+` WHERE target = ? AND version = ?`, target, version).Scan(&n)
	return n > 0, err
}

func createMigrationsTable(ctx context.Context, tx *sql.Tx) error {
	_, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+MigrationsTable+` (
	target     TEXT NOT NULL,
	version    INTEGER NOT NULL,
	name       TEXT NOT NULL,
	applied_at INTEGER NOT NULL,
	PRIMARY KEY (target, version)
)`)
	return err
}

func recordMigration(ctx context.Context, tx *sql.Tx, target string, m migration) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO `+MigrationsTable+` (target, version, name, applied_at) VALUES (?, ?, ?, ?)`, target, m.version, m.name, sqlitedb.NowMs())
	return err
}

// createWhole gives a file without the outbox table the table and all the
// relay keeps beside it, every migration applied and recorded, in one
// transaction. An application that creates the table itself (CREATE TABLE
// IF NOT EXISTS) or writes to it as soon as it exists, as a fleet's new
// tenant does while the relay migrates its file, finds either no table or
// the whole of it, never the first migration's columns alone. Migrations
// recorded for a table dropped since are recorded again. It does nothing,
// and says so, when the table exists (another process made it meanwhile):
// Migrate then applies what is missing version by version.
func createWhole(ctx context.Context, s *sqlitedb.DB) (created bool, err error) {
	err = sqlitedb.RetryBusy(ctx, func() error {
		created = false
		return migrationTx(ctx, s, 0, nil, func(tx *sql.Tx) error {
			if cols, err := sqlitedb.Columns(ctx, tx, s.Table()); err != nil || len(cols) > 0 {
				return err
			}
			if err := createMigrationsTable(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, `DELETE FROM `+MigrationsTable+` WHERE target = ?`, s.Table()); err != nil {
				return err
			}
			for _, m := range migrations {
				if err := m.apply(ctx, steps{DB: s, whole: tx}); err != nil {
					return fmt.Errorf("migration %d (%s): %w", m.version, m.name, err)
				}
				if err := recordMigration(ctx, tx, s.Table(), m); err != nil {
					return err
				}
			}
			created = true
			return nil
		})
	})
	return created, err
}

// steps runs a migration's transactions: each a BEGIN IMMEDIATE transaction
// of its own (migrationTx), or all of them in the transaction whole, in
// which createWhole makes a new file's outbox (there is nothing to build
// an index from, and the table appears only once whole).
type steps struct {
	*sqlitedb.DB
	whole *sql.Tx
}

func (s steps) tx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	if s.whole != nil {
		return fn(s.whole)
	}
	return migrationTx(ctx, s.DB, 0, nil, fn)
}

// timeColumns hold Unix milliseconds, which the relay compares as integers
// (available_at <= now) and reads as integers.
var timeColumns = []string{"available_at", "created_at", "processed_at", "claimed_at"}

// timeColumnProblems names each time column of table t that cannot hold
// integer milliseconds: one without INTEGER affinity, or whose default
// gives something else (text such as CURRENT_TIMESTAMP's, a fraction, Unix
// seconds). No default, a NULL one and an integer one are fine.
func timeColumnProblems(ctx context.Context, q sqlitedb.Querier, t string) ([]string, error) {
	type col struct {
		name, typ string
		dflt      sql.NullString
	}
	rows, err := q.QueryContext(ctx, `SELECT lower(name), type, dflt_value FROM pragma_table_info(?)`, t)
	if err != nil {
		return nil, fmt.Errorf("read columns of %s: %w", t, err)
	}
	byName := map[string]col{}
	for rows.Next() {
		var c col
		if err := rows.Scan(&c.name, &c.typ, &c.dflt); err != nil {
			rows.Close()
			return nil, err
		}
		byName[c.name] = c
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var problems []string
	for _, name := range timeColumns {
		c, ok := byName[name]
		if !ok {
			continue
		}
		decl := c.typ
		if decl == "" {
			decl = "declared without a type"
		}
		if c.dflt.Valid {
			d := c.dflt.String
			if strings.Contains(d, "(") {
				d = "(" + d + ")"
			}
			decl += " DEFAULT " + d
		}
		var why string
		if aff := affinity(c.typ); aff != "INTEGER" {
			why = aff + " affinity, not INTEGER"
		} else if c.dflt.Valid {
			if why, err = judgeDefault(ctx, q, c.dflt.String); err != nil {
				return nil, err
			}
		}
		if why == "" {
			continue
		}
		want := "INTEGER" // claimed_at, processed_at: NULL until the relay sets them
		if name == "available_at" || name == "created_at" {
			want = "INTEGER NOT NULL DEFAULT (" + NowSQL + ")"
		}
		problems = append(problems, fmt.Sprintf("column %s.%s is %s, which has %s; declare it `%s %s`", t, name, decl, why, name, want))
	}
	if len(problems) > 0 {
		problems[len(problems)-1] += " (SQLite cannot change a column's type or default in place: rebuild the table as " +
			"https://sqlite.org/lang_altertable.html#otheralter shows, converting the column's text times with " +
			"CAST((julianday(column) - 2440587.5) * 86400000 AS INTEGER), or Unix seconds with column * 1000)"
	}
	return problems, nil
}

// judgeDefault evaluates a column default as SQLite would for a column of
// INTEGER affinity and says what is wrong with the value, if anything. A
// default that cannot be evaluated here (a function of the application's
// own) is given the benefit of the doubt.
func judgeDefault(ctx context.Context, q sqlitedb.Querier, dflt string) (string, error) {
	var v any
	if err := q.QueryRowContext(ctx, `SELECT (`+dflt+`)`).Scan(&v); err != nil {
		return "", nil
	}
	var n int64
	switch v := v.(type) {
	case nil:
		return "", nil
	case int64:
		n = v
	case float64:
		if v != math.Trunc(v) || math.Abs(v) > 1<<62 {
			return fmt.Sprintf("a default that stores a fraction (%v)", v), nil
		}
		n = int64(v)
	case string, []byte:
		text := fmt.Sprintf("%s", v)
		f, err := strconv.ParseFloat(strings.TrimSpace(text), 64)
		if !numericText.MatchString(text) || err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<62 {
			return fmt.Sprintf("a default that stores text (%q now)", text), nil
		}
		n = int64(f)
		if i, err := strconv.ParseInt(strings.TrimSpace(text), 10, 64); err == nil {
			n = i
		}
	default:
		return fmt.Sprintf("a default that stores %T", v), nil
	}
	if sec := time.Now().Unix(); n > sec-2*86400 && n < sec+2*86400 {
		return fmt.Sprintf("a default that gives Unix seconds (%d now), not milliseconds", n), nil
	}
	return "", nil
}

// numericText is a number as SQLite's type affinity recognizes it.
var numericText = regexp.MustCompile(`^\s*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\s*$`)

// affinity is SQLite's type affinity of a declared column type
// (https://sqlite.org/datatype3.html#determination_of_column_affinity).
func affinity(decl string) string {
	d := strings.ToUpper(decl)
	switch {
	case strings.Contains(d, "INT"):
		return "INTEGER"
	case strings.Contains(d, "CHAR"), strings.Contains(d, "CLOB"), strings.Contains(d, "TEXT"):
		return "TEXT"
	case d == "", strings.Contains(d, "BLOB"):
		return "BLOB"
	case strings.Contains(d, "REAL"), strings.Contains(d, "FLOA"), strings.Contains(d, "DOUB"):
		return "REAL"
	}
	return "NUMERIC"
}

// eventIDIndexProblem says what is wrong with the uniqueness of table t's
// event_id: "" when a UNIQUE index covers it alone (of any name, partial
// only WHERE event_id IS NOT NULL); absent when there is simply none, else
// which index on it, or of the relay's name, falls short and how to fix it;
// blocked when the relay's name is taken by an index that falls short (the
// migration cannot create its own).
// Without uniqueness two rows can share an id, and JetStream drops the
// second as a duplicate of the first: one event lost.
func eventIDIndexProblem(ctx context.Context, q sqlitedb.Querier, t string) (problem string, absent, blocked bool, err error) {
	rows, err := q.QueryContext(ctx, `SELECT il.name, il."unique", coalesce(lower(ii.name), '?'), coalesce(m.sql, '')
FROM pragma_index_list(?1) il JOIN pragma_index_info(il.name) ii LEFT JOIN sqlite_master m ON m.type = 'index' AND m.name = il.name
ORDER BY il.name, ii.seqno`, t)
	if err != nil {
		return "", false, false, fmt.Errorf("read indexes of %s: %w", t, err)
	}
	var idx []*index
	for rows.Next() {
		var name, col, def string
		var unique bool
		if err := rows.Scan(&name, &unique, &col, &def); err != nil {
			rows.Close()
			return "", false, false, err
		}
		if len(idx) == 0 || idx[len(idx)-1].name != name {
			idx = append(idx, &index{name: name, unique: unique, sql: def})
		}
		idx[len(idx)-1].cols = append(idx[len(idx)-1].cols, col)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return "", false, false, err
	}
	var bad []string
	for _, ix := range idx {
		alone := len(ix.cols) == 1 && ix.cols[0] == "event_id"
		where := partialWhere(ix.sql)
		if alone && ix.unique && (where == "" || notNullOnly(where)) {
			return "", false, false, nil
		}
		switch {
		case !alone && strings.EqualFold(ix.name, t+"_event_id"):
			bad = append(bad, fmt.Sprintf("index %s on %s (%s) is not UNIQUE on event_id alone", ix.name, t, strings.Join(ix.cols, ", ")))
		case alone && !ix.unique:
			bad = append(bad, fmt.Sprintf("index %s on %s.event_id is not UNIQUE", ix.name, t))
		case alone:
			bad = append(bad, fmt.Sprintf("index %s on %s.event_id is UNIQUE only WHERE %s", ix.name, t, where))
		}
	}
	if len(bad) == 0 {
		return fmt.Sprintf("index %[1]s_event_id (UNIQUE on %[1]s.event_id)", t), true, false, nil
	}
	fix := fmt.Sprintf("create one: CREATE UNIQUE INDEX %[1]s_event_id ON %[1]s (event_id)", t)
	taken := relayIndex(idx, t)
	if taken != "" {
		fix = fmt.Sprintf("replace it: DROP INDEX %s; CREATE UNIQUE INDEX %[1]s ON %s (event_id)", taken, t)
	}
	return fmt.Sprintf("%s: two rows with one event_id would reach JetStream as one message (it drops the second as a duplicate); %s",
		strings.Join(bad, ", "), fix), false, taken != "", nil
}

// index is one index of the outbox table, as eventIDIndexProblem reads it.
type index struct {
	name   string
	unique bool
	cols   []string
	sql    string
}

// relayIndex returns the name of the index among idx that has the relay's
// name for the event_id index, if any.
func relayIndex(idx []*index, t string) string {
	for _, ix := range idx {
		if strings.EqualFold(ix.name, t+"_event_id") {
			return ix.name
		}
	}
	return ""
}

// partialWhere returns the WHERE clause of a CREATE INDEX statement, if any.
func partialWhere(def string) string {
	if m := indexWhere.FindStringSubmatch(def); m != nil {
		return strings.TrimSpace(m[1])
	}
	return ""
}

// indexWhere finds a partial index's WHERE clause after its column list.
var indexWhere = regexp.MustCompile(`(?is)\)\s*where\s+(.*)$`)

// notNullOnly reports whether a partial index's WHERE clause only leaves
// out NULL event ids, which never conflict anyway.
func notNullOnly(where string) bool {
	w := strings.NewReplacer(" ", "", "\t", "", "\n", "", "(", "", ")", "", `"`, "", "`", "", "[", "", "]", "").Replace(strings.ToLower(where))
	return w == "event_idisnotnull" || w == "event_idnotnull"
}

// TableExists returns an error naming the outbox table when the file has
// no such table.
func TableExists(ctx context.Context, s *sqlitedb.DB) error {
	ok, err := sqlitedb.ObjectExists(ctx, s.Reader(), "table", s.Table())
	if err != nil {
		return fmt.Errorf("look for table %s: %w", s.Table(), err)
	}
	if !ok {
		return fmt.Errorf("database %s has no table %s", s.Path(), s.Table())
	}
	return nil
}
