// Package sqlitedb owns the relay's handle on the application's SQLite
// file: opening it (a single-connection writer whose transactions start
// with BEGIN IMMEDIATE, a read-only pool, a checkpointer), waiting for the
// application's write lock and for a file held locked against readers,
// noticing that the path names another file, WAL checkpoints and commit
// wake-ups. What the relay reads and writes lives in the packages that use
// it: schema, claim, admin, housekeeping.
package sqlitedb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	sqlite3 "github.com/mattn/go-sqlite3"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// ErrNoDatabase is returned by Open when the database file does not exist
// and Options.Create is false.
var ErrNoDatabase = errors.New("database file does not exist")

// DB is the relay's handle on the shared SQLite file: a single-connection
// write pool whose transactions start with BEGIN IMMEDIATE, a read-only
// pool that never writes, and a connection of its own for checkpoints.
type DB struct {
	write  *sql.DB
	read   *sql.DB
	ckpt   *sql.DB
	table  string
	path   string
	opened os.FileInfo // the file at path when it was opened
	// companions are its -wal and -shm files when it was opened for
	// writing (nil: none then, or read-only); see Companions.
	companions [2]os.FileInfo
	// index returns its -shm file, found by the first commit watch or
	// commit mark (see walIndex), once the connections made it; nil:
	// there was none. The file stays open while any DB of the path is
	// (indexFiles): Close calls unused once the connections are closed.
	index  func() *walIndex
	unused func()
	busy   time.Duration // how long a write waits for the lock
	clock  *event.Clock

	gatherWrites  bool                                             // Options.GatherCommitWrites
	notifications func(wal string) (<-chan fsnotify.Event, func()) // Options.Notifications

	ckptMu  sync.Mutex
	ckptWal walState // the -wal file after the last complete checkpoint

	watchSeen watchCounts
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
	if err := s.written(); err != nil {
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

// Close closes the pools, the writer last: the connection that closes the
// database last copies the WAL into it, which a read-only one cannot do,
// and (keepWAL) leaves the -wal file empty. A file replaced since it was
// opened (a restore renamed over it) keeps its read-write connections to
// the process's exit: closing the last of them would checkpoint the old
// file and rewrite the -wal that now lies beside the new one.
//
// Close ends the count of the DB as a user of the -shm file (see
// indexFiles), unless it keeps its writers, once its connections are
// closed: it expects no query of the DB to be running.
func (s *DB) Close() error {
	if s.read == s.write { // Options.OneConnection: read-only
		defer s.unused()
		return s.write.Close()
	}
	if s.written() != nil {
		return s.read.Close() // the writers keep their locks on the -shm file too
	}
	defer s.unused() // once SQLite holds no lock on the -shm file (see walIndex)
	return errors.Join(s.read.Close(), s.ckpt.Close(), s.write.Close())
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
