package sqlitedb

import (
	"database/sql"
	"net/url"
	"strings"

	sqlite3 "github.com/mattn/go-sqlite3"
)

// writerDriver is go-sqlite3 with the automatic checkpoint turned off on
// every connection it opens (for Options.OwnCheckpoints).
const writerDriver = "sqlite3-outbox-relay-writer"

func init() {
	sql.Register(writerDriver, &sqlite3.SQLiteDriver{ConnectHook: func(c *sqlite3.SQLiteConn) error {
		_, err := c.Exec("PRAGMA wal_autocheckpoint = 0", nil)
		return err
	}})
}

// Every connection keeps its prepared statements: preparing the claim
// costs more than running it on a small batch.
const stmtCache = "32"

// dsn builds a go-sqlite3 URI filename; only the file: form passes SQLite
// URI parameters such as mode=ro through.
func dsn(path string, params url.Values) string {
	esc := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	return "file:" + esc + "?" + params.Encode()
}
