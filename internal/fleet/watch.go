package fleet

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"

	"github.com/fsnotify/fsnotify"
)

// Watcher follows the directory of a fleet's pattern with one file-system
// notification for every file in it: a write to a database or its -wal
// file (a commit) is sent on Written, the database's path; a file
// created, removed or renamed is sent on Changed. Neither blocks: a
// reader that is behind misses sends (Changed coalesces; a missed Written
// is said on Missed).
type Watcher struct {
	w       *fsnotify.Watcher
	stop    context.CancelFunc
	base    string      // the pattern's file name
	path    string      // the directory watched, as named to the watch
	dir     os.FileInfo // and as it was then
	gone    atomic.Bool // it was removed or moved away
	Written chan string
	Changed chan struct{}
	// Missed says notifications were lost (the kernel's queue overflowed,
	// or Written was full): a reader looks at every file again.
	Missed chan struct{}
}

// Watch starts watching pattern's directory until ctx ends or Close; it
// returns nil where notifications are unavailable (the caller then looks
// periodically).
func Watch(ctx context.Context, pattern string) *Watcher {
	dir := filepath.Dir(pattern)
	fi, err := os.Stat(dir)
	if err != nil {
		return nil
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil
	}
	if err := w.Add(dir); err != nil {
		w.Close()
		return nil
	}
	ctx, stop := context.WithCancel(ctx)
	fw := &Watcher{w: w, stop: stop, base: filepath.Base(pattern), path: dir, dir: fi,
		Written: make(chan string, 1024), Changed: make(chan struct{}, 1), Missed: make(chan struct{}, 1)}
	go fw.run(ctx)
	return fw
}

// Replaced reports whether the directory's path names another directory
// now than the one watched (it was removed or moved away, and another is
// in its place, with the same inode number or not): nothing in the new one
// is notified; watch it instead.
func (fw *Watcher) Replaced(pattern string) bool {
	fi, err := os.Stat(filepath.Dir(pattern))
	return err == nil && (fw.gone.Load() || !os.SameFile(fi, fw.dir))
}

// Close stops the watch.
func (fw *Watcher) Close() { fw.stop() }

func (fw *Watcher) run(ctx context.Context) {
	defer fw.w.Close()
	for {
		select {
		case <-ctx.Done():
			return
		case <-fw.w.Errors:
			// An overflow: changes may have been missed; look again.
			fw.changed()
			fw.missed()
		case ev, ok := <-fw.w.Events:
			if !ok {
				return
			}
			fw.event(ev)
		}
	}
}

func (fw *Watcher) event(ev fsnotify.Event) {
	if ev.Name == fw.path && (ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename)) {
		fw.gone.Store(true)
		fw.changed()
		return
	}
	db := strings.TrimSuffix(strings.TrimSuffix(ev.Name, "-wal"), "-journal")
	if ok, _ := filepath.Match(fw.base, filepath.Base(db)); !ok || sidecar(db) {
		return
	}
	if ev.Has(fsnotify.Create) || ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename) {
		fw.changed()
	}
	if ev.Has(fsnotify.Write) || ev.Has(fsnotify.Create) {
		select {
		case fw.Written <- db:
		default:
			fw.missed()
		}
	}
}

func (fw *Watcher) missed() {
	select {
	case fw.Missed <- struct{}{}:
	default:
	}
}

func (fw *Watcher) changed() {
	select {
	case fw.Changed <- struct{}{}:
	default:
	}
}
