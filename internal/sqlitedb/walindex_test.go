package sqlitedb

import (
	"database/sql"
	"os"
	"path/filepath"
	"testing"
)

// TestWalIndexHeaderChangesWithCommitsOnly: the commit watch's look, the
// WAL index header, stays as it is while the file is read and changes
// with every commit, settled (its two copies equal) once the commit shows.
func TestWalIndexHeaderChangesWithCommitsOnly(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db, err := sql.Open("sqlite3", "file:"+path+"?_journal_mode=WAL")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.Exec(`CREATE TABLE t (v TEXT)`); err != nil {
		t.Fatal(err)
	}
	idx := indexAt(t, path)
	if idx == nil {
		t.Fatal("no -shm file to read beside a database in WAL mode")
	}
	look := func() [walIndexHeaders / 2]byte {
		t.Helper()
		h, settled, err := idx.header()
		if err != nil || !settled {
			t.Fatalf("header: settled %v, %v", settled, err)
		}
		return h
	}
	before := look()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM t`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if look() != before {
		t.Fatal("a read changed the WAL index header")
	}
	for i := range 10 {
		if _, err := db.Exec(`INSERT INTO t VALUES ('x')`); err != nil {
			t.Fatal(err)
		}
		now := look()
		if now == before {
			t.Fatalf("commit %d left the WAL index header as it was", i)
		}
		before = now
	}
}

// TestWalIndexHeaderBeingWritten: a header whose two copies differ is
// one a commit is writing: not settled, as SQLite's readers take it.
func TestWalIndexHeaderBeingWritten(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	shm := make([]byte, 32768)
	for i := range walIndexHeaders / 2 {
		shm[i], shm[i+walIndexHeaders/2] = byte(i), byte(i)
	}
	if err := os.WriteFile(path+"-shm", shm, 0o644); err != nil {
		t.Fatal(err)
	}
	idx := indexAt(t, path)
	if h, settled, err := idx.header(); err != nil || !settled || h[7] != 7 {
		t.Fatalf("two equal copies: %v settled %v, %v", h, settled, err)
	}
	shm[walIndexHeaders/2+16]++ // one copy written, the other not yet
	if err := os.WriteFile(path+"-shm", shm, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, settled, err := idx.header(); err != nil || settled {
		t.Fatalf("two copies that differ: settled %v, %v", settled, err)
	}
	if indexAt(t, filepath.Join(t.TempDir(), "none.db")) != nil {
		t.Error("a -shm file that is not there was opened")
	}
}

// indexAt finds the -shm file of the database at path as a DB does, kept
// open until the test ends; nil when there is none.
func indexAt(t *testing.T, path string) *walIndex {
	t.Helper()
	t.Cleanup(useIndex(path))
	return indexFileOf(path)
}
