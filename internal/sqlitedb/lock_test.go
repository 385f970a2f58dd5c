package sqlitedb_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// holdLock opens the database at path the way an application would, runs
// setup on one connection and returns a release that closes it.
func holdLock(t *testing.T, path string, setup ...string) (release func()) {
	t.Helper()
	app, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := app.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range setup {
		if _, err := conn.ExecContext(context.Background(), q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var once bool
	release = func() {
		if !once {
			once = true
			conn.Close()
			app.Close()
		}
	}
	t.Cleanup(release)
	return release
}

// exclusive is what an application in exclusive locking mode runs: in WAL
// mode the lock is taken at the first access and held until the
// connection closes.
var exclusive = []string{`PRAGMA locking_mode = EXCLUSIVE`, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('held', 'T', x'00')`}

// openAsync runs Open in a goroutine.
func openAsync(opts sqlitedb.Options) <-chan error {
	done := make(chan error, 1)
	go func() {
		s, err := sqlitedb.Open(context.Background(), opts)
		if err == nil {
			_, err = sqlitedb.ObjectExists(context.Background(), s.Reader(), "table", "event_queue")
			s.Close()
		}
		done <- err
	}()
	return done
}

// TestOpenWaitsForAnExclusiveLock: an application holding the file in
// locking_mode=EXCLUSIVE keeps every other connection out until it closes
// it. Open (for run, and read-only for status, dead-letters and audit)
// says what holds the file and waits, and opens once the application lets
// go.
func TestOpenWaitsForAnExclusiveLock(t *testing.T) {
	for _, readOnly := range []bool{false, true} {
		t.Run(fmt.Sprintf("read-only=%v", readOnly), func(t *testing.T) {
			path := testenv.NewDB(t)
			release := holdLock(t, path, exclusive...)
			core, logs := observer.New(zapcore.InfoLevel)
			done := openAsync(sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: time.Second,
				ReadOnly: readOnly, LockWait: -1, Log: zap.New(core)})
			testenv.Eventually(t, 10*time.Second, "a log line saying what Open waits for", func() bool {
				return logs.FilterMessageSnippet("waiting").Len() > 0
			})
			line := logs.FilterMessageSnippet("waiting").All()[0]
			lock := fmt.Sprint(line.ContextMap()["lock"])
			if line.ContextMap()["path"] != path || !strings.Contains(lock, fmt.Sprintf("this process (pid %d)", os.Getpid())) ||
				!strings.Contains(lock, "locking_mode=EXCLUSIVE") {
				t.Errorf("log line %q %v: want the path, the holder and its locking mode", line.Message, line.ContextMap())
			}
			select {
			case err := <-done:
				t.Fatalf("Open returned while the application held the lock: %v", err)
			default:
			}
			release()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("Open after the application let go: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("Open still waiting after the application let go")
			}
			if logs.FilterMessage("database lock released").Len() != 1 {
				t.Errorf("no line saying the lock was released: %v", logs.All())
			}
		})
	}
}

// TestOpenGivesUpNamingTheHolder: with a bounded wait, Open fails with an
// error that names the holder and its locking mode, not a bare "database
// is locked".
func TestOpenGivesUpNamingTheHolder(t *testing.T) {
	path := testenv.NewDB(t)
	holdLock(t, path, exclusive...)
	err := <-openAsync(sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 200 * time.Millisecond})
	if !errors.Is(err, event.ErrBusy) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "this process") ||
		!strings.Contains(err.Error(), "locking_mode=EXCLUSIVE") {
		t.Fatalf("Open of a file held exclusively = %v; want event.ErrBusy naming the path, the holder and its locking mode", err)
	}
}

// TestOpenSwitchesARollbackJournalFileToWAL: a file in rollback-journal
// mode whose application is writing keeps readers out while it does. Open
// waits, naming the mode, then switches the file to WAL and says so, with
// the mode it found.
func TestOpenSwitchesARollbackJournalFileToWAL(t *testing.T) {
	path := testenv.NewDB(t)
	db, err := sql.Open("sqlite3", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, db, `PRAGMA journal_mode = DELETE`)
	db.Close()
	release := holdLock(t, path, `BEGIN EXCLUSIVE`, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('held', 'T', x'00')`)
	core, logs := observer.New(zapcore.InfoLevel)
	done := openAsync(sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: time.Second, LockWait: -1, Log: zap.New(core)})
	testenv.Eventually(t, 10*time.Second, "a log line saying what Open waits for", func() bool {
		return logs.FilterMessageSnippet("waiting").Len() > 0
	})
	if lock := fmt.Sprint(logs.FilterMessageSnippet("waiting").All()[0].ContextMap()["lock"]); !strings.Contains(lock, "rollback-journal mode") {
		t.Errorf("lock %q: want the rollback-journal mode named", lock)
	}
	release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	switched := logs.FilterMessage("switched the database to WAL journal mode").All()
	if len(switched) != 1 || switched[0].ContextMap()["path"] != path || switched[0].ContextMap()["found"] != "delete" {
		t.Fatalf("switch log lines %v; want one with the path and the mode found", switched)
	}
	// A file already in WAL mode is not switched again.
	core, logs = observer.New(zapcore.InfoLevel)
	s, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", Log: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if logs.Len() != 0 {
		t.Errorf("log lines opening a file in WAL mode: %v", logs.All())
	}
}
