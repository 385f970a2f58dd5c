package sqlitedb

import (
	"database/sql"
	"fmt"
	"net/url"
	"strings"

	sqlite3 "github.com/mattn/go-sqlite3"
)

// Drivers: go-sqlite3 with what the relay's read-write connections set on
// opening (keepWAL), and for Options.OwnCheckpoints also the automatic
// checkpoint turned off.
const (
	rwDriver     = "sqlite3-outbox-relay"
	writerDriver = "sqlite3-outbox-relay-writer"
)

func init() {
	sql.Register(rwDriver, &sqlite3.SQLiteDriver{ConnectHook: keepWAL})
	sql.Register(writerDriver, &sqlite3.SQLiteDriver{ConnectHook: func(c *sqlite3.SQLiteConn) error {
		if err := keepWAL(c); err != nil {
			return err
		}
		_, err := c.Exec("PRAGMA wal_autocheckpoint = 0", nil)
		return err
	}})
}

// walSizeLimit is the journal_size_limit of the relay's connections: a
// WAL that grew past it (behind a long read of the application's) is cut
// back to it when it starts over, and, with keepWAL, to nothing when the
// relay closes the database last.
const walSizeLimit = 64 << 20

// keepWAL makes a connection that closes the database last leave the -wal
// (emptied) and -shm files in place instead of removing them: without
// them a user who may read the file but not write its directory cannot
// open a database in WAL mode (status, dead-letters list, audit), since
// SQLite must create them first. An empty WAL beside a restored file
// changes nothing in it.
func keepWAL(c *sqlite3.SQLiteConn) error {
	if _, err := c.Exec(fmt.Sprintf("PRAGMA journal_size_limit = %d", walSizeLimit), nil); err != nil {
		return err
	}
	return c.SetFileControlInt("main", sqlite3.SQLITE_FCNTL_PERSIST_WAL, 1)
}

// Every connection keeps its prepared statements: preparing the claim
// costs more than running it on a small batch.
const stmtCache = "32"

// readerCache is the page cache, in KiB, of the read-only pool's and the
// checkpointer's connections, against SQLite's default of 2,000, which the
// writer keeps. A read-only connection's cache is dropped at its first
// read after another connection's commit (SQLite does so whenever the WAL
// changed), and its long reads (the backlog's counts, the reconciliation's
// look-ups, a retention pass) go through many pages once each, which the
// kernel's page cache holds anyway: with the default, each of the up to
// five connections kept 2 MiB of them, about 5 to 8 MiB of a relay's 36
// MiB of memory draining a 1,000,000-row backlog, with no drain or
// reconciliation faster for it. The writer's settles come back to the
// pages of the rows they settle: with 512 KiB for it too, a drain of 64
// KiB rows with retention.done_rows: delete took a quarter to a third
// more of the relay's CPU.
const readerCache = "-512"

// dsn builds a go-sqlite3 URI filename; only the file: form passes SQLite
// URI parameters such as mode=ro through.
func dsn(path string, params url.Values) string {
	esc := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	return "file:" + esc + "?" + params.Encode()
}
