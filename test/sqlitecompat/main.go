// Command sqlitecompat runs the application's minimal outbox insert through
// an old SQLite (3.30.1, bundled by go-sqlite3 v1.13.0), to prove that the
// schema the relay creates works for applications linking an older SQLite
// than the relay's. It is its own module so that the old driver never
// reaches the relay's build. It prints the SQLite version and the inserted
// row's defaults as JSON.
package main

import (
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	_ "github.com/mattn/go-sqlite3"
)

func main() {
	db := flag.String("db", "", "a database migrated by outbox-relay")
	flag.Parse()
	if err := run(*db); err != nil {
		fmt.Fprintln(os.Stderr, "sqlitecompat:", err)
		os.Exit(1)
	}
}

func run(path string) error {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		return err
	}
	defer db.Close()
	var out struct {
		Version     string `json:"sqlite_version"`
		Integrity   string `json:"integrity"`
		ID          int64  `json:"id"`
		Status      string `json:"status"`
		Attempts    int64  `json:"attempts"`
		AvailableAt int64  `json:"available_at"`
		CreatedAt   int64  `json:"created_at"`
	}
	if err := db.QueryRow(`SELECT sqlite_version()`).Scan(&out.Version); err != nil {
		return err
	}
	if err := db.QueryRow(`PRAGMA integrity_check`).Scan(&out.Integrity); err != nil {
		return err
	}
	res, err := db.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, ?, ?)`,
		"0b7e0b1c-1d2e-4f30-8a4b-5c6d7e8f9a0b", "CompatChecked", []byte(`{"old":"sqlite"}`))
	if err != nil {
		return fmt.Errorf("minimal insert: %w", err)
	}
	out.ID, _ = res.LastInsertId()
	if err := db.QueryRow(`SELECT status, attempts, available_at, created_at FROM event_queue WHERE id = ?`, out.ID).
		Scan(&out.Status, &out.Attempts, &out.AvailableAt, &out.CreatedAt); err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}
