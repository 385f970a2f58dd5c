package daemon_test

// Faults that a hostile operator or environment produces. Each test asserts
// what a user observes (rows, messages, logs, readiness), not how the relay
// is built.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// nothingSpent fails the test when a row spent an attempt or was
// dead-lettered; why, if not empty, says what should not have cost any.
func nothingSpent(t *testing.T, db *sql.DB, why string) {
	t.Helper()
	if attempted, dead := spentAttempts(t, db); attempted+dead > 0 {
		t.Fatalf("%d rows spent attempts and %d were dead-lettered %s", attempted, dead, why)
	}
}

// spentAttempts returns how many rows spent an attempt or were dead-lettered.
func spentAttempts(t *testing.T, db *sql.DB) (attempted, dead int) {
	t.Helper()
	if err := db.QueryRow(`SELECT count(*) FILTER (WHERE attempts > 0), count(*) FILTER (WHERE status = 'dead_lettered') FROM event_queue`).Scan(&attempted, &dead); err != nil {
		t.Fatal(err)
	}
	return attempted, dead
}

// relayedRows runs a relay (two attempts a row) on a fresh file against a
// fresh server, and returns once rows rows it was given are settled: the
// file, the relay and the server's JetStream.
func relayedRows(t *testing.T, rows int) (*sql.DB, *harness, jetstream.JetStream) {
	t.Helper()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{maxTries: 2})
	testenv.InsertN(t, app, rows, "Before")
	waitAllSettled(t, app, rows, 20*time.Second)
	return app, h, n.JetStream(t)
}

// TestAnotherStreamTakingTheSubjectsIsAnOutage: the relay's stream is
// deleted and another stream takes its subjects while the relay runs. The
// other stream's acknowledgements settle nothing: the rows stay pending
// without spending attempts, the relay pauses naming the other stream, and
// once that stream is gone the rows go into the relay's own stream, once
// each.
func TestAnotherStreamTakingTheSubjectsIsAnOutage(t *testing.T) {
	t.Parallel()
	app, h, js := relayedRows(t, 5)
	ctx := context.Background()
	if err := js.DeleteStream(ctx, "EVENTS"); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OTHER", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 60; i++ { // unordered rows and a key's batch
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES (?, 'During', 'x', ?)`, fmt.Sprint("during-", i), []string{"", "k"}[i%2])
	}
	testenv.Eventually(t, 20*time.Second, "the relay to pause naming the other stream", func() bool {
		err := h.relay.Paused()
		return err != nil && strings.Contains(err.Error(), "OTHER")
	})
	if done := testenv.Counts(t, app)["done"]; done != 5 {
		t.Fatalf("%d rows done, want the 5 from before: the other stream's acknowledgements settled rows", done)
	}
	nothingSpent(t, app, "while another stream took the subjects")
	if err := js.DeleteStream(ctx, "OTHER"); err != nil {
		t.Fatal(err)
	}
	waitAllSettled(t, app, 65, 60*time.Second)
	nothingSpent(t, app, "")
	if got := len(testenv.StreamMessages(t, js, "EVENTS")); got != 60 {
		t.Fatalf("the recreated stream holds %d messages, want the 60 rows written since", got)
	}
}

// TestStreamThatStopsCapturingPauses: a stream recreated with other
// subjects while the relay runs is an outage like a missing stream: no
// attempt spent, nothing dead-lettered, /readyz not ready, and the rows go
// out once the stream is fixed.
func TestStreamThatStopsCapturingPauses(t *testing.T) {
	t.Parallel()
	app, h, js := relayedRows(t, 20)
	// An operator edits the stream's subjects. (Deleting the stream and
	// creating it again at once sometimes fails on the server itself:
	// "error creating store for stream".)
	testenv.EditStream(t, js, "EVENTS", func(c *jetstream.StreamConfig) { c.Subjects = []string{"other.>"} })
	testenv.InsertN(t, app, 50, "During")
	testenv.Eventually(t, 20*time.Second, "the relay to pause", func() bool { return h.relay.Paused() != nil })
	// Long enough for several probes and, before, for rejections to run
	// out the two attempts.
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if h.relay.Paused() == nil {
			t.Fatal("the relay resumed while the stream captures none of its subjects")
		}
		time.Sleep(50 * time.Millisecond)
	}
	nothingSpent(t, app, "while the stream did not capture the subjects")
	testenv.EditStream(t, js, "EVENTS", func(c *jetstream.StreamConfig) { c.Subjects = []string{"events.>"} })
	waitAllSettled(t, app, 70, 30*time.Second)
	nothingSpent(t, app, "")
}

// TestDroppedConnectionsSpendNoAttempts: the server drops the relay's
// connection five times during a drain (as it does to a slow
// consumer); every row still ends done without spending an attempt.
func TestDroppedConnectionsSpendNoAttempts(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	const rows = 3000
	payload := strings.Repeat("p", 8<<10) // large enough to fill socket buffers
	startRelay(t, path, n.URL(), harnessOptions{maxTries: 1, batch: 200, inFlight: 1000})
	// The daemon names its connection; the rows are committed once it is
	// up, so that the kicks below land while they are in flight.
	testenv.Eventually(t, 20*time.Second, "the relay connected", func() bool { return len(relayConns(t, n)) > 0 })
	tx, err := app.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < rows; i++ {
		if _, err := tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'Drop', ?)`, event.NewID(), payload); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	kicks := 0
	for kicks < 5 && testenv.Counts(t, app)["done"] < rows {
		for _, c := range relayConns(t, n) {
			if n.Srv.DisconnectClientByID(c.Cid) == nil {
				kicks++
			}
		}
		time.Sleep(30 * time.Millisecond)
	}
	if kicks == 0 {
		t.Fatal("every row was done before the relay's connection could be dropped once")
	}
	t.Logf("dropped the relay's connection %d times", kicks)
	waitAllSettled(t, app, rows, 60*time.Second)
	nothingSpent(t, app, "(dropped connections are not rejections)")
	assertOncePerEvent(t, n, app, rows)
}

// TestWallClockSteppingBack: an NTP step back of an hour neither stops
// claiming nor hides rows, and shutdown still ends promptly.
func TestWallClockSteppingBack(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	var offset atomic.Int64
	clock := event.NewClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) })
	h := startRelay(t, path, n.URL(), harnessOptions{clock: clock})
	testenv.InsertN(t, app, 10, "BeforeStep")
	waitAllSettled(t, app, 10, 20*time.Second)
	offset.Store(int64(-time.Hour))
	// Rows the application commits now carry a time an hour after the
	// relay's wall clock.
	for i := 0; i < 5; i++ {
		testenv.InsertN(t, app, 2, "AfterStep")
		waitAllSettled(t, app, 12+2*i, 20*time.Second)
	}
	stopped := make(chan error, 1)
	go func() { stopped <- h.stop() }()
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the relay did not stop after the clock stepped back")
	}
}

// budgetPublisher records the most payload bytes that were published and
// not yet acknowledged at any moment.
type budgetPublisher struct {
	relay.Publisher
	mu          sync.Mutex
	out, maxOut int64
}

func (p *budgetPublisher) Publish(ctx context.Context, msgs []publish.Message) []publish.Ack {
	p.mu.Lock()
	for _, m := range msgs {
		p.out += int64(len(m.Row.Payload))
	}
	p.maxOut = max(p.maxOut, p.out)
	p.mu.Unlock()
	acks := p.Publisher.Publish(ctx, msgs)
	for i, a := range acks {
		acks[i] = &budgetAck{Ack: a, p: p, size: int64(len(msgs[i].Row.Payload))}
	}
	return acks
}

type budgetAck struct {
	publish.Ack
	p    *budgetPublisher
	size int64
	once sync.Once
}

func (a *budgetAck) Wait(ctx context.Context) publish.Result {
	r := a.Ack.Wait(ctx)
	a.once.Do(func() {
		a.p.mu.Lock()
		a.p.out -= a.size
		a.p.mu.Unlock()
	})
	return r
}

// TestPayloadBudgetBoundsEveryClaim: large payloads are read only up to the
// byte budget, from the first claim on (not only once the relay has seen
// how large rows are).
func TestPayloadBudgetBoundsEveryClaim(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	const rows, size, budget = 40, 256 << 10, 1 << 20
	for i := 0; i < rows; i++ {
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'Big', zeroblob(?))`, event.NewID(), size)
	}
	bp := &budgetPublisher{}
	startRelay(t, path, n.URL(), harnessOptions{
		batch: 100, inFlight: 400,
		wrapPublisher: func(p relay.Publisher) relay.Publisher { bp.Publisher = p; return bp },
		mutateOpt:     func(o *relay.Options) { o.MaxInFlightBytes = budget },
	})
	waitAllSettled(t, app, rows, 30*time.Second)
	bp.mu.Lock()
	defer bp.mu.Unlock()
	if bp.maxOut > budget+size {
		t.Fatalf("%d KiB of payload in flight at once; the budget is %d KiB (plus one row)", bp.maxOut>>10, budget>>10)
	}
}

// TestFullStreamStaysPaused: a stream that is full (discard new) answers
// every probe and refuses every message; the relay stays paused, /readyz
// stays not ready, and it says "recovered" once, when the stream takes
// messages again.
func TestFullStreamStaysPaused(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour, MaxMsgs: 5, Discard: jetstream.DiscardNew}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 20, "Full")
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.Eventually(t, 20*time.Second, "the relay to pause on the full stream", func() bool {
		return testenv.Counts(t, app)["done"] == 5 && h.relay.Paused() != nil
	})
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if h.relay.Paused() == nil {
			t.Fatal("readiness flipped back while the stream is still full")
		}
		time.Sleep(10 * time.Millisecond)
	}
	const recovered = "broker recovered; resuming"
	if c := logCount(h, recovered); c != 0 {
		t.Fatalf("logged %q %d times while the stream was full", recovered, c)
	}
	cfg.MaxMsgs = -1
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	waitAllSettled(t, app, 20, 30*time.Second)
	if c := logCount(h, recovered); c != 1 {
		t.Fatalf("logged %q %d times, want once", recovered, c)
	}
	nothingSpent(t, app, "")
}

// failingClaims is the real store whose claims fail while the heartbeats
// of the real lead succeed (a table the relay can no longer read, say).
type failingClaims struct {
	relay.Store
	claims atomic.Int64
}

func (s *failingClaims) Claim(context.Context, int, int64) ([]event.Row, error) {
	s.claims.Add(1)
	return nil, errors.New("no such table: event_queue")
}

// countedBeats counts the heartbeats of the real lead.
type countedBeats struct {
	relay.Lead
	beats atomic.Int64
}

func (l *countedBeats) Heartbeat(ctx context.Context, version string, inFlight int, lease, staleAfter time.Duration) (int64, error) {
	l.beats.Add(1)
	return l.Lead.Heartbeat(ctx, version, inFlight, lease, staleAfter)
}

// TestDatabaseTroubleLoggedOncePerEpisode: claims that keep failing are
// logged once, although heartbeats succeed in between, and the relay says
// what fails.
func TestDatabaseTroubleLoggedOncePerEpisode(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	fs, cb := &failingClaims{}, &countedBeats{}
	h := startRelay(t, path, n.URL(), harnessOptions{
		wrapStore: func(s relay.Store) relay.Store { fs.Store = s; return fs },
		wrapLead:  func(l relay.Lead) relay.Lead { cb.Lead = l; return cb },
	})
	testenv.Eventually(t, 20*time.Second, "several failed claims and heartbeats", func() bool {
		return fs.claims.Load() >= 5 && cb.beats.Load() >= 5
	})
	if c := logCount(h, "database unavailable; retrying"); c != 1 {
		t.Fatalf("logged the trouble %d times, want once", c)
	}
	if err := h.relay.DatabaseError(); err == nil || !strings.Contains(err.Error(), "no such table") {
		t.Fatalf("DatabaseError() = %v, want the claim's error", err)
	}
	if v := metrics.Value(h.metrics.Published); v != 0 {
		t.Fatalf("published %v", v)
	}
}

// TestOutageWithNothingToTryEnds: a broker that was down at startup, with
// no row to publish, is ready again as soon as it answers: the relay does
// not wait for a row to prove it.
func TestOutageWithNothingToTryEnds(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	n.Stop()
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.Eventually(t, 20*time.Second, "the relay to pause", func() bool { return h.relay.Paused() != nil })
	n.Restart()
	testenv.Eventually(t, 30*time.Second, "the outage to end with an empty table", func() bool { return h.relay.Paused() == nil })
	if c := logCount(h, "broker recovered; resuming"); c != 1 {
		t.Fatalf("logged recovery %d times, want once", c)
	}
}

// TestSealedStreamPausesAndSpendsNothing: a sealed stream refuses every
// publish with a code 400, as it would a message's own fault. No row is at
// fault: the relay pauses saying the stream is sealed, spends no attempt
// and dead-letters nothing however often it tries again, and the rows go
// out once the operator gives it a stream that takes them.
func TestSealedStreamPausesAndSpendsNothing(t *testing.T) {
	t.Parallel()
	app, h, js := relayedRows(t, 5)
	ctx := context.Background()
	testenv.EditStream(t, js, "EVENTS", func(c *jetstream.StreamConfig) { c.Sealed = true })
	for i := 0; i < 30; i++ {
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES (?, 'During', 'x', ?)`, fmt.Sprint("during-", i), fmt.Sprint("k", i%10))
	}
	testenv.Eventually(t, 20*time.Second, "the relay to pause saying the stream is sealed", func() bool {
		err := h.relay.Paused()
		return err != nil && strings.Contains(err.Error(), "sealed")
	})
	// Before, every row was refused at once and the head rows of all keys
	// ran out their two attempts: wait until the relay has tried again
	// after the pause began (a row deferred by a later try).
	deferred := func() float64 { return scrape(t, h, `outbox_relay_deferred_total{reason="outage"}`) }
	first := deferred()
	testenv.Eventually(t, 30*time.Second, "a try after the pause began", func() bool { return deferred() > first })
	nothingSpent(t, app, "on a sealed stream")
	// A sealed stream cannot be unsealed: the operator replaces it.
	if err := js.DeleteStream(ctx, "EVENTS"); err != nil {
		t.Fatal(err)
	}
	waitAllSettled(t, app, 35, 60*time.Second)
	nothingSpent(t, app, "")
}
