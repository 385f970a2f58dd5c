package sqlitedb

import (
	"os"
	"path/filepath"
	"sync/atomic"

	"github.com/fsnotify/fsnotify"
)

// walWatch is the file notification behind Watch. It watches the -wal file
// itself, not its directory: a watch on the directory is sent every write
// to every file in it, and an application's other SQLite files (a cache,
// its users' logins, another relay's outbox) would wake every relay beside them on
// each of their commits (each relay's heartbeat waking all the others).
// While the -wal file is missing (removed, renamed, or not yet created) it
// watches the directory until the file is back, dropping every other name
// at once. Given the notifications of another watch (Options.Notifications,
// which names the -wal file whatever file it is), it only reads them.
type walWatch struct {
	w        *fsnotify.Watcher
	followed <-chan fsnotify.Event // from Options.Notifications; w is nil then
	unfollow func()
	wal      string      // the -wal file's path, as events name it
	dir      string      // its directory
	on       os.FileInfo // the -wal file being watched; nil: the directory is
	dirs     bool        // the directory is being watched
	seen     *watchCounts
}

// watchCounts counts the notifications a commit watch received, for the
// database's own -wal file and for other files in its directory.
type watchCounts struct{ own, foreign atomic.Int64 }

// newWalWatch starts watching the -wal file of the database at path (an
// absolute path), or following it with follow when that is set; it
// returns nil where notifications are unavailable.
func newWalWatch(path string, seen *watchCounts, follow func(wal string) (<-chan fsnotify.Event, func())) *walWatch {
	if follow != nil {
		ww := &walWatch{wal: path + "-wal", seen: seen}
		ww.followed, ww.unfollow = follow(ww.wal)
		return ww
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil
	}
	ww := &walWatch{w: w, wal: path + "-wal", dir: filepath.Dir(path), seen: seen}
	ww.arm() // the caller looks at the database once after this
	if ww.on == nil && !ww.dirs {
		w.Close()
		return nil
	}
	return ww
}

// events returns the notifications (nil when there are none).
func (ww *walWatch) events() <-chan fsnotify.Event {
	switch {
	case ww == nil:
		return nil
	case ww.w == nil:
		return ww.followed
	}
	return ww.w.Events
}

// errs returns the watcher's errors (nil when there are none).
func (ww *walWatch) errs() <-chan error {
	if ww == nil || ww.w == nil {
		return nil
	}
	return ww.w.Errors
}

// armed reports whether the -wal file itself is watched (a followed one
// always is).
func (ww *walWatch) armed() bool { return ww == nil || ww.w == nil || ww.on != nil }

// close stops the notifications.
func (ww *walWatch) close() {
	switch {
	case ww == nil:
	case ww.w == nil:
		ww.unfollow()
	default:
		ww.w.Close()
	}
}

// arm points the watch at the file the -wal path names now: the file
// itself when it exists, else the directory, until it is created. It
// reports whether it moved onto a new -wal file, whose writes before the
// move no notification announces.
func (ww *walWatch) arm() (moved bool) {
	if ww.w == nil {
		return false // followed by name, whatever file it is
	}
	fi, err := os.Stat(ww.wal)
	if err == nil && ww.on != nil && os.SameFile(fi, ww.on) {
		return false
	}
	if ww.on != nil {
		ww.w.Remove(ww.wal) // already gone with a removed file
		ww.on = nil
	}
	if err == nil && ww.w.Add(ww.wal) == nil {
		// Taken after the watch was added: should the file have been
		// replaced in between, the next look at it sees the difference.
		if ww.on, err = os.Stat(ww.wal); err == nil {
			if ww.dirs && ww.w.Remove(ww.dir) == nil {
				ww.dirs = false
			}
			return true
		}
		ww.on = nil
		ww.w.Remove(ww.wal)
	}
	if !ww.dirs && ww.w.Add(ww.dir) == nil {
		ww.dirs = true
	}
	return false
}

// commit reports whether ev may announce a commit: a write to the -wal
// file, its creation, or a move of the watch onto a new -wal file. An
// event for another file is dropped before any other work; one that
// removes, renames or replaces the -wal file points the watch at what the
// path names now.
func (ww *walWatch) commit(ev fsnotify.Event) bool {
	if ev.Name != ww.wal {
		ww.seen.foreign.Add(1)
		return false
	}
	ww.seen.own.Add(1)
	moved := false
	if ev.Has(fsnotify.Create) || ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename) || ev.Has(fsnotify.Chmod) {
		// A removal of a file still open shows as a change of its link
		// count (Chmod), not as a Remove.
		moved = ww.arm()
	}
	return moved || ev.Has(fsnotify.Write) || ev.Has(fsnotify.Create)
}
