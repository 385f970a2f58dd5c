package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestReadOnlyDatabaseStopsStartup: a database this process may not write
// (the file, or the directory its -wal and -shm go in) is a configuration
// error: exit 1 naming the file and what the relay needs, not a
// "retrying" log and a ready relay forever.
func TestReadOnlyDatabaseStopsStartup(t *testing.T) {
	n := testenv.StartNATS(t)
	src := testenv.NewDB(t)
	// The whole database in the one file that is copied.
	if _, err := testenv.AppDB(t, src).Exec(`PRAGMA wal_checkpoint(TRUNCATE)`); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	bin := buildBinary(t)
	for _, c := range []struct {
		name        string
		writableDir bool
	}{{"read-only directory", false}, {"read-only file", true}} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "app.db")
			if err := os.WriteFile(path, data, 0o444); err != nil {
				t.Fatal(err)
			}
			// verify writes nothing: the first write is the relay's own.
			cmd := exec.Command(bin, "run", "--database-path", path, "--metrics-listen", "", "--nats-url", n.URL(), "--schema-mode", "verify")
			if os.Geteuid() == 0 {
				// root writes any file: run as nobody, who may read the
				// file but not write it.
				for _, p := range []string{dir, filepath.Dir(dir), filepath.Dir(bin)} {
					if err := os.Chmod(p, 0o755); err != nil {
						t.Fatal(err)
					}
				}
				if c.writableDir {
					if err := os.Chown(dir, 65534, 65534); err != nil {
						t.Fatal(err)
					}
				}
				cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
			} else if !c.writableDir {
				if err := os.Chmod(dir, 0o555); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { os.Chmod(dir, 0o755) })
			}
			d := startProcess(t, cmd)
			if code, out := d.exitWithin(60*time.Second), d.log(); code != 1 || !strings.Contains(out, path) || !strings.Contains(out, "not writable") {
				t.Fatalf("exit %d; want 1 naming the file and the permission", code)
			}
		})
	}
}

// TestSIGHUPStopsCleanly: a hang-up (a terminal closed, a supervisor's
// reload) stops the relay as SIGTERM does: exit 0, its heartbeat row gone.
func TestSIGHUPStopsCleanly(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	d := startDaemon(t, []string{"NATS_URL=" + n.URL()}, "run", "--database-path", path, "--metrics-listen", "")
	d.waitFor("relay starting")
	testenv.Eventually(t, 20*time.Second, "the relay's heartbeat row", func() bool {
		var rows int
		app.QueryRow(`SELECT count(*) FROM outbox_relay_instances`).Scan(&rows)
		return rows == 1
	})
	if err := d.Stop(syscall.SIGHUP, time.Minute); err != nil {
		t.Fatalf("exit after SIGHUP: %v", err)
	}
	var rows int
	if err := app.QueryRow(`SELECT count(*) FROM outbox_relay_instances`).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("%d heartbeat rows left after SIGHUP (%v)", rows, err)
	}
}
