package fleet

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
)

// TestWatcherSeesItsDirectoryRemoved: a directory removed and made again
// is a replacement even when the new one has the old one's inode number
// (ext4 often gives it): the watch on the old one sends nothing more.
func TestWatcherSeesItsDirectoryRemoved(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tenants")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	pattern := filepath.Join(dir, "*.db")
	w := Watch(context.Background(), pattern, nil)
	if w == nil {
		t.Fatal("no notifications")
	}
	defer w.Close()
	if w.Replaced(pattern) {
		t.Fatal("replaced before anything happened")
	}
	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// As if the new directory had the old one's inode number.
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	w.dir = fi
	select {
	case <-w.Changed:
	case <-time.After(10 * time.Second):
		t.Fatal("no change sent for the directory's removal")
	}
	if !w.Replaced(pattern) {
		t.Error("a directory removed and made again is not a replacement")
	}
}

// TestRoutesHandAFollowedFilesWrites: a write to the -wal file of a
// database Routes follows goes to its follower as a Write naming the path
// it followed, even after a change of the file's mode that no commit
// makes (which must not take the follower's one slot), and even where the
// pattern is relative; neither it nor a write to the database itself is
// sent on Written, nor to the follower; another database's write is sent
// on Written, named as the pattern's matches are. All tells every
// follower to look; a later follower of the same file takes its
// notifications, closing the earlier one's channel; Close closes the
// channels, and a follower after it gets a closed one.
func TestRoutesHandAFollowedFilesWrites(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	routes := NewRoutes()
	w := Watch(context.Background(), "*.db", routes)
	if w == nil {
		t.Fatal("no notifications")
	}
	defer w.Close()
	wal := filepath.Join(dir, "a.db-wal")
	write := func(name string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Written says when the watch has come past the followed file's
	// events (a file created is sent for its creation and its write).
	written := func(want string, also ...string) {
		t.Helper()
		for {
			select {
			case db := <-w.Written:
				if db == want {
					return
				}
				if !slices.Contains(also, db) {
					t.Fatalf("Written %q, want %q: a followed file's writes go to its follower", db, want)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("nothing on Written for %s, which no one follows", want)
			}
		}
	}
	write("a.db-wal") // before anyone follows: on Written
	write("b.db-wal")
	written("b.db", "a.db")
	followed, stop := routes.Follow(wal)
	defer stop()
	if err := os.Chmod(wal, 0o640); err != nil {
		t.Fatal(err)
	}
	write("b.db-wal")
	written("b.db")
	if len(followed) != 0 {
		t.Fatalf("the follower was sent %v for a change of mode", <-followed)
	}
	write("a.db-wal")
	write("a.db")
	write("b.db-wal")
	written("b.db")
	if ev := <-followed; ev.Name != wal || ev.Op != fsnotify.Write {
		t.Errorf("the follower was sent %v, want a Write of %s", ev, wal)
	}
	write("a.db")
	write("b.db-wal")
	written("b.db")
	if len(followed) != 0 {
		t.Errorf("the follower was sent %v for a write to the database", <-followed)
	}
	routes.All()
	if len(followed) != 1 {
		t.Error("All sent the follower nothing")
	}
	later, stopLater := routes.Follow(wal)
	defer stopLater()
	<-followed
	if _, open := <-followed; open {
		t.Error("a later follower of the file left the earlier one's channel open")
	}
	routes.Close()
	if _, open := <-later; open {
		t.Error("Close left the follower's channel open")
	}
	if after, _ := routes.Follow(filepath.Join(dir, "c.db-wal")); after != nil {
		if _, open := <-after; open {
			t.Error("a follower after Close was given an open channel")
		}
	}
}

// TestOnlyDatabaseFilesChangeTheSet: a database file created, renamed or
// removed is sent on Changed; its -wal and -journal files, which SQLite
// creates and removes as connections come and go, are not (a creation of
// a -wal is a commit's, sent on Written). Each step ends with a write to
// a database of its own, sent on Written after every notification before
// it (a write sends more than one, so a step's is told from an earlier
// step's by its name).
func TestOnlyDatabaseFilesChangeTheSet(t *testing.T) {
	dir := t.TempDir()
	path := func(name string) string { return filepath.Join(dir, name) }
	const steps = 7
	for i := range steps {
		if err := os.WriteFile(path(fmt.Sprintf("z%d.db", i)), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	w := Watch(context.Background(), filepath.Join(dir, "*.db"), nil)
	if w == nil {
		t.Fatal("no notifications")
	}
	defer w.Close()
	n := 0
	step := func(what string, changes bool, do func() error) {
		t.Helper()
		if err := do(); err != nil {
			t.Fatal(err)
		}
		end := path(fmt.Sprintf("z%d.db", n))
		n++
		if err := os.WriteFile(end, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		for done := false; !done; {
			select {
			case db := <-w.Written:
				done = db == end
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: the write to %s was not sent on Written", what, end)
			}
		}
		select {
		case <-w.Changed:
			if !changes {
				t.Errorf("%s: sent on Changed", what)
			}
		default:
			if changes {
				t.Errorf("%s: not sent on Changed", what)
			}
		}
	}
	write := func(name string) func() error {
		return func() error { return os.WriteFile(path(name), []byte("x"), 0o600) }
	}
	remove := func(name string) func() error { return func() error { return os.Remove(path(name)) } }
	step("a.db created", true, write("a.db"))
	step("a.db-wal created", false, write("a.db-wal"))
	step("a.db-wal removed", false, remove("a.db-wal"))
	step("a.db-journal created", false, write("a.db-journal"))
	step("a.db-journal removed", false, remove("a.db-journal"))
	step("a.db renamed", true, func() error { return os.Rename(path("a.db"), path("b.db")) })
	step("b.db removed", true, remove("b.db"))
}
