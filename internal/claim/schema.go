package claim

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"time"
)

// MigrationsTable records the relay's own migrations, keyed by outbox table.
// The application's migration table (e.g. sqlx's _sqlx_migrations) is never
// touched: tools refuse to start when it holds versions they do not know.
const MigrationsTable = "outbox_relay_migrations"

// InstancesTable holds one heartbeat row per running relay.
const InstancesTable = "outbox_relay_instances"

// ErrSchema is wrapped by Verify's error when the schema is incomplete.
var ErrSchema = errors.New("outbox schema incomplete")

// migration is one schema step for the outbox table t, run inside a
// BEGIN IMMEDIATE transaction.
type migration struct {
	version int
	name    string
	apply   func(ctx context.Context, tx *sql.Tx, t string) error
}

var migrations = []migration{
	{101, "outbox_event_id", migrateOutbox},
	{102, "relay_claims", migrateClaims},
	{103, "consumer_exhausted", migrateExhausted},
}

// ExhaustedTable records messages a JetStream consumer gave up on after
// max_deliver deliveries (JetStream has no dead-letter queue).
const ExhaustedTable = "outbox_relay_exhausted"

func migrateExhausted(ctx context.Context, tx *sql.Tx, _ string) error {
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

// migrateOutbox is the design record's migration 0101: create the outbox
// on an empty file, or add event_id/claimed_at to a legacy one and backfill
// a distinct random UUID into every row; the unique index; processed_events.
func migrateOutbox(ctx context.Context, tx *sql.Tx, t string) error {
	cols, err := columns(ctx, tx, t)
	if err != nil {
		return err
	}
	if len(cols) == 0 {
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
)`, t, nowSQL)); err != nil {
			return fmt.Errorf("create table %s: %w", t, err)
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
		if _, err := tx.ExecContext(ctx, fmt.Sprintf(`UPDATE %s SET event_id = %s WHERE event_id IS NULL`, t, uuidSQL)); err != nil {
			return fmt.Errorf("backfill %s.event_id: %w", t, err)
		}
	}
	if _, err := tx.ExecContext(ctx, fmt.Sprintf(`CREATE UNIQUE INDEX IF NOT EXISTS %[1]s_event_id ON %[1]s (event_id)`, t)); err != nil {
		return fmt.Errorf("create unique index on %s.event_id: %w", t, err)
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
}

// migrateClaims adds what the relay needs beyond the design record: the
// claim owner, the indexes that keep a claim proportional to the batch, and
// the instance heartbeat table.
func migrateClaims(ctx context.Context, tx *sql.Tx, t string) error {
	cols, err := columns(ctx, tx, t)
	if err != nil {
		return err
	}
	stmts := []string{
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
	}
	if !cols["claimed_by"] {
		stmts = append([]string{fmt.Sprintf(`ALTER TABLE %s ADD COLUMN claimed_by TEXT`, t)}, stmts...)
	}
	for _, s := range stmts {
		if _, err := tx.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		}
	}
	return nil
}

// Required lists what the relay needs of the schema, for Verify.
var (
	requiredColumns = []string{"id", "event_id", "event_type", "payload", "status", "attempts", "available_at", "claimed_at", "created_at", "processed_at", "last_error", "claimed_by"}
	requiredIndexes = []string{"_event_id", "_pending", "_processing", "_dead_lettered"}
	requiredTables  = []string{"processed_events", InstancesTable, ExhaustedTable}
)

// Verify checks the schema without changing it and returns an error naming
// every missing table, column and index.
func (s *Store) Verify(ctx context.Context) error {
	t := s.table
	var missing []string
	cols, err := columns(ctx, s.read, t)
	if err != nil {
		return err
	}
	if len(cols) == 0 {
		missing = append(missing, "table "+t)
	} else {
		for _, c := range requiredColumns {
			if !cols[c] {
				missing = append(missing, "column "+t+"."+c)
			}
		}
	}
	for _, suffix := range requiredIndexes {
		if ok, err := objectExists(ctx, s.read, "index", t+suffix); err != nil {
			return err
		} else if !ok {
			missing = append(missing, "index "+t+suffix)
		}
	}
	for _, name := range requiredTables {
		if ok, err := objectExists(ctx, s.read, "table", name); err != nil {
			return err
		} else if !ok {
			missing = append(missing, "table "+name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w in %s: missing %s (run `outbox-relay migrate` or use schema.mode auto)", ErrSchema, s.path, strings.Join(missing, ", "))
	}
	return nil
}

// Migrate applies the relay's pending migrations. Each runs in its own
// BEGIN IMMEDIATE transaction and is re-checked inside it, so two processes
// migrating the same file at once both succeed and apply each step once.
// Persistent lock contention is retried with a bounded backoff (100 ms
// doubling to 1 s, 5 retries). It returns the versions it applied.
func (s *Store) Migrate(ctx context.Context) ([]int, error) {
	var applied []int
	for _, m := range migrations {
		ok, err := s.migrateOne(ctx, m)
		if err != nil {
			return applied, fmt.Errorf("migration %d (%s): %w", m.version, m.name, err)
		}
		if ok {
			applied = append(applied, m.version)
		}
	}
	return applied, nil
}

func (s *Store) migrateOne(ctx context.Context, m migration) (applied bool, err error) {
	err = retryBusy(ctx, func() error {
		applied, err = s.applyMigration(ctx, m)
		return err
	})
	return applied, err
}

// retryBusy runs fn again while it fails with a lock error that outlasted
// busy_timeout, or one SQLite reports without waiting (switching a new file
// to WAL): 100 ms doubling to 1 s, 5 retries.
func retryBusy(ctx context.Context, fn func() error) error {
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

func (s *Store) applyMigration(ctx context.Context, m migration) (applied bool, err error) {
	tx, err := s.begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		if err != nil {
			tx.Rollback()
		}
	}()
	if _, err = tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+MigrationsTable+` (
	target     TEXT NOT NULL,
	version    INTEGER NOT NULL,
	name       TEXT NOT NULL,
	applied_at INTEGER NOT NULL,
	PRIMARY KEY (target, version)
)`); err != nil {
		return false, err
	}
	var n int
	if err = tx.QueryRowContext(ctx, `SELECT count(*) FROM `+MigrationsTable+` WHERE target = ? AND version = ?`, s.table, m.version).Scan(&n); err != nil {
		return false, err
	}
	if n > 0 {
		return false, tx.Commit()
	}
	if err = m.apply(ctx, tx, s.table); err != nil {
		return false, err
	}
	if _, err = tx.ExecContext(ctx, `INSERT INTO `+MigrationsTable+` (target, version, name, applied_at) VALUES (?, ?, ?, ?)`, s.table, m.version, m.name, nowMs()); err != nil {
		return false, err
	}
	return true, tx.Commit()
}

type querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// columns returns the column names of table t (none if it does not exist).
func columns(ctx context.Context, q querier, t string) (map[string]bool, error) {
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

func objectExists(ctx context.Context, q querier, typ, name string) (bool, error) {
	var n int
	if err := q.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = ? AND name = ?`, typ, name).Scan(&n); err != nil {
		return false, fmt.Errorf("read schema: %w", err)
	}
	return n > 0, nil
}

// AppliedMigrations lists the versions recorded for this store's table.
func (s *Store) AppliedMigrations(ctx context.Context) ([]int, error) {
	if ok, err := objectExists(ctx, s.read, "table", MigrationsTable); err != nil || !ok {
		return nil, err
	}
	rows, err := s.read.QueryContext(ctx, `SELECT version FROM `+MigrationsTable+` WHERE target = ?`, s.table)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var vs []int
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		vs = append(vs, v)
	}
	sort.Ints(vs)
	return vs, rows.Err()
}
