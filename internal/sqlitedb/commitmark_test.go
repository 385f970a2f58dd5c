package sqlitedb_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestCommitMarkChangesWithEveryCommit: a file's commit mark stays as it
// is while its rows are only read (a read-only look opened and closed, as
// a fleet's look at a closed file) and changes with every commit, a
// checkpoint's restart of the WAL included; a file in rollback-journal
// mode has none.
func TestCommitMarkChangesWithEveryCommit(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	testenv.InsertRows(t, db, 1, "pending")
	mark := func() sqlitedb.CommitMark {
		t.Helper()
		m, ok := sqlitedb.ReadCommitMark(s.Path())
		if !ok {
			t.Fatal("no commit mark for a database in WAL mode")
		}
		return m
	}
	before := mark()
	look, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: s.Path(), Table: "event_queue", BusyTimeout: time.Second, ReadOnly: true, OneConnection: true})
	if err != nil {
		t.Fatal(err)
	}
	var n int
	if err := look.Reader().QueryRow(`SELECT count(*) FROM event_queue`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("read %d rows (%v)", n, err)
	}
	look.Close()
	if mark() != before {
		t.Fatal("a read-only look changed the commit mark")
	}
	for i := range 20 {
		testenv.InsertRows(t, db, 1, "pending")
		now := mark()
		if now == before {
			t.Fatalf("commit %d left the commit mark as it was", i)
		}
		before = now
	}
	testenv.MustExec(t, db, `PRAGMA wal_checkpoint(TRUNCATE)`)
	before = mark()
	testenv.InsertRows(t, db, 1, "pending")
	if mark() == before {
		t.Fatal("the first commit to a restarted WAL left the commit mark as it was")
	}

	path := filepath.Join(t.TempDir(), "rollback.db")
	rb, err := sql.Open("sqlite3", "file:"+path+"?_journal_mode=DELETE")
	if err != nil {
		t.Fatal(err)
	}
	defer rb.Close()
	testenv.MustExec(t, rb, `CREATE TABLE t (x)`)
	if _, ok := sqlitedb.ReadCommitMark(path); ok {
		t.Fatal("a commit mark for a database in rollback-journal mode")
	}
}
