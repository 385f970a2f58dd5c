package claim

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Backlog reads the unfinished rows' counts in one short read through the
// partial indexes: its cost follows the backlog, not the table. Its
// OldestPending is when the longest-waiting due row became due (see
// oldestDueSQL); rows scheduled for later do not age the backlog.
func (s *Store) Backlog(ctx context.Context) (event.Backlog, error) {
	var b event.Backlog
	if err := s.sameFile(); err != nil {
		return b, err
	}
	var oldest sql.NullInt64
	err := s.read.QueryRowContext(ctx, fmt.Sprintf(`SELECT
	(SELECT count(*) FROM %[1]s WHERE status = 'pending'),
	(SELECT count(*) FROM %[1]s WHERE status = 'processing'),
	(SELECT count(*) FROM %[1]s WHERE status = 'dead_lettered'),
	(%[2]s)`, s.table, oldestDueSQL(s.table)), s.dueMs()).
		Scan(&b.Pending, &b.Processing, &b.DeadLettered, &oldest)
	if err != nil {
		return event.Backlog{}, fmt.Errorf("read backlog: %w", err)
	}
	if oldest.Valid {
		b.OldestPending = time.UnixMilli(oldest.Int64)
	}
	return b, nil
}

// dueRow is the claim's own test of a row it would take now (?1, Unix
// milliseconds).
var dueRow = `status = 'pending' AND ` + dueSQL("?1")

// oldestDueWindow is how many due rows, in claim order, oldestDueSQL looks
// at, so that a backlog of a million rows costs a fraction of a
// millisecond instead of a scan of every row (a few hundred milliseconds,
// every stats interval). A row further back is missed only when a thousand
// due rows ahead of it became due after it (retried or released rows);
// they wait unclaimed too, so a stuck relay still shows, a little later.
const oldestDueWindow = 1000

// oldestDueSQL is a query for when the longest-waiting due row became due,
// in Unix milliseconds (NULL when nothing is due): the later of created_at
// and available_at, since a row cannot be published before either, among
// the first oldestDueWindow due rows in id order (the order the relay
// claims them in). Where one of the two is no time (or NULL), the other
// counts alone.
func oldestDueSQL(table string) string {
	return fmt.Sprintf(`SELECT min(CASE WHEN c IS NULL THEN a WHEN a IS NULL OR c > a THEN c ELSE a END) FROM (
	SELECT %s AS c, %s AS a FROM %s WHERE %s ORDER BY id LIMIT %d)`,
		msSQL("created_at"), msSQL("available_at"), table, dueRow, oldestDueWindow)
}

// Ping checks that the database answers a read and that its path still
// names the file the store opened.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.sameFile(); err != nil {
		return err
	}
	var n int
	if err := s.read.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master`).Scan(&n); err != nil {
		return fmt.Errorf("database %s: %w", s.path, err)
	}
	return nil
}

// sameFile reports an error when database.path no longer names the file
// the store opened: removed, renamed, or replaced by a restore (wrapping
// event.ErrDatabaseReplaced). The open connections keep reading the old
// file, so the relay would see none of the application's new rows while
// every query still succeeds.
func (s *Store) sameFile() error {
	fi, err := os.Stat(s.path)
	if err != nil {
		return fmt.Errorf("database %s: %w; the relay still has the file it opened, which the application no longer writes (restart the relay once the file is back)", s.path, err)
	}
	if !os.SameFile(fi, s.opened) {
		return fmt.Errorf("database %s: %w after the relay opened it; the relay stops writing to the old file and exits (a supervisor restarts it on the new one)", s.path, event.ErrDatabaseReplaced)
	}
	return nil
}

// Checkpoint copies what it can of the WAL into the database without
// waiting for any lock (PRAGMA wal_checkpoint(PASSIVE)) and returns the
// WAL's size and how much of it is now in the database, in pages. It runs
// on a connection of its own, beside claims and settles. While the -wal
// file has not changed since the last checkpoint (nothing was committed),
// it skips the work and returns the last result, for at most ckptIdleMax:
// the file's times are coarse, and a commit in the same tick as the last
// checkpoint would otherwise wait for the next commit to be noticed.
func (s *Store) Checkpoint(ctx context.Context) (walPages, checkpointed int, err error) {
	s.ckptMu.Lock()
	defer s.ckptMu.Unlock()
	fi, statErr := os.Stat(s.path + "-wal")
	if statErr == nil && fi.Size() == s.ckptWal.size && fi.ModTime().Equal(s.ckptWal.mod) && time.Since(s.ckptWal.at) < ckptIdleMax {
		return s.ckptWal.pages, s.ckptWal.done, nil
	}
	s.ckptWal = walState{}
	if err := s.sameFile(); errors.Is(err, event.ErrDatabaseReplaced) {
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
