package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/procs"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestEveryCommitToAnIdleFileOpensIt: a commit to a file that is closed,
// or being closed as idle, opens it, whenever it comes: while the file's
// relay decides it is idle, while it closes, or just after. (A commit's
// notification may also come before the commit can be read: its WAL
// frames are written, then the WAL index says they count.) Each file
// gets commits at random moments around its idle time; every row is
// published, though no later commit wakes its file.
func TestEveryCommitToAnIdleFileOpensIt(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	const files, commits = 16, 10
	const idleAfter = 200 * time.Millisecond
	var dbs []*sql.DB
	for i := 0; i < files; i++ {
		dbs = append(dbs, tenantFile(t, dir, fmt.Sprintf("t%d", i), 0))
	}
	startFleet(t, dir, n.URL(), idleAfter)
	var wg sync.WaitGroup
	for i, db := range dbs {
		if i%2 == 1 { // an application that opens the file for each transaction
			db.SetMaxIdleConns(0)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := 0; c < commits; c++ {
				// From well inside the idle time to well past it.
				time.Sleep(idleAfter/2 + time.Duration(rand.Int64N(int64(3*idleAfter))))
				if err := testenv.Insert(db, testenv.NewEvent("order.placed", []byte(fmt.Sprintf("t%d", i)))); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	// Without a later commit, a row whose commit was missed waits for
	// ever: 30 s is far past any look's delay.
	deadline := time.Now().Add(30 * time.Second)
	for i, db := range dbs {
		for testenv.Counts(t, db)["done"] != commits {
			if time.Now().After(deadline) {
				t.Fatalf("t%d: %v: a commit to it did not open it", i, testenv.Counts(t, db))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// TestACommitAsAFileClosesOpensIt: a commit that comes as an idle file
// closes, once its relay has stopped and its connections are closed, is
// notified to no one that acts on it (the fleet leaves a file that is
// closing to its relay, and the relay is gone): the look that follows the
// close finds it, and the file opens again for it.
func TestACommitAsAFileClosesOpensIt(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 1)
	var once sync.Once
	h := startFleetWith(t, dir, n.URL(), 300*time.Millisecond, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
	}, func(th *daemon.TestHooks) {
		th.Tried = func(_ string, err error) {
			if err != nil {
				return
			}
			once.Do(func() { // the first close, as idle
				if err := testenv.Insert(acme, testenv.NewEvent("order.placed", []byte("acme"))); err != nil {
					t.Error(err)
				}
				// Its notification comes while the file is still closing.
				time.Sleep(200 * time.Millisecond)
			})
		}
	})
	waitDone(t, acme, 2)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	if got := len(testenv.StreamMessages(t, n.JetStream(t), "EVENTS")); got != 2 {
		t.Fatalf("%d messages, want 2", got)
	}
}

// TestLooksAgainOnlyAtWhatChanged: a file closed as idle is looked at
// on its relay's connections as it closes; the look after the close and
// the looks again that follow it (for a commit whose notification came
// before it could be read) open the file only when a commit became
// visible since, as its commit mark tells. A commit with an event still
// opens the file.
func TestLooksAgainOnlyAtWhatChanged(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	db := tenantFile(t, dir, "acme", 1)
	var mu sync.Mutex
	looks, closes := 0, 0
	count := func() (int, int) {
		mu.Lock()
		defer mu.Unlock()
		return looks, closes
	}
	startFleetWith(t, dir, n.URL(), 200*time.Millisecond, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
	}, func(th *daemon.TestHooks) {
		th.Looked = func(string) {
			mu.Lock()
			looks++
			mu.Unlock()
		}
		th.Tried = func(string, error) { // as an open file closes: the looks after it are counted
			mu.Lock()
			looks, closes = 0, closes+1
			mu.Unlock()
		}
	})
	waitDone(t, db, 1)
	testenv.Eventually(t, 30*time.Second, "the file closed as idle", func() bool {
		_, c := count()
		return c == 1
	})
	time.Sleep(time.Second) // past the look after the close and the looks again 10 and 250 ms after it
	if l, c := count(); l != 0 || c != 1 {
		t.Fatalf("the file was opened for %d looks in the second after it closed (%d closes), want none: nothing was committed meanwhile", l, c)
	}
	insertKeyed(t, db, "acme", 1)
	waitDone(t, db, 2)
}

// TestWakingFileRunsWide: a fleet opening a closed file has its Go code
// run on every core (GOMAXPROCS at the default), as a backlog does, though
// the file's one row is no backlog: the files an hour's first commits wake
// at once open side by side.
func TestWakingFileRunsWide(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	db := tenantFile(t, dir, "acme", 0)
	var widened atomic.Int64
	g := procs.NewWith(func(wide bool) {
		if wide {
			widened.Add(1)
		}
	}, 100*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	govDone := make(chan struct{})
	go func() { defer close(govDone); g.Run(ctx, 10*time.Millisecond, nil) }()
	t.Cleanup(func() { cancel(); <-govDone })
	startFleetOptions(t, dir, n.URL(), 200*time.Millisecond, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
	}, daemon.Options{Procs: g})
	testenv.Eventually(t, 30*time.Second, "GOMAXPROCS narrowed with no file open", func() bool { return !g.Wide() })
	before := widened.Load()
	insertKeyed(t, db, "acme", 1)
	waitDone(t, db, 1)
	// The governor widens on its own goroutine, told as the file took its
	// slot: by now, unless that goroutine has not run yet.
	testenv.Eventually(t, 10*time.Second, "GOMAXPROCS widened as the fleet opened the file", func() bool { return widened.Load() > before })
}

// TestWokenFilesLeaveTheStreamReconciled: the fleet's first file to reach
// the broker reconciles the stream and its consumer; a file woken from
// idle afterwards only checks that the stream is there, and asks the
// server nothing of the consumer.
func TestWokenFilesLeaveTheStreamReconciled(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	db := tenantFile(t, dir, "acme", 1)
	nc, err := nats.Connect(n.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	var stream string
	var closes, consumerInfos atomic.Int64
	startFleetWith(t, dir, n.URL(), 200*time.Millisecond, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
		cfg.Consumer.Durable, cfg.Consumer.Create = "workers", true
		stream = cfg.Stream.Name
		sub, err := nc.Subscribe("$JS.API.CONSUMER.INFO."+stream+".workers", func(*nats.Msg) { consumerInfos.Add(1) })
		if err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
	}, func(th *daemon.TestHooks) {
		th.Tried = func(string, error) { closes.Add(1) }
	})
	waitDone(t, db, 1)
	testenv.Eventually(t, 30*time.Second, "the file closed as idle", func() bool { return closes.Load() == 1 })
	first := consumerInfos.Load()
	if first == 0 {
		t.Fatal("the consumer was not looked up by the first reconciliation of the stream")
	}
	for wake := 2; wake <= 4; wake++ {
		insertKeyed(t, db, "acme", 1)
		waitDone(t, db, wake)
		testenv.Eventually(t, 30*time.Second, "the file closed as idle", func() bool { return closes.Load() == int64(wake) })
	}
	if got := consumerInfos.Load(); got != first {
		t.Fatalf("%d lookups of the consumer after the file was woken 3 times, want %d: each woken file reconciled the stream again", got, first)
	}
}

// TestLockedFilesGiveTheirTurnToStartBack: a fleet starts a few files at a
// time, and a file whose start waits gives its turn back. More files than
// there are turns are held by their applications in exclusive locking
// mode, so that opening each waits for its lock; files created meanwhile
// are served all the same, every row published.
func TestLockedFilesGiveTheirTurnToStartBack(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	const locked, healthy = 8, 6
	for i := 0; i < locked; i++ {
		testenv.HoldExclusive(t, tenantFile(t, dir, fmt.Sprintf("locked%d", i), 1))
	}
	h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto })
	testenv.Eventually(t, 30*time.Second, "every locked file's start waiting for its lock", func() bool {
		return logCountOf(h.logs, "database locked against this process; waiting until it is free") >= locked
	})
	var dbs []*sql.DB
	for i := 0; i < healthy; i++ {
		dbs = append(dbs, tenantFile(t, dir, fmt.Sprintf("t%d", i), 3))
	}
	for _, db := range dbs {
		waitDone(t, db, 3)
	}
}

// TestLockedFilesAtStartHoldUpNoOther: files that their applications hold
// locked against readers when the fleet starts, each found due as it
// cannot be read, hold up none of the files beside them: those are
// looked at and served meanwhile.
func TestLockedFilesAtStartHoldUpNoOther(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	var dbs []*sql.DB
	for i := 0; i < 12; i++ {
		testenv.HoldExclusive(t, tenantFile(t, dir, fmt.Sprintf("locked%d", i), 1))
		dbs = append(dbs, tenantFile(t, dir, fmt.Sprintf("t%d", i), 3))
	}
	startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto })
	for _, db := range dbs {
		waitDone(t, db, 3)
	}
}

// TestAClosedFileLeavesNothingOnTheConnection: a file closed as idle lets
// go of what its publishing took on the fleet's one connection. Each
// file served used to leave its subscription for acknowledgements there,
// with a goroutine and its table of acknowledgements awaited: a fleet
// whose files wake and close all day grew without end. Three rounds of
// every file woken by a row and closed again: the connection holds fewer
// subscriptions than files once they closed, and no more after the third
// round than after the first.
func TestAClosedFileLeavesNothingOnTheConnection(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	const files = 8
	var dbs []*sql.DB
	for i := range files {
		dbs = append(dbs, tenantFile(t, dir, fmt.Sprintf("t%d", i), 0))
	}
	var ended atomic.Int64 // tries to serve a file that ended
	startFleetWith(t, dir, n.URL(), 200*time.Millisecond, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto },
		func(h *daemon.TestHooks) { h.Tried = func(string, error) { ended.Add(1) } })
	subs := func() (total int) {
		for _, c := range relayConns(t, n) {
			total += int(c.NumSubs)
		}
		return total
	}
	// The server counts a subscription until the client's unsubscribe
	// reaches it: each count is waited for.
	var first int // once the first round's files closed
	for round := 1; round <= 3; round++ {
		for _, db := range dbs {
			if err := testenv.Insert(db, testenv.NewEvent("order.placed", []byte("x"))); err != nil {
				t.Fatal(err)
			}
		}
		testenv.Eventually(t, 30*time.Second, fmt.Sprintf("round %d: every row done", round), func() bool {
			for _, db := range dbs {
				if testenv.Counts(t, db)["done"] != round {
					return false
				}
			}
			return true
		})
		testenv.Eventually(t, 30*time.Second, fmt.Sprintf("round %d: every file closed", round), func() bool {
			return ended.Load() >= int64(round*files)
		})
		if round == 1 {
			testenv.Eventually(t, 10*time.Second, "fewer subscriptions on the connection than files closed", func() bool {
				first = subs()
				return first < files
			})
		}
	}
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("as many subscriptions after the third round as the %d after the first", first), func() bool {
		return subs() <= first
	})
}
