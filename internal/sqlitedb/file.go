package sqlitedb

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	sqlite3 "github.com/mattn/go-sqlite3"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Ping checks that the database answers a read and that its path still
// names the file it opened.
func (s *DB) Ping(ctx context.Context) error {
	if err := s.SameFile(); err != nil {
		return err
	}
	if err := s.Companions(); err != nil {
		return err
	}
	var n int
	if err := s.read.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master`).Scan(&n); err != nil {
		return fmt.Errorf("database %s: %w", s.path, err)
	}
	return nil
}

// SameFile reports an error when database.path no longer names the file
// the store opened: removed, renamed, or replaced by a restore (wrapping
// event.ErrDatabaseReplaced). The open connections keep reading the old
// file, so the relay would see none of the application's new rows while
// every query still succeeds.
func (s *DB) SameFile() error {
	fi, err := os.Stat(s.path)
	if err != nil {
		return fmt.Errorf("database %s: %w; the relay still has the file it opened, which the application no longer writes (restart the relay once the file is back)", s.path, err)
	}
	if !os.SameFile(fi, s.opened) {
		return fmt.Errorf("database %s: %w after the relay opened it; the relay stops writing to the old file and exits (a supervisor restarts it on the new one)", s.path, event.ErrDatabaseReplaced)
	}
	return nil
}

// companionSuffixes name a database's -wal and -shm files.
var companionSuffixes = [2]string{"-wal", "-shm"}

// Companions reports an error (wrapping event.ErrDatabaseReplaced) when
// the -wal or -shm file the store found at Open was removed or replaced
// since. While the relay's connections are open no SQLite connection
// removes them, so someone did by hand: the application's connections
// then make new ones and no longer share their locks and WAL index with
// the relay's, and the relay's next write could overwrite the
// application's commits. Every write (Begin, Checkpoint) and Ping check
// it; a relay that finds it stops writing and exits.
func (s *DB) Companions() error {
	for i, suffix := range companionSuffixes {
		was := s.companions[i]
		if was == nil {
			continue
		}
		if now, err := os.Stat(s.path + suffix); err != nil || !os.SameFile(now, was) {
			return fmt.Errorf("database %s: its %s file was removed or replaced while the relay had the database open; %w: the relay stops writing to it and exits. "+
				"Never remove a database's -wal or -shm file while a process has it open: its processes no longer share their locks, and commits are lost. "+
				"Stop the application, check the file (PRAGMA integrity_check), then start both", s.path, suffix, event.ErrDatabaseReplaced)
		}
	}
	return nil
}

// written reports the errors of SameFile and Companions that forbid a
// write (event.ErrDatabaseReplaced). A database file gone from its path
// (removed, moved away) takes its -wal and -shm with it: that is not a
// replacement, and the writes to the file the relay has open harm no one.
func (s *DB) written() error {
	if err := s.SameFile(); err != nil {
		if errors.Is(err, event.ErrDatabaseReplaced) {
			return err
		}
		return nil
	}
	return s.Companions()
}

// Checkpoint copies what it can of the WAL into the database without
// waiting for any lock (PRAGMA wal_checkpoint(PASSIVE)) and returns the
// WAL's size and how much of it is now in the database, in pages. It runs
// on a connection of its own, beside claims and settles. While the -wal
// file has not changed since the last checkpoint (nothing was committed),
// it skips the work and returns the last result, for at most ckptIdleMax:
// the file's times are coarse, and a commit in the same tick as the last
// checkpoint would otherwise wait for the next commit to be noticed.
func (s *DB) Checkpoint(ctx context.Context) (walPages, checkpointed int, err error) {
	// A restored file renamed over the database finds the old -wal beside
	// it: a checkpoint, on a connection the pool opens anew, would copy
	// the old file's pages into it.
	if err := s.written(); err != nil {
		return 0, 0, err
	}
	s.ckptMu.Lock()
	defer s.ckptMu.Unlock()
	fi, statErr := os.Stat(s.path + "-wal")
	if statErr == nil && fi.Size() == s.ckptWal.size && fi.ModTime().Equal(s.ckptWal.mod) && time.Since(s.ckptWal.at) < ckptIdleMax {
		return s.ckptWal.pages, s.ckptWal.done, nil
	}
	s.ckptWal = walState{}
	if err := s.written(); err != nil {
		return 0, 0, err // a checkpoint writes too
	}
	var busy int
	if err := s.ckpt.QueryRowContext(ctx, `PRAGMA wal_checkpoint(PASSIVE)`).Scan(&busy, &walPages, &checkpointed); err != nil {
		return 0, 0, fmt.Errorf("checkpoint: %w", err)
	}
	if statErr == nil && walPages == checkpointed {
		// Taken before the checkpoint: a commit during it shows next time.
		s.ckptWal = walState{size: fi.Size(), mod: fi.ModTime(), at: time.Now(), pages: walPages, done: checkpointed}
	}
	return walPages, checkpointed, nil
}

// ckptIdleMax is how long Checkpoint trusts an unchanged -wal file.
const ckptIdleMax = 5 * time.Second

// walState is the -wal file as the last complete checkpoint found it.
type walState struct {
	size        int64
	mod, at     time.Time
	pages, done int
}

// NotWritable marks err with event.ErrNotWritable when SQLite says this
// process may not write the file at path, naming what the relay needs.
func NotWritable(path string, err error) error {
	var se sqlite3.Error
	if !errors.As(err, &se) || (se.Code != sqlite3.ErrReadonly && se.Code != sqlite3.ErrPerm && se.Code != sqlite3.ErrCantOpen) {
		return err
	}
	return fmt.Errorf("%w: %s: %w (the relay runs as uid %d and needs to write the file, its -wal and -shm files and their directory %s)",
		event.ErrNotWritable, path, err, os.Geteuid(), filepath.Dir(path))
}

// Explain says what err, from an operation on the database at path, means
// and what to do, where waiting does not mend it: the file system full
// (SQLITE_FULL), the file damaged (SQLITE_CORRUPT, SQLITE_NOTADB). Any
// other error is returned as it is.
func Explain(path string, err error) error {
	var se sqlite3.Error
	if !errors.As(err, &se) {
		return err
	}
	switch se.Code {
	case sqlite3.ErrFull:
		return fmt.Errorf("%w: the file system holding %s is full: free space in %s; the relay goes on by itself once it can write (rows wait, spending no attempt)", err, path, filepath.Dir(path))
	case sqlite3.ErrCorrupt, sqlite3.ErrNotADB:
		return fmt.Errorf("%w: %s is damaged: stop the application and the relay, check the file (sqlite3 %s 'PRAGMA integrity_check'), and restore it from a backup if it is not ok", err, path, path)
	}
	return err
}

// walFilesMissing explains err, from a read-only open of the file at path,
// when it is SQLite failing to create the -wal and -shm files that reading
// a database in WAL mode needs (a user who may read the file but not write
// its directory), and returns nil otherwise.
func walFilesMissing(path string, err error) error {
	// A read-only connection writes nothing but those files: SQLite's
	// "read-only" errors on one are about them (SQLITE_READONLY_DIRECTORY
	// when it may not create them).
	var se sqlite3.Error
	if !errors.As(err, &se) || se.Code != sqlite3.ErrReadonly {
		return nil
	}
	var missing []string
	for _, suffix := range []string{"-wal", "-shm"} {
		if _, err := os.Stat(path + suffix); errors.Is(err, os.ErrNotExist) {
			missing = append(missing, suffix)
		}
	}
	var which string
	switch len(missing) {
	case 0:
		return nil
	case 1:
		which = "the " + missing[0] + " file does not exist"
	default:
		which = "neither exists"
	}
	dir := filepath.Dir(path)
	return fmt.Errorf("open database %s: %w: the database is in WAL mode, which SQLite can only read with its -wal and -shm files beside it; "+
		"%s (no process has the database open), and uid %d may not create them in %s. "+
		"Run this command while the relay or the application has the database open, or as a user who may write %s "+
		"(a relay that stops leaves both files in place)",
		path, err, which, os.Geteuid(), dir, dir)
}
