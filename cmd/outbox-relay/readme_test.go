package main

import (
	"database/sql"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// readmeBlock returns the body of the README's first fenced block of the
// language that holds want.
func readmeBlock(t *testing.T, lang, want string) string {
	t.Helper()
	parts := strings.Split(readRepoFile(t, "README.md"), "```")
	for i := 1; i < len(parts); i += 2 {
		if body, ok := strings.CutPrefix(parts[i], lang+"\n"); ok && strings.Contains(body, want) {
			return body
		}
	}
	t.Fatalf("the README has no %s block with %q", lang, want)
	return ""
}

// TestReadmeSQLRunsAsShown: the README's commands for the sqlite3 shell,
// run as they stand in a new directory (this build of outbox-relay for
// "go run ./cmd/outbox-relay"), commit the review and its event together;
// run again, the event's id is refused and nothing more commits: -bail
// stops the shell before COMMIT. Without a sqlite3 shell on the machine,
// the SQL is run through the driver instead.
func TestReadmeSQLRunsAsShown(t *testing.T) {
	block := readmeBlock(t, "sh", "sqlite3 -bail app.db")
	dir := t.TempDir()
	app := filepath.Join(dir, "app.db")
	runBlock := func() {
		t.Helper()
		if _, err := exec.LookPath("sqlite3"); err != nil {
			t.Logf("no sqlite3 shell (%v): running the SQL through the driver", err)
			if code, _, errOut := runCLI(t, "migrate", "--database-path", app); code != 0 {
				t.Fatalf("migrate: %s", errOut)
			}
			_, body, _ := strings.Cut(block, "<<'SQL'\n")
			body, _, _ = strings.Cut(body, "\nSQL\n")
			db, err := sql.Open("sqlite3", "file:"+app)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			conn, _ := db.Conn(t.Context())
			defer conn.Close()
			if _, err := conn.ExecContext(t.Context(), body); err != nil {
				conn.ExecContext(t.Context(), `ROLLBACK`) // what -bail leaves to the shell's exit
			}
			return
		}
		script := strings.ReplaceAll(block, "go run ./cmd/outbox-relay", buildBinary(t))
		cmd := exec.Command("sh", "-c", script)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		t.Logf("the README's commands: %v\n%s", err, out)
	}
	count := func(table string) int {
		t.Helper()
		var n int
		if err := testenv.AppDB(t, app).QueryRow(`SELECT count(*) FROM ` + table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	runBlock()
	if _, err := os.Stat(app); err != nil {
		t.Fatal(err)
	}
	if r, e := count("reviews"), count("event_queue WHERE status = 'pending'"); r != 1 || e != 1 {
		t.Fatalf("after the README's commands: %d review(s), %d pending event(s); want 1 and 1", r, e)
	}
	runBlock() // the same event id again: refused, and the review with it
	if r, e := count("reviews"), count("event_queue"); r != 1 || e != 1 {
		t.Fatalf("run twice: %d review(s), %d event(s); want the second transaction rolled back whole", r, e)
	}
}
