package main

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestGOMAXPROCSFollowsTheBacklog: the relay runs its Go code on one
// thread while no claim finds a backlog, and goes back to the runtime's
// default as soon as one does; every row is published either way.
func TestGOMAXPROCSFollowsTheBacklog(t *testing.T) {
	if runtime.NumCPU() < 2 || os.Getenv("GOMAXPROCS") != "" {
		t.Skip("GOMAXPROCS is 1 already or set in the environment: the relay leaves it")
	}
	dir := t.TempDir()
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	d := startDaemon(t, []string{"NATS_URL=embedded", "OUTBOX_RELAY_NATS_EMBEDDED_STORE_DIR=" + filepath.Join(dir, "nats")},
		"run", "--database-path", path, "--metrics-listen", "")
	const narrow = "no claim found a backlog: GOMAXPROCS 1 until one does"
	const wide = "a claim found a backlog: GOMAXPROCS back to the default"
	if n := d.waitFor(narrow)["gomaxprocs"]; n != float64(1) {
		t.Fatalf("an idle relay's GOMAXPROCS is %v; want 1", n)
	}
	// More rows than a claim takes (relay.batch_size, 1,000).
	testenv.InsertN(t, app, 2500, "Backlogged")
	if n, _ := d.waitFor(wide)["gomaxprocs"].(float64); n < 2 {
		t.Fatalf("a draining relay's GOMAXPROCS is %v; want the default (this machine has %d CPUs)", n, runtime.NumCPU())
	}
	testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 2500 })
	testenv.Eventually(t, 30*time.Second, "GOMAXPROCS 1 after the drain", func() bool { return len(d.Find(narrow)) == 2 })
	d.stop()
}
