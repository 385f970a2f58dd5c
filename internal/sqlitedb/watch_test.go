package sqlitedb_test

import (
	"database/sql"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestWatchIgnoresOtherFilesInItsDirectory: an application keeps other
// SQLite files beside the outbox's (a cache, its users' logins, another relay's
// outbox). Their commits must not reach the commit watch at all, not even
// as notifications it drops, while a commit to its own file still wakes
// it.
func TestWatchIgnoresOtherFilesInItsDirectory(t *testing.T) {
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	other, err := sql.Open("sqlite3", "file:"+filepath.Join(filepath.Dir(s.Path()), "cache.db")+"?_journal_mode=WAL&_busy_timeout=5000")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	testenv.MustExec(t, other, `CREATE TABLE kv (k TEXT PRIMARY KEY, v TEXT)`)
	// A file in rollback-journal mode creates and deletes its -journal on
	// every write.
	legacy, err := sql.Open("sqlite3", "file:"+filepath.Join(filepath.Dir(s.Path()), "logins.db")+"?_journal_mode=DELETE&_busy_timeout=5000")
	if err != nil {
		t.Fatal(err)
	}
	defer legacy.Close()
	testenv.MustExec(t, legacy, `CREATE TABLE s (k TEXT PRIMARY KEY)`)

	wake, stop := startWatch(t, s, db)
	defer stop()
	for i := range 20 {
		testenv.MustExec(t, other, `INSERT OR REPLACE INTO kv VALUES ('k', ?)`, i)
		testenv.MustExec(t, legacy, `INSERT OR REPLACE INTO s VALUES (?)`, i)
	}
	// One inotify queue delivers in order: once the watch has woken for
	// this commit, every notification of the writes above has reached it.
	testenv.InsertRows(t, db, 1, "pending")
	select {
	case <-wake:
	case <-time.After(10 * time.Second):
		t.Fatal("no wake-up after a commit to the watched file")
	}
	own, foreign := sqlitedb.WatchEvents(s)
	if foreign != 0 {
		t.Errorf("the watch received %d notifications for other files in its directory; want none", foreign)
	}
	if own == 0 {
		t.Error("the watch woke for its own file without a notification for it")
	}
}

// TestWalWatchFollowsTheWALFile: the watch is on the -wal file, so writes
// to other files send nothing; when the -wal file is removed it watches
// the directory (dropping other names) until the file is back, and is on
// the new file from then on. A change of mode on the -wal file (a
// notification that announces no commit) marks where the events of the
// writes before it end: one queue delivers them in order.
func TestWalWatchFollowsTheWALFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "app.db")
	wal, other := path+"-wal", filepath.Join(dir, "cache.db-wal")
	write := func(p string) {
		t.Helper()
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteString("frame"); err != nil {
			t.Fatal(err)
		}
	}
	write(wal)
	write(other)
	w := sqlitedb.NewWalWatch(path)
	defer w.Close()
	mode := os.FileMode(0o600)
	// until handles notifications until one satisfies done.
	until := func(what string, done func(ev fsnotify.Event, commit bool) bool) {
		t.Helper()
		for {
			ev, commit, ok := w.Next(10 * time.Second)
			if !ok {
				t.Fatalf("no notification: %s", what)
			}
			if done(ev, commit) {
				return
			}
		}
	}
	barrier := func() {
		t.Helper()
		mode ^= 0o044
		if err := os.Chmod(wal, mode); err != nil {
			t.Fatal(err)
		}
		until("the -wal file's change of mode", func(ev fsnotify.Event, _ bool) bool { return ev.Name == wal && ev.Has(fsnotify.Chmod) })
	}

	write(other)
	barrier()
	if n := w.Foreign(); n != 0 {
		t.Fatalf("%d notifications for another file while watching the -wal file", n)
	}
	write(wal)
	until("a write to the -wal file", func(_ fsnotify.Event, commit bool) bool { return commit })

	if err := os.Remove(wal); err != nil {
		t.Fatal(err)
	}
	until("the removal of the -wal file", func(fsnotify.Event, bool) bool { return !w.Armed() })
	// Watching the directory: another file's write arrives, and is dropped.
	write(other)
	until("a write to another file in the directory", func(_ fsnotify.Event, commit bool) bool {
		if commit {
			t.Fatal("a write to another file was taken for a commit")
		}
		return w.Foreign() > 0
	})
	write(wal)
	until("the -wal file created again", func(_ fsnotify.Event, commit bool) bool { return commit && w.Armed() })

	before := w.Foreign()
	write(other)
	barrier()
	if n := w.Foreign() - before; n != 0 {
		t.Fatalf("%d notifications for another file once the new -wal file is watched", n)
	}
	write(wal)
	until("a write to the new -wal file", func(_ fsnotify.Event, commit bool) bool { return commit })
}
