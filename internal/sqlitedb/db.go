// Package sqlitedb owns the relay's handle on the application's SQLite
// file: opening it (a single-connection writer whose transactions start
// with BEGIN IMMEDIATE, a read-only pool, a checkpointer), waiting for the
// application's write lock, noticing that the path names another file,
// WAL checkpoints and commit wake-ups. What the relay reads and writes
// lives in the packages that use it: schema, claim, admin, housekeeping.
package sqlitedb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	sqlite3 "github.com/mattn/go-sqlite3"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// ErrNoDatabase is returned by Open when the database file does not exist
// and Options.Create is false.
var ErrNoDatabase = errors.New("database file does not exist")

// Options say which file and table to use.
type Options struct {
	Path        string
	Table       string        // a plain SQL identifier, validated by config
	BusyTimeout time.Duration // how long a write waits for the application's lock
	Create      bool          // create the file when it is missing
	ReadOnly    bool          // never write (status, listings): writes fail
	// OwnCheckpoints turns off SQLite's automatic checkpoint on the relay's
	// writer, so that copying the WAL into the database is not paid inside
	// claim and settle commits; the owner calls Checkpoint instead, often.
	// The application's connections keep their own automatic checkpoints.
	OwnCheckpoints bool
	// Clock decides which rows are due (a new event.Clock over time.Now
	// when nil); share it with the relay, which times retries by it.
	Clock *event.Clock
}

// writerDriver is go-sqlite3 with the automatic checkpoint turned off on
// every connection it opens (for Options.OwnCheckpoints).
const writerDriver = "sqlite3-outbox-relay-writer"

func init() {
	sql.Register(writerDriver, &sqlite3.SQLiteDriver{ConnectHook: func(c *sqlite3.SQLiteConn) error {
		_, err := c.Exec("PRAGMA wal_autocheckpoint = 0", nil)
		return err
	}})
}

// DB is the relay's handle on the shared SQLite file: a single-connection
// write pool whose transactions start with BEGIN IMMEDIATE, a read-only
// pool that never writes, and a connection of its own for checkpoints.
type DB struct {
	write  *sql.DB
	read   *sql.DB
	ckpt   *sql.DB
	table  string
	path   string
	opened os.FileInfo   // the file at path when it was opened
	busy   time.Duration // how long a write waits for the lock
	clock  *event.Clock

	ckptMu  sync.Mutex
	ckptWal walState // the -wal file after the last complete checkpoint

	watchSeen watchCounts
}

// Open opens the database at opts.Path. It does not touch the schema.
func Open(ctx context.Context, opts Options) (*DB, error) {
	before, err := os.Stat(opts.Path)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("open database %s: %w", opts.Path, err)
		}
		if !opts.Create {
			return nil, fmt.Errorf("open database %s: %w (the application creates it; check database.path)", opts.Path, ErrNoDatabase)
		}
	}
	busy := opts.BusyTimeout.Milliseconds()
	mode := "rw"
	if opts.Create {
		mode = "rwc"
	}
	// Every connection keeps its prepared statements: preparing the claim
	// costs more than running it on a small batch.
	const stmtCache = "32"
	// The writer waits for the lock itself (Store.begin), in finer steps
	// than SQLite's busy handler (1, 2, 5, 10 ms ...).
	params := url.Values{
		"mode":             {mode},
		"_busy_timeout":    {"0"},
		"_journal_mode":    {"WAL"},
		"_synchronous":     {"NORMAL"},
		"_txlock":          {"immediate"},
		"_stmt_cache_size": {stmtCache},
	}
	if opts.ReadOnly {
		params = url.Values{"mode": {"ro"}, "_busy_timeout": {fmt.Sprint(busy)}, "_stmt_cache_size": {stmtCache}}
	}
	driver := "sqlite3"
	if opts.OwnCheckpoints && !opts.ReadOnly {
		driver = writerDriver
	}
	write, err := sql.Open(driver, dsn(opts.Path, params))
	if err != nil {
		return nil, fmt.Errorf("open database %s: %w", opts.Path, err)
	}
	// One writer connection: in-process writers queue in Go instead of
	// sleeping in SQLite's busy handler; other processes are waited for by
	// busy_timeout.
	write.SetMaxOpenConns(1)
	write.SetConnMaxIdleTime(0)
	write.SetConnMaxLifetime(0)
	if err := RetryBusy(ctx, func() error { return write.PingContext(ctx) }); err != nil {
		write.Close()
		if !opts.ReadOnly {
			if err := NotWritable(opts.Path, err); errors.Is(err, event.ErrNotWritable) {
				return nil, err
			}
		}
		return nil, fmt.Errorf("open database %s: %w", opts.Path, err)
	}
	read, err := sql.Open("sqlite3", dsn(opts.Path, url.Values{
		"mode":             {"ro"},
		"_busy_timeout":    {fmt.Sprint(busy)},
		"_stmt_cache_size": {stmtCache},
	}))
	if err != nil {
		write.Close()
		return nil, fmt.Errorf("open database %s: %w", opts.Path, err)
	}
	read.SetMaxOpenConns(4)
	// The checkpointer's connection: a PASSIVE checkpoint waits for no lock.
	ckptMode := "rw"
	if opts.ReadOnly {
		ckptMode = "ro"
	}
	ckpt, err := sql.Open("sqlite3", dsn(opts.Path, url.Values{"mode": {ckptMode}, "_busy_timeout": {fmt.Sprint(busy)}}))
	if err != nil {
		write.Close()
		read.Close()
		return nil, fmt.Errorf("open database %s: %w", opts.Path, err)
	}
	ckpt.SetMaxOpenConns(1)
	s := &DB{busy: opts.BusyTimeout, write: write, read: read, ckpt: ckpt, table: opts.Table, path: opts.Path}
	if s.clock = opts.Clock; s.clock == nil {
		s.clock = event.NewClock(nil)
	}
	// Reading the schema proves the file is a database.
	if err := RetryBusy(ctx, func() error {
		_, err := ObjectExists(ctx, s.read, "table", opts.Table)
		return err
	}); err != nil {
		s.Close()
		return nil, fmt.Errorf("open database %s: %w", opts.Path, err)
	}
	if s.opened, err = os.Stat(opts.Path); err == nil && before != nil && !os.SameFile(before, s.opened) {
		err = errors.New("the file was replaced while it was being opened; try again")
	}
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("open database %s: %w", opts.Path, err)
	}
	return s, nil
}

// Begin starts a write transaction (BEGIN IMMEDIATE), waiting for the
// application's lock up to busy_timeout. It retries every 100 µs at first,
// doubling to 2 ms: a short wait ends within a fraction of a millisecond,
// where SQLite's own busy handler would sleep whole milliseconds. It does
// not retry faster for longer: SQLite's lock is not fair, and a relay
// polling every 100 µs took it from an application whose busy handler
// sleeps whole milliseconds (see docs/performance.md). It refuses to write
// to a file that path no longer names (event.ErrDatabaseReplaced).
func (s *DB) Begin(ctx context.Context) (*sql.Tx, error) {
	deadline := time.Now().Add(s.busy)
	wait := 100 * time.Microsecond
	// Never write to a file that is no longer the database: a restored
	// file may find this one's -wal beside it.
	if err := s.SameFile(); errors.Is(err, event.ErrDatabaseReplaced) {
		return nil, err
	}
	for {
		tx, err := s.write.BeginTx(ctx, nil)
		if err == nil || !Busy(err) {
			return tx, err
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w: %w", event.ErrBusy, err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Millisecond)
	}
}

// Exec runs one write statement in its own transaction.
func (s *DB) Exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	tx, err := s.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return res, tx.Commit()
}

// dsn builds a go-sqlite3 URI filename; only the file: form passes SQLite
// URI parameters such as mode=ro through.
func dsn(path string, params url.Values) string {
	esc := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	return "file:" + esc + "?" + params.Encode()
}

// InTx runs fn in a write transaction (Begin) and commits it.
func (s *DB) InTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.Begin(ctx)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		tx.Rollback()
		return err
	}
	return tx.Commit()
}

// Reader is the read-only pool: reads that take no lock, beside the
// writer.
func (s *DB) Reader() *sql.DB { return s.read }

// Close closes the pools.
func (s *DB) Close() error {
	return errors.Join(s.write.Close(), s.read.Close(), s.ckpt.Close())
}

// Path returns the database file's path.
func (s *DB) Path() string { return s.path }

// Table returns the outbox table's name.
func (s *DB) Table() string { return s.table }

// Busy reports whether err is SQLite's "database is locked" or "busy":
// another connection held the write lock longer than busy_timeout.
func Busy(err error) bool {
	var se sqlite3.Error
	if errors.As(err, &se) {
		return se.Code == sqlite3.ErrBusy || se.Code == sqlite3.ErrLocked
	}
	return false
}

// NowMs is the wall clock in Unix milliseconds: the time of heartbeats,
// claims and settlements, which relays compare with each other's.
func NowMs() int64 { return time.Now().UnixMilli() }

// DueMs is the time rows are due by (Options.Clock), in Unix milliseconds:
// it does not step back with the wall clock, so a step back hides no due
// row.
func (s *DB) DueMs() int64 { return s.clock.Now().UnixMilli() }
