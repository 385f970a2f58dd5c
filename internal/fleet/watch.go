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
// path; a database file created, removed or renamed is sent on Changed
// (not its -wal or -journal file, which SQLite creates and removes as
// connections come and go: each would have the pattern matched again
// for nothing, a stat of every file, as a fleet's idle files wake). Neither
// blocks: a reader that is behind misses sends (Changed coalesces; a
// missed Written is said on Missed).
type Watcher struct {
	w       *fsnotify.Watcher
	stop    context.CancelFunc
	base    string      // the pattern's file name
	path    string      // the directory watched, as named to the watch (and in Written)
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
	fi, err := os.Stat(dir)
	if err != nil || !fi.IsDir() {
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
	fw := &Watcher{w: w, stop: stop, base: filepath.Base(pattern), path: dir, dir: fi, routes: routes,
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
	return err == nil && fi.IsDir() && (fw.gone.Load() || !os.SameFile(fi, fw.dir))
}

// Close stops the watch, and gives its notification instance back at once
// (a watch of the directory's replacement may need it).
func (fw *Watcher) Close() {
	fw.stop()
	fw.w.Close()
}

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
	if name == base && (ev.Has(fsnotify.Create) || ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename)) {
		fw.changed()
	}
	if fw.routes.send(ev.Op, name, base) {
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
// was read twice (by the fleet's watch and by the file's), and with more
// files open than the kernel allows notification instances
// (fs.inotify.max_user_instances, 128 by default) the files past the limit
// had none and looked periodically. A Routes outlives the Watchers it is
// given to (a directory replaced is watched anew). Files are told apart
// by name: a fleet's files are in one directory. A nil *Routes follows
// nothing.
type Routes struct {
	mu     sync.Mutex
	to     map[string]follower // by the -wal file's name
	closed bool
}

// follower is one commit watch following its -wal file.
type follower struct {
	wal string // the path it asked for, which its notifications name
	ch  chan fsnotify.Event
}

// NewRoutes returns Routes that follow nothing yet.
func NewRoutes() *Routes { return &Routes{to: make(map[string]follower)} }

// Follow returns the notifications of the -wal file at wal, and a func that
// stops them. Each notification is a Write: a write to the file or its
// creation, which may announce a commit. The channel holds one: a write
// while one is pending is announced by it, since its reader looks at the
// file after taking it. The channel is closed once the notifications stop
// for good (Close), or go to a later follower of the same file.
func (r *Routes) Follow(wal string) (<-chan fsnotify.Event, func()) {
	f := follower{wal: wal, ch: make(chan fsnotify.Event, 1)}
	name := filepath.Base(wal)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		close(f.ch)
		return f.ch, func() {}
	}
	if old, ok := r.to[name]; ok {
		close(old.ch)
	}
	r.to[name] = f
	return f.ch, func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.to[name].ch == f.ch {
			delete(r.to, name)
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
	for name, f := range r.to {
		close(f.ch)
		delete(r.to, name)
	}
}

// Open undoes Close: the followers from now on have notifications again
// (the directory is watched again). Those Close closed look periodically
// until they stop.
func (r *Routes) Open() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = false
}

// All tells every follower that notifications may have been missed: each
// looks at its file again, as after a write.
func (r *Routes) All() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, f := range r.to {
		f.offer()
	}
}

// send hands a notification op of the file name, the database db or one of
// its files, to the database's follower when it may announce a commit (a
// write to the -wal file, or its creation), and reports whether the
// database is followed: then the notifications of its other files (a
// checkpoint's writes to the database) and the others of its -wal file
// (its removal, a change of its mode) concern no one, since a follower is
// told of commits by writes to the file the name names.
func (r *Routes) send(op fsnotify.Op, name, db string) bool {
	if r == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	f, ok := r.to[db+"-wal"]
	if ok && name == db+"-wal" && (op.Has(fsnotify.Write) || op.Has(fsnotify.Create)) {
		f.offer()
	}
	return ok
}

// offer sends a Write on f's channel unless one is pending there already.
func (f follower) offer() {
	select {
	case f.ch <- fsnotify.Event{Name: f.wal, Op: fsnotify.Write}:
	default:
	}
}
