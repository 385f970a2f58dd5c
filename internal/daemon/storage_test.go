package daemon_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// appInsert commits a row of eventID as an application in a process of
// its own does (the sqlite3 shell).
func appInsert(path, eventID string) error {
	out, err := exec.Command("sqlite3", path, ".timeout 5000",
		fmt.Sprintf("INSERT INTO event_queue (event_id, event_type, payload) VALUES ('%s', 'After', 'x');", eventID)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%v: %s", err, out)
	}
	return nil
}

// appCount counts the rows of eventID as a new process of the
// application reads the file.
func appCount(path, eventID string) string {
	out, err := exec.Command("sqlite3", path, ".timeout 5000",
		fmt.Sprintf("SELECT count(*) FROM event_queue WHERE event_id = '%s';", eventID)).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("%v: %s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestCompanionFilesRemovedUnderTheRelay: an operator removes the
// database's -shm (or -wal) file while the relay runs, and the
// application, a process of its own, commits a row. The relay's
// connections no longer share locks and WAL index with the application's:
// it stops writing to the file and exits, saying why, and /readyz says so
// meanwhile; the application's row is kept (the relay's next heartbeat
// overwrote it before).
func TestCompanionFilesRemovedUnderTheRelay(t *testing.T) {
	if _, err := exec.LookPath("sqlite3"); err != nil {
		t.Skip("needs the sqlite3 shell as the application's process")
	}
	for _, suffix := range []string{"-shm", "-wal"} {
		t.Run(suffix, func(t *testing.T) {
			path := testenv.NewDB(t)
			n := testenv.StartNATS(t)
			app := testenv.AppDB(t, path)
			h := startRelay(t, path, n.URL(), harnessOptions{})
			testenv.InsertN(t, app, 10, "Before")
			waitAllSettled(t, app, 10, 10*time.Second)
			app.Close() // the application's connections live in a process of their own from now on
			if err := os.Remove(path + suffix); err != nil {
				t.Fatal(err)
			}
			commitErr := appInsert(path, "after-removal")
			testenv.Eventually(t, 10*time.Second, "/readyz naming the removed file", func() bool {
				err := h.app.Ready(context.Background())
				return err != nil && strings.Contains(err.Error(), "its "+suffix+" file was removed or replaced")
			})
			testenv.Eventually(t, 10*time.Second, "the relay to stop writing and exit", func() bool {
				return logCount(h, "relay cannot go on; exiting without writing to the old file") > 0
			})
			err := h.stop()
			if !errors.Is(err, event.ErrDatabaseReplaced) {
				t.Errorf("the relay ended with %v; want it to stop for the removed %s file", err, suffix)
			}
			if commitErr != nil {
				t.Logf("the application's commit failed: %v", commitErr) // refused, not lost
				return
			}
			if c := appCount(path, "after-removal"); c != "1" {
				t.Errorf("the application's committed row, read by a new process of it: count %s, want 1", c)
			}
		})
	}
}

// smallDisk mounts a tmpfs of size bytes on a fresh directory, unmounted
// when the test ends (after everything registered later is closed).
func smallDisk(t *testing.T, size int64) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "disk")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d", size)); err != nil {
		t.Skipf("cannot mount a tmpfs (needs root): %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			syscall.Unmount(dir, syscall.MNT_DETACH)
		}
	})
	return dir
}

// fillDisk writes a file in dir until the file system is full and returns
// a func that removes it.
func fillDisk(t *testing.T, dir string) (free func()) {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			break
		}
	}
	f.Close()
	return func() {
		if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
}

func insertPayloads(t *testing.T, app *sql.DB, n, size int) {
	t.Helper()
	evs := make([]testenv.Event, n)
	for i := range evs {
		evs[i] = testenv.NewEvent("Thing", []byte(strings.Repeat("x", size)))
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
}

// TestDiskFullMidSettle: the disk holding the database fills up between
// the publishes of 300 rows and their settle. The relay says so, naming
// the file and what to do (free space); nothing is lost or published
// twice, and it goes on by itself once space is freed.
func TestDiskFullMidSettle(t *testing.T) {
	dir := smallDisk(t, 4<<20)
	path := testenv.NewDBIn(t, dir)
	n := testenv.StartNATS(t)
	app := testenv.AppDB(t, path)
	gate := make(chan struct{})
	h := newStalledRelay(t, path, n.URL(), harnessOptions{}, gate)
	testenv.Eventually(t, 10*time.Second, "the relay leading and ready", func() bool { return h.relay.Leads() && h.app.Ready(context.Background()) == nil })
	insertPayloads(t, app, 300, 1000)
	testenv.Eventually(t, 10*time.Second, "300 rows in flight", func() bool { return h.relay.InFlight() >= 300 })
	free := fillDisk(t, dir)
	close(gate) // the acks come: the settle finds the disk full
	var ready error
	testenv.Eventually(t, 10*time.Second, "/readyz to report the full disk", func() bool {
		ready = h.app.Ready(context.Background())
		return ready != nil
	})
	var lines []string
	for _, e := range h.logs.FilterLevelExact(zapcore.WarnLevel).All() {
		lines = append(lines, fmt.Sprint(e.Message, " ", e.ContextMap()))
	}
	for _, e := range h.logs.FilterLevelExact(zapcore.ErrorLevel).All() {
		lines = append(lines, fmt.Sprint(e.Message, " ", e.ContextMap()))
	}
	logged := strings.Join(lines, "\n")
	free()
	waitAllSettled(t, app, 300, 20*time.Second)
	assertOncePerEvent(t, n, app, 300)
	nothingSpent(t, app, "for a full disk")
	// What the operator reads: which file, what is wrong, what to do.
	for _, where := range []struct{ name, text string }{{"/readyz", ready.Error()}, {"the log", logged}} {
		if !strings.Contains(where.text, path) || !strings.Contains(strings.ToLower(where.text), "space") {
			t.Errorf("%s while the disk was full does not name the file %s and what to do (free space):\n%s", where.name, path, where.text)
		}
	}
}

// TestCorruptFileIsNamedAsSuch: the database file is cut short behind
// SQLite's back (a damaged disk, a bad copy) while rows wait to come due.
// /readyz and the log name the file as damaged and say what to do (check
// it, restore it from a backup).
func TestCorruptFileIsNamedAsSuch(t *testing.T) {
	path := testenv.NewDB(t)
	n := testenv.StartNATS(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{})
	due := time.Now().Add(3 * time.Second).UnixMilli()
	tx, err := app.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2000; i++ {
		if _, err := tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES (?, 'Later', ?, ?)`,
			fmt.Sprintf("later-%d", i), strings.Repeat("x", 1000), due); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the rows checkpointed into the file", func() bool {
		fi, err := os.Stat(path)
		return err == nil && fi.Size() > 1<<20
	})
	fi, _ := os.Stat(path)
	if err := os.Truncate(path, fi.Size()/2); err != nil {
		t.Fatal(err)
	}
	var ready error
	testenv.Eventually(t, 20*time.Second, "/readyz to report the damaged file", func() bool {
		ready = h.app.Ready(context.Background())
		return ready != nil
	})
	var lines []string
	for _, e := range h.logs.All() {
		if e.Level >= zapcore.WarnLevel {
			lines = append(lines, fmt.Sprint(e.Level, " ", e.Message, " ", e.ContextMap()))
		}
	}
	logged := strings.Join(lines, "\n")
	for _, where := range []struct{ name, text string }{{"/readyz", ready.Error()}, {"the log", logged}} {
		if !strings.Contains(where.text, path) || !strings.Contains(strings.ToLower(where.text), "restore") {
			t.Errorf("%s for a corrupt file does not name the file %s and what to do (integrity_check, restore from a backup):\n%s", where.name, path, where.text)
		}
	}
}
