package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestMoreBusyFilesThanSlotsAreServedInTurn: with more files written
// continuously than may be open at once, each is served in turn: every
// file's rows are published while all are being written (none waits
// for the others to quiet down), each once and in its key's order.
func TestMoreBusyFilesThanSlotsAreServedInTurn(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	names := []string{"acme", "globex", "initech", "umbrella", "hooli"}
	dbs := map[string]*sql.DB{}
	for _, name := range names {
		dbs[name] = tenantFile(t, dir, name, 0)
	}
	h := startFleetWith(t, dir, n.URL(), 500*time.Millisecond, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto },
		func(th *daemon.TestHooks) { th.MaxOpen = 2 })

	stops := map[string]func() int{}
	for _, name := range names {
		stops[name] = writeEvery(t, dbs[name], name, 50*time.Millisecond)
	}
	// Every file has rows published while every file is being written.
	testenv.Eventually(t, 60*time.Second, "5 rows of every file done while all are written", func() bool {
		for _, db := range dbs {
			if testenv.Counts(t, db)["done"] < 5 {
				return false
			}
		}
		return true
	})
	body := h.waitReadyz(t, "waiting their turn")
	written := map[string]int{}
	for _, name := range names {
		written[name] = stops[name]()
	}
	for _, name := range names {
		waitDone(t, dbs[name], written[name])
	}
	if logCountOf(h.logs, "more files have rows than may be open at once: they are served in turn") != 1 {
		t.Errorf("no log line, or more than one, said the files are served in turn")
	}
	checkFleetStream(t, n, written)
	t.Log(body)
}

// TestFileInTroubleTakesNoTurn: a file that cannot be served is tried
// again every few seconds, and waits for a slot to be tried; with every
// slot taken by a busy healthy file, it does not have that file closed
// for its try, and the log does not say files are served in turn.
func TestFileInTroubleTakesNoTurn(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 0)
	notADatabase(t, filepath.Join(dir, "broken.db"))
	var opens atomic.Int32
	h := startFleetWith(t, dir, n.URL(), 500*time.Millisecond, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto },
		func(th *daemon.TestHooks) {
			th.MaxOpen = 1
			th.Relay = func(*relay.Relay) { opens.Add(1) }
		})
	written := writeEvery(t, acme, "acme", 50*time.Millisecond)
	h.waitReadyz(t, "1 in trouble")
	time.Sleep(12 * time.Second) // broken.db is tried again meanwhile
	waitDone(t, acme, written())
	if got := opens.Load(); got != 1 {
		t.Errorf("the busy file was opened %d times: closed for a file that cannot be served", got)
	}
	if logCountOf(h.logs, "more files have rows than may be open at once: they are served in turn") != 0 {
		t.Errorf("the log says files are served in turn; one file has rows")
	}
}

// TestTroubleEndsWhenTheFileIsServed: a file in trouble (not a database)
// is replaced by a good one and served: /readyz and fleet_files no longer
// count it in trouble, while it stays open.
func TestTroubleEndsWhenTheFileIsServed(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	tenantFile(t, dir, "acme", 0)
	notADatabase(t, filepath.Join(dir, "globex.db"))
	h := startFleet(t, dir, n.URL(), 2*time.Second)
	h.waitReadyz(t, "1 in trouble")
	staged := t.TempDir()
	tenantFile(t, staged, "globex", 1).Close()
	if err := os.Rename(filepath.Join(staged, "globex.db"), filepath.Join(dir, "globex.db")); err != nil {
		t.Fatal(err)
	}
	globex := testenv.AppDB(t, filepath.Join(dir, "globex.db"))
	writeEvery(t, globex, "globex", 100*time.Millisecond) // kept open
	testenv.Eventually(t, 20*time.Second, "globex's rows published", func() bool { return testenv.Counts(t, globex)["done"] >= 5 })
	h.waitMetrics(t, `outbox_relay_fleet_files{state="trouble"} 0`)
	if _, body := h.readyz(t); strings.Contains(body, "in trouble") {
		t.Errorf("/readyz: %s", body)
	}
}

// writeEvery inserts a keyed row of tenant's into db every period until
// the returned function is called (or the test ends), which stops it and
// says how many it wrote.
func writeEvery(t *testing.T, db *sql.DB, tenant string, period time.Duration) (stop func() int) {
	stopping := make(chan struct{})
	var wg sync.WaitGroup
	written := 0
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stopping:
				return
			case <-time.After(period):
			}
			e := testenv.NewEvent("order.placed", []byte(tenant))
			e.OrderingKey = "k"
			if err := testenv.Insert(db, e); err != nil {
				t.Error(err)
				return
			}
			written++
		}
	}()
	stop = sync.OnceValue(func() int { close(stopping); wg.Wait(); return written })
	t.Cleanup(func() { stop() }) // before the file closes
	return stop
}

// TestMendedFileGetsItsTurn: a file in trouble (not a database) is
// replaced by a good one while every slot is taken by a busy file: it is
// tried again at once and served in its turn, not left waiting behind
// its old trouble.
func TestMendedFileGetsItsTurn(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 0)
	notADatabase(t, filepath.Join(dir, "globex.db"))
	h := startFleetWith(t, dir, n.URL(), 500*time.Millisecond, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto },
		func(th *daemon.TestHooks) { th.MaxOpen = 1 })
	h.waitReadyz(t, "1 in trouble")
	writeEvery(t, acme, "acme", 50*time.Millisecond)
	testenv.Eventually(t, 20*time.Second, "acme's rows published", func() bool { return testenv.Counts(t, acme)["done"] >= 5 })
	staged := t.TempDir()
	tenantFile(t, staged, "globex", 3).Close()
	if err := os.Rename(filepath.Join(staged, "globex.db"), filepath.Join(dir, "globex.db")); err != nil {
		t.Fatal(err)
	}
	waitDone(t, testenv.AppDB(t, filepath.Join(dir, "globex.db")), 3)
}

// notWritable is a lead whose heartbeat finds the file read-only: the
// file opens, then its relay stops with that error, on every try.
type notWritable struct{ relay.Lead }

func (notWritable) Heartbeat(context.Context, string, int, time.Duration, time.Duration) (int64, error) {
	return 0, fmt.Errorf("%w: acme.db: attempt to write a readonly database", event.ErrNotWritable)
}

// TestTroubleIsLoggedOnce: a file that opens and then fails alike on
// every try is logged once, not on every try.
func TestTroubleIsLoggedOnce(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	tenantFile(t, dir, "acme", 1)
	h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto },
		func(th *daemon.TestHooks) { th.WrapLead = func(l relay.Lead) relay.Lead { return notWritable{l} } })
	h.waitReadyz(t, "1 in trouble")
	time.Sleep(12 * time.Second) // tried again twice at least
	if got := logCountOf(h.logs, "cannot serve this database file; the others are served, and it is tried again every 5s"); got != 1 {
		t.Errorf("the same error was logged %d times, want 1", got)
	}
}
