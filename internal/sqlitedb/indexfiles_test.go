package sqlitedb

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"testing"
)

// TestIndexFilesAreClosedWithTheirLastUser: the DBs of one file and its
// commit marks read through one -shm descriptor, closed when the last DB
// of the file closes, and kept by a DB that keeps its writers.
func TestIndexFilesAreClosedWithTheirLastUser(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "app.db")
	a, err := Open(ctx, Options{Path: path, Table: "t", Create: true})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(ctx, Options{Path: path, Table: "t", ReadOnly: true, OneConnection: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := a.CommitMark(); !ok {
		t.Fatal("no commit mark")
	}
	if _, ok := b.CommitMark(); !ok {
		t.Fatal("no commit mark")
	}
	shm := a.index().f
	if b.index().f != shm {
		t.Fatal("two DBs of one file read its -shm file through two descriptors")
	}
	if got := usersOf(path); got != 2 {
		t.Fatalf("%d users counted, want 2", got)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadCommitMark(path); !ok {
		t.Fatal("no commit mark")
	}
	if got := usersOf(path); got != 1 {
		t.Fatalf("%d users counted after a Close and a commit mark, want 1", got)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if got := usersOf(path); got != 0 {
		t.Fatalf("%d users counted after the last Close", got)
	}
	if _, err := shm.Stat(); err == nil {
		t.Fatal("the -shm descriptor is still open after the last Close")
	}
	if _, ok := a.CommitMark(); ok {
		t.Error("a commit mark read after Close")
	}

	// A DB whose file was replaced keeps its writers, and the descriptor;
	// a read-only one closes.
	c, err := Open(ctx, Options{Path: path, Table: "t"})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := c.CommitMark(); !ok {
		t.Fatal("no commit mark")
	}
	d, err := Open(ctx, Options{Path: path, Table: "t", ReadOnly: true, OneConnection: true})
	if err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(t.TempDir(), "other.db")
	db, err := sql.Open("sqlite3", "file:"+other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE t (v)`); err != nil {
		t.Fatal(err)
	}
	db.Close()
	if err := os.Rename(other, path); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if got := usersOf(path); got != 1 {
		t.Fatalf("%d users counted after the Close of a read-only DB of a replaced file, want 1", got)
	}
	c.Close()
	if got := usersOf(path); got != 1 {
		t.Fatalf("%d users counted after the Close of a DB that keeps its writers, want 1", got)
	}
}

// usersOf returns the users counted of the -shm file of the database at
// path.
func usersOf(path string) int {
	indexFiles.mu.Lock()
	defer indexFiles.mu.Unlock()
	if x := indexFiles.m[path]; x != nil {
		return x.users
	}
	return 0
}
