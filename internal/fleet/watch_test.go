package fleet

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
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
// database Routes follows goes to its follower, named by its absolute
// path even where the pattern is relative, and neither it nor a write to
// the database itself is sent on Written; another database's write is.
// All tells every follower to look; Close closes their channels.
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
	followed, stop := routes.Follow(wal)
	defer stop()
	write := func(name string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("a.db-wal")
	write("a.db")
	write("b.db-wal")
	select {
	case ev := <-followed:
		if ev.Name != wal {
			t.Errorf("the follower was sent %q, want %q", ev.Name, wal)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the follower was sent nothing")
	}
	select {
	case db := <-w.Written:
		if db != "b.db" {
			t.Errorf("Written %q, want b.db only, named as the pattern names files: a followed file's writes go to its follower", db)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nothing on Written for the file no one follows")
	}
	for len(followed) > 0 {
		<-followed
	}
	routes.All()
	if len(followed) != 1 {
		t.Error("All sent the follower nothing")
	}
	routes.Close()
	<-followed
	if _, open := <-followed; open {
		t.Error("Close left the follower's channel open")
	}
	if later, _ := routes.Follow(filepath.Join(dir, "c.db-wal")); later != nil {
		if _, open := <-later; open {
			t.Error("a follower after Close was given an open channel")
		}
	}
}
