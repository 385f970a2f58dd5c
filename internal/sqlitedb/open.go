package sqlitedb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Options say which file and table to use.
type Options struct {
	Path        string
	Table       string        // a plain SQL identifier, validated by config
	BusyTimeout time.Duration // how long a write waits for the application's lock
	Create      bool          // create the file when it is missing
	ReadOnly    bool          // never write (status, listings): writes fail
	// OneConnection, with ReadOnly, serves every query on the one
	// connection that opening the file reads it with, for short looks
	// that run one query at a time (the fleet's at a closed file): one
	// connection to open, and the schema parsed once, instead of two.
	OneConnection bool
	// OwnCheckpoints turns off SQLite's automatic checkpoint on the relay's
	// writer, so that copying the WAL into the database is not paid inside
	// claim and settle commits; the owner calls Checkpoint instead, often.
	// The application's connections keep their own automatic checkpoints.
	OwnCheckpoints bool
	// LockWait is how long Open waits while another connection keeps the
	// file locked against readers (one in PRAGMA locking_mode=EXCLUSIVE, or
	// one writing to a file in rollback-journal mode): zero waits
	// BusyTimeout (at least minLockWait), a negative value until ctx ends.
	LockWait time.Duration
	// Log is told what Open waits for and who holds it, and when it switches
	// a file to WAL mode; nil: nothing is logged.
	Log *zap.Logger
	// Locked, when set, is told what holds the file when Open has waited
	// long enough to say so in the log, and nil once the file is free.
	Locked func(error)
	// GatherCommitWrites makes the commit watch wait commitWrites after
	// the notification of a lone commit for the rest of the commit's WAL
	// writes, so that it looks once: for a file served among others (a
	// fleet's), whose work keeps the process busy meanwhile. Alone, the
	// relay looks at once: the wait would let the process go idle, and the
	// wake-up after it costs more than the looks it spares (see gather).
	GatherCommitWrites bool
	// Notifications, when set, gives the commit watch the notifications
	// of the -wal file at the absolute path it is called with (and a func
	// that stops them) in place of a notification of its own: a fleet's
	// files share the fleet's (see fleet.Routes). Each names that path and
	// may announce a commit; a closed channel says no more will come (the
	// watch then polls).
	Notifications func(wal string) (<-chan fsnotify.Event, func())
	// Clock decides which rows are due (a new event.Clock over time.Now
	// when nil); share it with the relay, which times retries by it.
	Clock *event.Clock
}

// minLockWait is the shortest wait of a bounded Open: long enough for the
// locks that last milliseconds (another connection's recovery or last
// close, a write in rollback-journal mode).
const minLockWait = time.Second

// Open opens the database at opts.Path. It does not touch the schema. It
// names the file by its absolute path, in its errors too.
func Open(ctx context.Context, opts Options) (*DB, error) {
	path := absPath(opts.Path)
	return open(ctx, path, opts, useIndex(path)) // counted from before its first connection
}

// open opens the database at path for Open; unused ends its count as a
// user of the -shm file (useIndex) once its connections are closed: at
// Close, or here if it fails.
func open(ctx context.Context, path string, opts Options, unused func()) (*DB, error) {
	before, err := statDatabase(path, opts.Create)
	if err != nil {
		unused()
		return nil, err
	}
	log := opts.Log
	if log == nil {
		log = zap.NewNop()
	}
	write, err := openWriter(path, opts)
	if err != nil {
		unused()
		return nil, fmt.Errorf("open database %s: %w", path, err)
	}
	lockWait := opts.LockWait
	if lockWait == 0 {
		lockWait = max(opts.BusyTimeout, minLockWait)
	}
	// The writer's first reads prove the file is a database and switch it
	// to WAL; its busy_timeout is 0, so a lock shows at once.
	var found string
	if err := waitUnlocked(ctx, path, lockWait, log, opts.Locked, func() (err error) {
		if !opts.ReadOnly {
			if found, err = toWAL(ctx, write); err != nil {
				return err
			}
		}
		_, err = ObjectExists(ctx, write, "table", opts.Table)
		return err
	}); err != nil {
		write.Close()
		unused()
		return nil, openError(path, opts.ReadOnly, err)
	}
	if found != "wal" && found != "" && before != nil {
		log.Info("switched the database to WAL journal mode", zap.String("path", path), zap.String("found", found))
	}
	s := &DB{busy: opts.BusyTimeout, write: write, index: sync.OnceValue(func() *walIndex { return indexFileOf(path) }), unused: unused, table: opts.Table, path: path, gatherWrites: opts.GatherCommitWrites, notifications: opts.Notifications}
	if s.clock = opts.Clock; s.clock == nil {
		s.clock = event.NewClock(nil)
	}
	if opts.ReadOnly && opts.OneConnection {
		// Its reads wait for locks as the readers' do: Open's wait is over.
		s.read, s.ckpt = write, write
		_, err = write.ExecContext(ctx, fmt.Sprintf("PRAGMA busy_timeout = %d", s.busy.Milliseconds()))
	} else {
		err = s.openReaders(opts.ReadOnly)
	}
	if err != nil {
		write.Close()
		unused()
		return nil, fmt.Errorf("open database %s: %w", path, err)
	}
	if s.opened, err = os.Stat(path); err == nil && before != nil && !os.SameFile(before, s.opened) {
		err = errors.New("the file was replaced while it was being opened; try again")
	}
	if !opts.ReadOnly {
		for i, suffix := range companionSuffixes {
			s.companions[i], _ = os.Stat(path + suffix)
		}
	}
	if err != nil {
		s.Close() // and unused, unless it keeps the writers (see Close)
		return nil, fmt.Errorf("open database %s: %w", path, err)
	}
	return s, nil
}

// openWriter opens the write pool: one connection, so that in-process
// writers queue in Go instead of sleeping in SQLite's busy handler. It
// waits for other processes itself (Begin), in finer steps than SQLite's
// busy handler (1, 2, 5, 10 ms ...): its busy_timeout is 0.
func openWriter(path string, opts Options) (*sql.DB, error) {
	mode := "rw"
	if opts.Create {
		mode = "rwc"
	}
	// No _journal_mode: Open switches the file to WAL itself (toWAL), to
	// say so; the mode then stays in the file.
	params := url.Values{
		"mode":             {mode},
		"_busy_timeout":    {"0"},
		"_synchronous":     {"NORMAL"},
		"_txlock":          {"immediate"},
		"_stmt_cache_size": {stmtCache},
	}
	driver := rwDriver
	if opts.OwnCheckpoints {
		driver = writerDriver
	}
	if opts.ReadOnly {
		params, driver = url.Values{"mode": {"ro"}, "_busy_timeout": {"0"}, "_stmt_cache_size": {stmtCache}}, "sqlite3"
	}
	write, err := sql.Open(driver, dsn(path, params))
	if err != nil {
		return nil, err
	}
	write.SetMaxOpenConns(1)
	write.SetConnMaxIdleTime(0)
	write.SetConnMaxLifetime(0)
	return write, nil
}

// toWAL puts the database in WAL mode and returns the journal mode it
// found ("wal" when there was nothing to do). SQLite reports a file in
// rollback-journal mode as the connection's own mode, "delete".
func toWAL(ctx context.Context, write *sql.DB) (found string, err error) {
	if err := write.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&found); err != nil || found == "wal" {
		return found, err
	}
	var now string
	if err := write.QueryRowContext(ctx, `PRAGMA journal_mode = WAL`).Scan(&now); err != nil {
		return found, err
	}
	if now != "wal" {
		return found, fmt.Errorf("switch journal mode from %s to WAL: SQLite kept %s", found, now)
	}
	return found, nil
}

// openReaders opens the read-only pool and the checkpointer's connection
// (a PASSIVE checkpoint waits for no lock).
func (s *DB) openReaders(readOnly bool) error {
	busy := fmt.Sprint(s.busy.Milliseconds())
	read, err := sql.Open("sqlite3", dsn(s.path, url.Values{"mode": {"ro"}, "_busy_timeout": {busy}, "_stmt_cache_size": {stmtCache}, "_cache_size": {readerCache}}))
	if err != nil {
		return err
	}
	read.SetMaxOpenConns(4)
	driver, mode := rwDriver, "rw"
	if readOnly {
		driver, mode = "sqlite3", "ro"
	}
	ckpt, err := sql.Open(driver, dsn(s.path, url.Values{"mode": {mode}, "_busy_timeout": {busy}, "_cache_size": {readerCache}}))
	if err != nil {
		read.Close()
		return err
	}
	ckpt.SetMaxOpenConns(1)
	s.read, s.ckpt = read, ckpt
	return nil
}

// absPath is path made absolute, for errors that name the file wherever
// the relay was started (a systemd unit's working directory is /), and
// for notifications, which name files by the path they were asked for.
func absPath(path string) string {
	if abs, err := filepath.Abs(path); err == nil {
		return abs
	}
	return filepath.Clean(path)
}

// statDatabase returns the file at path, or nil when it is missing and
// create allows it; a missing directory is named as such, since SQLite
// would only say it cannot open the file.
func statDatabase(path string, create bool) (os.FileInfo, error) {
	fi, err := os.Stat(path)
	if err == nil {
		return fi, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("open database %s: %w", path, err)
	}
	dir := filepath.Dir(path)
	di, err := os.Stat(dir)
	switch {
	case err == nil && !di.IsDir():
		return nil, fmt.Errorf("open database %s: %s is not a directory (check database.path)", path, dir)
	case err != nil && !create:
		return nil, fmt.Errorf("open database %s: %w, nor does its directory %s (the application creates it; check database.path)", path, ErrNoDatabase, dir)
	case err != nil:
		return nil, fmt.Errorf("open database %s: directory %s does not exist (create it, or check database.path)", path, dir)
	case !create:
		return nil, fmt.Errorf("open database %s: %w (the application creates it; check database.path)", path, ErrNoDatabase)
	}
	return nil, nil
}

// openError says why the first reads of the file failed.
func openError(path string, readOnly bool, err error) error {
	if readOnly {
		if why := walFilesMissing(path, err); why != nil {
			return why
		}
	} else if why := NotWritable(path, err); errors.Is(why, event.ErrNotWritable) {
		return why
	}
	return fmt.Errorf("open database %s: %w", path, err)
}
