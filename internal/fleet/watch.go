package fleet

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/fsnotify/fsnotify"
)

// Watcher follows the directory of a fleet's pattern with one file-system
// notification for every file in it: a write to the -wal file of a
// database that Routes follows goes to its follower; a write to another
// database or its -wal file (a commit) is sent on Written, the database's
// path; a file created, removed or renamed is sent on Changed. Neither
// blocks: a reader that is behind misses sends (Changed coalesces; a
// missed Written is said on Missed).
type Watcher struct {
	w       *fsnotify.Watcher
	stop    context.CancelFunc
	base    string      // the pattern's file name
	path    string      // the directory watched, as named to the watch (and in Written)
	abs     string      // and absolute (as Routes names files)
	dir     os.FileInfo // and as it was then
	gone    atomic.Bool // it was removed or moved away
	routes  *Routes
	Written chan string
	Changed chan struct{}
	// Missed says notifications were lost (the kernel's queue overflowed,
	// or Written was full): a reader looks at every file again.
	Missed chan struct{}
}

// Watch starts watching pattern's directory until ctx ends or Close,
// handing the notifications of the files routes follows to their
// followers; it returns nil where notifications are unavailable (the
// caller then looks periodically).
func Watch(ctx context.Context, pattern string, routes *Routes) *Watcher {
	dir := filepath.Dir(pattern)
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil
	}
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
	fw := &Watcher{w: w, stop: stop, base: filepath.Base(pattern), path: dir, abs: abs, dir: fi, routes: routes,
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
			fw.routes.All()
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
	// Named as the pattern's matches are (fleet.Files): the watch names
	// the files of a pattern "*.db" "./a.db", where its match is "a.db".
	name := filepath.Base(ev.Name)
	base := strings.TrimSuffix(strings.TrimSuffix(name, "-wal"), "-journal")
	db := filepath.Join(fw.path, base)
	if ok, _ := filepath.Match(fw.base, base); !ok || sidecar(db) {
		return
	}
	if ev.Has(fsnotify.Create) || ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename) {
		fw.changed()
	}
	if fw.routes.send(ev.Op, fw.abs, name, base) {
		return
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

// Routes hands the notifications of open databases' -wal files from a
// fleet's Watcher to their commit watches, so that the fleet has one
// notification for all its files: with one per open file, every commit
// was read twice (by the fleet's watch and by the file's), and a fleet
// with more files open than the kernel allows notification instances
// (fs.inotify.max_user_instances, 128 by default) left the rest to look
// periodically. A Routes outlives the Watchers it is given to (a
// directory replaced is watched anew). The zero value is not usable; a nil
// *Routes follows nothing.
type Routes struct {
	mu     sync.Mutex
	to     map[string]chan fsnotify.Event // by the -wal file's absolute path
	closed bool
}

// NewRoutes returns Routes that follow nothing yet.
func NewRoutes() *Routes { return &Routes{to: make(map[string]chan fsnotify.Event)} }

// Follow returns the notifications of the file at wal (a -wal file's
// absolute path), and a func that stops them. The channel holds one
// notification: a write while one is pending is announced by it, since
// its reader looks at the file after taking it. The channel is closed once
// the notifications stop for good (Close).
func (r *Routes) Follow(wal string) (<-chan fsnotify.Event, func()) {
	ch := make(chan fsnotify.Event, 1)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		close(ch)
		return ch, func() {}
	}
	r.to[wal] = ch
	return ch, func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.to[wal] == ch {
			delete(r.to, wal)
		}
	}
}

// Close closes every follower's channel, now and to come: no notification
// will come (the directory's replacement has none), and each follower looks
// periodically.
func (r *Routes) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	r.closed = true
	for wal, ch := range r.to {
		close(ch)
		delete(r.to, wal)
	}
}

// All tells every follower that notifications may have been missed: each
// looks at its file again.
func (r *Routes) All() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for wal, ch := range r.to {
		offer(ch, fsnotify.Event{Name: wal, Op: fsnotify.Write})
	}
}

// send hands a notification op of the file name in the directory dir (an
// absolute path), the database db or one of its files, to the database's
// follower when name is its -wal file, and reports whether the database
// is followed: then a write to another of its files (a checkpoint's to
// the database) concerns no one, since its follower is told of commits by
// the -wal file.
func (r *Routes) send(op fsnotify.Op, dir, name, db string) bool {
	if r == nil {
		return false
	}
	wal := filepath.Join(dir, db+"-wal")
	r.mu.Lock()
	defer r.mu.Unlock()
	ch, ok := r.to[wal]
	if ok && name == db+"-wal" {
		offer(ch, fsnotify.Event{Name: wal, Op: op})
	}
	return ok
}

// offer sends ev on ch unless a notification is pending there already.
func offer(ch chan fsnotify.Event, ev fsnotify.Event) {
	select {
	case ch <- ev:
	default:
	}
}
