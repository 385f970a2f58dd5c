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
	w := Watch(context.Background(), pattern)
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
