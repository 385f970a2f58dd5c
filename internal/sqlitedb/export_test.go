package sqlitedb

import (
	"time"

	"github.com/fsnotify/fsnotify"
)

// NewPace and Found expose the commit watch's pacing to its tests.
func NewPace(fast time.Duration) *pace { return &pace{fast: fast} }

func (p *pace) Found(notified, polled bool) (time.Duration, bool) { return p.found(notified, polled) }

// Gather exposes how long the commit watch gathers notifications.
func Gather(sinceFound time.Duration, commitOwn bool) time.Duration {
	return gather(sinceFound, commitOwn)
}

// RecheckAfter exposes the waits between the looks after a notification
// that found no commit.
func RecheckAfter(pending time.Duration, recheck bool) (time.Duration, bool) {
	return recheckAfter(pending, recheck)
}

// CheckpointedAt is when s last completed a checkpoint that found the WAL
// all copied.
func CheckpointedAt(s *DB) time.Time {
	s.ckptMu.Lock()
	defer s.ckptMu.Unlock()
	return s.ckptWal.at
}

// WatchEvents counts the file notifications Watch received: for the
// database's own -wal file, and for other files.
func WatchEvents(s *DB) (own, foreign int64) {
	return s.watchSeen.own.Load(), s.watchSeen.foreign.Load()
}

// WalWatch exposes the commit watch's file notifications to its tests.
type WalWatch struct {
	w    *walWatch
	seen watchCounts
}

// NewWalWatch watches the -wal file of the database at path.
func NewWalWatch(path string) *WalWatch {
	ww := &WalWatch{}
	ww.w = newWalWatch(path, &ww.seen, nil)
	return ww
}

// Next handles the next notification, as Watch does, and returns it and
// whether it may announce a commit; ok is false after timeout.
func (ww *WalWatch) Next(timeout time.Duration) (ev fsnotify.Event, commit, ok bool) {
	select {
	case ev := <-ww.w.events():
		return ev, ww.w.commit(ev), true
	case <-time.After(timeout):
		return fsnotify.Event{}, false, false
	}
}

// Armed reports whether the -wal file itself is watched.
func (ww *WalWatch) Armed() bool { return ww.w.on != nil }

// Foreign counts the notifications for other files.
func (ww *WalWatch) Foreign() int64 { return ww.seen.foreign.Load() }

// Close stops the watch.
func (ww *WalWatch) Close() { ww.w.close() }
