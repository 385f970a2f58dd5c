package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/lead"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestOutageSpendsNoAttempts stops the broker mid-run: unsettled rows go
// back to pending without spending attempts, the relay pauses and resumes
// by itself, and it says so in one line each way.
func TestOutageSpendsNoAttempts(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{batch: 50, inFlight: 200})

	stopWriter := make(chan struct{})
	var written int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stopWriter:
				return
			default:
			}
			evs := make([]testenv.Event, 10)
			for j := range evs {
				evs[j] = testenv.NewEvent("Outage", []byte(fmt.Sprint(i, j)))
			}
			if err := testenv.Insert(app, evs...); err != nil {
				t.Error(err) // not Fatal: this is not the test's goroutine
				return
			}
			written += 10
			time.Sleep(2 * time.Millisecond)
		}
	}()
	testenv.Eventually(t, 20*time.Second, "some rows done", func() bool { return testenv.Counts(t, app)["done"] > 500 })
	n.Stop()
	testenv.Eventually(t, 20*time.Second, "the relay to pause", func() bool { return h.relay.Paused() != nil })
	time.Sleep(2 * time.Second) // an outage with the writer still writing
	if got := metrics.Value(h.metrics.BrokerConnected); got != 0 {
		t.Errorf("broker_connected %v during the outage", got)
	}
	n.Restart()
	time.Sleep(500 * time.Millisecond)
	close(stopWriter)
	wg.Wait()
	counts := waitAllSettled(t, app, written, 60*time.Second)
	if counts["done"] != written {
		t.Fatalf("counts %v, want %d done", counts, written)
	}
	var attempts int
	app.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue`).Scan(&attempts)
	if attempts != 0 {
		t.Fatalf("the outage spent %d attempts", attempts)
	}
	assertOncePerEvent(t, n, app, written)
	// One line when it goes away, one when it is back: not one per row. (A
	// server that is still recovering may make a second, short outage.)
	if a, b := logCount(h, "broker unavailable; pausing without spending attempts"), logCount(h, "broker recovered; resuming"); a != b || a < 1 || a > 2 {
		t.Fatalf("%d unavailable and %d recovered log lines; want one each", a, b)
	}
	rec := h.logs.FilterMessage("broker recovered; resuming").All()[0]
	if d, ok := rec.ContextMap()["outage"].(time.Duration); !ok || d < 2*time.Second {
		t.Fatalf("recovery line outage field %v", rec.ContextMap()["outage"])
	}
	if got := metrics.Value(h.metrics.Deferred.WithLabelValues(metrics.DeferOutage)); got == 0 {
		t.Error("no row was deferred for the outage; the test did not exercise the release path")
	}
	if got := metrics.Value(h.metrics.BrokerConnected); got != 1 {
		t.Errorf("broker_connected %v after recovery", got)
	}
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
}

// TestStartsPausedWithoutStream: a missing stream that may not be created is
// an outage (nothing claimed, nothing dead-lettered) until it appears.
func TestStartsPausedWithoutStream(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 20, "Early")
	h := startRelay(t, path, n.URL(), harnessOptions{mutateOpt: func(o *relay.Options) {
		ready := o.Ready
		o.Ready = func(ctx context.Context) error {
			if _, err := n.JetStream(t).Stream(ctx, "EVENTS"); err != nil {
				return fmt.Errorf("stream EVENTS: %w", err)
			}
			return ready(ctx)
		}
	}})
	testenv.Eventually(t, 10*time.Second, "paused", func() bool { return h.relay.Paused() != nil })
	time.Sleep(300 * time.Millisecond)
	if c := testenv.Counts(t, app); c["pending"] != 20 {
		t.Fatalf("rows touched while paused: %v", c)
	}
	if _, err := n.JetStream(t).CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour}); err != nil {
		t.Fatal(err)
	}
	waitAllSettled(t, app, 20, 20*time.Second)
	if c := testenv.Counts(t, app); c["done"] != 20 {
		t.Fatalf("counts %v", c)
	}
}

// TestRejectionsSpendAttemptsThenDeadLetter: a message the stream refuses
// (its size limit was lowered after the relay read it) is retried with the
// shared backoff, and the rows around it flow; on the next try the relay
// reads the limit again and dead-letters the row at once, at the last
// attempt here.
func TestRejectionsSpendAttemptsThenDeadLetter(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 5, "Small")
	h := startRelay(t, path, n.URL(), harnessOptions{maxTries: 2})
	waitAllSettled(t, app, 5, 10*time.Second) // the relay has read the stream's (absent) size limit
	cfg.MaxMsgSize = 1000
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	started := time.Now() // before the rejection
	big := testenv.NewEvent("Big", make([]byte, 5000))
	if err := testenv.Insert(app, big); err != nil {
		t.Fatal(err)
	}
	testenv.InsertN(t, app, 5, "Small")
	var attempts int
	var availableAt int64
	var lastError string
	testenv.Eventually(t, 10*time.Second, "first rejection", func() bool {
		app.QueryRow(`SELECT attempts, available_at, coalesce(last_error, '') FROM event_queue WHERE event_id = ?`, *big.EventID).Scan(&attempts, &availableAt, &lastError)
		return attempts == 1
	})
	// The rejection happened between started and now; the retry is due
	// RetryBackoff(1) after it.
	if at := time.UnixMilli(availableAt); at.Before(started.Add(event.RetryBackoff(1)).Add(-time.Millisecond)) || at.After(time.Now().Add(event.RetryBackoff(1))) {
		t.Errorf("retry scheduled at %v, want %v after the rejection (between %v and %v)", at, event.RetryBackoff(1), started, time.Now())
	}
	if !strings.Contains(lastError, "message size exceeds maximum") {
		t.Errorf("last_error %q", lastError)
	}
	waitAllSettled(t, app, 10, 10*time.Second)
	if c := testenv.Counts(t, app); c["done"] != 10 || c["pending"] != 1 {
		t.Fatalf("after the first rejection: %v", c)
	}
	// Skip the 5 s wait.
	if _, err := app.Exec(`UPDATE event_queue SET available_at = 0 WHERE event_id = ?`, *big.EventID); err != nil {
		t.Fatal(err)
	}
	var status string
	var processed sql.NullInt64
	testenv.Eventually(t, 10*time.Second, "dead letter", func() bool {
		app.QueryRow(`SELECT status, attempts, coalesce(last_error, ''), processed_at FROM event_queue WHERE event_id = ?`, *big.EventID).Scan(&status, &attempts, &lastError, &processed)
		return status == "dead_lettered"
	})
	if attempts != 2 || !processed.Valid || !strings.Contains(lastError, "more than the stream's max_msg_size of 1000") {
		t.Fatalf("dead letter: attempts %d processed %v last_error %q", attempts, processed, lastError)
	}
	metricsReach(t, h, map[string]float64{"outbox_relay_retries_total": 1, `outbox_relay_dead_lettered_total{reason="too_large"}`: 1})
}

// TestOversizedRowDeadLetteredAtOnce: a row above the stream's
// max_msg_size is dead-lettered on its first try, without retries, with a
// reason that gives its size and the limits, while the rows around it
// flow; once the limit is raised, dead-letters retry publishes it.
func TestOversizedRowDeadLetteredAtOnce(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour, MaxMsgSize: 1000}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 5, "Small")
	big := testenv.NewEvent("Big", make([]byte, 5000))
	if err := testenv.Insert(app, big); err != nil {
		t.Fatal(err)
	}
	testenv.InsertN(t, app, 5, "Small")
	h := startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 11, 10*time.Second)
	var status, lastError string
	var attempts int
	app.QueryRow(`SELECT status, attempts, coalesce(last_error, '') FROM event_queue WHERE event_id = ?`, *big.EventID).Scan(&status, &attempts, &lastError)
	if status != "dead_lettered" || attempts != 1 {
		t.Fatalf("oversized row %s after %d attempts; want dead_lettered on the first", status, attempts)
	}
	for _, want := range []string{"payload 5000", "more than the stream's max_msg_size of 1000", "max_payload 1048576"} {
		if !strings.Contains(lastError, want) {
			t.Errorf("last_error %q does not say %q", lastError, want)
		}
	}
	if c := testenv.Counts(t, app); c["done"] != 10 {
		t.Fatalf("the rows around it: %v", c)
	}
	metricsReach(t, h, map[string]float64{"outbox_relay_retries_total": 0, `outbox_relay_dead_lettered_total{reason="too_large"}`: 1,
		`outbox_relay_dead_lettered_total{reason="max_attempts"}`: 0})

	cfg.MaxMsgSize = 8192
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, app, `UPDATE event_queue SET status = 'pending', attempts = 0, available_at = 0, processed_at = NULL WHERE event_id = ?`, *big.EventID)
	h.wake()
	waitAllSettled(t, app, 11, 10*time.Second)
	if c := testenv.Counts(t, app); c["done"] != 11 {
		t.Fatalf("after raising the limit and retrying: %v", c)
	}
}

// stallingPublisher holds every acknowledgement until its gate opens.
type stallingPublisher struct {
	relay.Publisher
	gate chan struct{}
}

type stalledAck struct {
	inner publish.Ack
	gate  chan struct{}
}

func (a stalledAck) Wait(ctx context.Context) publish.Result {
	select {
	case <-a.gate:
	case <-ctx.Done():
		return publish.Result{Kind: publish.Transport, Err: ctx.Err()}
	}
	return a.inner.Wait(ctx)
}

func (p *stallingPublisher) Publish(ctx context.Context, msgs []publish.Message) []publish.Ack {
	acks := p.Publisher.Publish(ctx, msgs)
	for i := range acks {
		acks[i] = stalledAck{inner: acks[i], gate: p.gate}
	}
	return acks
}

// newStalledRelay starts a relay whose publisher acknowledges nothing until
// gate is closed.
func newStalledRelay(t *testing.T, path, url string, ho harnessOptions, gate chan struct{}) *harness {
	t.Helper()
	ho.wrapPublisher = func(p relay.Publisher) relay.Publisher { return &stallingPublisher{Publisher: p, gate: gate} }
	return startRelay(t, path, url, ho)
}

// TestShutdownReleasesUnackedRows: on shutdown the relay waits
// shutdown_timeout for acknowledgements, then puts the rest back to pending
// without spending attempts.
func TestShutdownReleasesUnackedRows(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 30, "Shut")
	gate := make(chan struct{})
	h := newStalledRelay(t, path, n.URL(), harnessOptions{shutdown: 300 * time.Millisecond}, gate)
	testenv.Eventually(t, 10*time.Second, "rows in flight", func() bool { return metrics.Value(h.metrics.InFlight) == 30 })
	start := time.Now()
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 15*time.Second {
		t.Errorf("shutdown took %v with shutdown_timeout 300ms", d)
	}
	var pending, attempts, claimed int
	app.QueryRow(`SELECT count(*), coalesce(sum(attempts), 0), count(claimed_at) FROM event_queue WHERE status = 'pending' AND available_at <= ?`, time.Now().UnixMilli()).Scan(&pending, &attempts, &claimed)
	if pending != 30 || attempts != 0 || claimed != 0 {
		t.Fatalf("after shutdown: %d pending and due, %d attempts, %d still claimed", pending, attempts, claimed)
	}
	if got := metrics.Value(h.metrics.Deferred.WithLabelValues(metrics.DeferShutdown)); got != 30 {
		t.Fatalf("deferred_total{reason=shutdown} %v", got)
	}
	var instances int
	app.QueryRow(`SELECT count(*) FROM ` + schema.InstancesTable).Scan(&instances)
	if instances != 0 {
		t.Fatalf("%d instance rows left after a graceful stop", instances)
	}
}

// TestShutdownWaitsForAcks: acknowledgements that arrive within
// shutdown_timeout still settle rows as done.
func TestShutdownWaitsForAcks(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 30, "Shut")
	gate := make(chan struct{})
	h := newStalledRelay(t, path, n.URL(), harnessOptions{shutdown: 10 * time.Second}, gate)
	testenv.Eventually(t, 10*time.Second, "rows in flight", func() bool { return metrics.Value(h.metrics.InFlight) == 30 })
	time.AfterFunc(200*time.Millisecond, func() { close(gate) })
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	if c := testenv.Counts(t, app); c["done"] != 30 {
		t.Fatalf("counts after a drained shutdown: %v", c)
	}
}

// frozenHeartbeats is a lead whose heartbeats, after the first, wait for
// gate: with the stalled publisher, a whole process paused (SIGSTOP, a
// frozen VM).
type frozenHeartbeats struct {
	relay.Lead
	gate  chan struct{}
	beats atomic.Int64
}

func (s *frozenHeartbeats) Heartbeat(ctx context.Context, version string, inFlight int, lease, staleAfter time.Duration) (int64, error) {
	if s.beats.Add(1) > 1 {
		select {
		case <-s.gate:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return s.Lead.Heartbeat(ctx, version, inFlight, lease, staleAfter)
}

// TestRowsDueUnderTheApplicationsLockGoOut: the application holds the
// write lock for longer than the relay's heartbeats can wait for it and
// than half the staleness; rows that come due meanwhile are still
// published (claims only read), while the lock is held: the relay reads
// that its heartbeat row is still there and first.
func TestRowsDueUnderTheApplicationsLockGoOut(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	startRelay(t, path, n.URL(), harnessOptions{busyTimeout: time.Minute})
	testenv.InsertN(t, app, 5, "Before")
	waitAllSettled(t, app, 5, 20*time.Second)
	due := time.Now().Add(3 * time.Second).UnixMilli() // past half the harness's 2 s staleness
	for i := 0; i < 20; i++ {
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES (?, 'Later', 'x', ?)`, fmt.Sprint("later-", i), due)
	}
	tx, err := app.Begin() // BEGIN IMMEDIATE: the application's long write
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	js := n.JetStream(t)
	testenv.Eventually(t, 30*time.Second, "the rows due under the lock published while it is held", func() bool {
		return len(testenv.StreamMessages(t, js, "EVENTS")) == 25
	})
}

// TestStaleRelayCannotOverwrite: a leader paused past the staleness window
// loses the lead to another relay, which publishes its rows (still pending
// in the table) again; when it wakes up, it changes nothing.
func TestStaleRelayCannotOverwrite(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 50, "Lease")
	gate := make(chan struct{})
	stale := newStalledRelay(t, path, n.URL(), harnessOptions{lease: 2 * time.Second, batch: 50, inFlight: 50,
		wrapLead: func(l relay.Lead) relay.Lead { return &frozenHeartbeats{Lead: l, gate: gate} }}, gate)
	testenv.Eventually(t, 10*time.Second, "rows in flight at the stalled relay", func() bool { return metrics.Value(stale.metrics.InFlight) == 50 })
	fresh := startRelay(t, path, n.URL(), harnessOptions{lease: 2 * time.Second})
	waitAllSettled(t, app, 50, 20*time.Second)
	if got := metrics.Value(fresh.metrics.Leader); got != 1 {
		t.Errorf("the fresh relay's leader gauge is %v after it settled the rows", got)
	}
	var processedBefore int64
	app.QueryRow(`SELECT sum(processed_at) FROM event_queue`).Scan(&processedBefore)
	close(gate) // the stalled relay wakes up and tries to settle
	testenv.Eventually(t, 10*time.Second, "the stale relay to notice", func() bool {
		return logCount(stale, "rows not settled: this relay lost the lead, or the rows changed meanwhile; the leader publishes what is still pending") > 0
	})
	var processedAfter int64
	app.QueryRow(`SELECT sum(processed_at) FROM event_queue`).Scan(&processedAfter)
	if processedAfter != processedBefore {
		t.Fatal("the stale relay rewrote rows another relay had settled")
	}
	if got := metrics.Value(stale.metrics.Published); got != 0 {
		t.Fatalf("stale relay counted %v rows published", got)
	}
	testenv.Eventually(t, 10*time.Second, "the stale relay to stand by", func() bool {
		return logCount(stale, "standing by: another relay of this outbox table leads") > 0
	})
	assertOncePerEvent(t, n, app, 50)
}

// TestDeadRelayClaimsRecoveredFast: rows marked processing by a claimer
// that writes its claims (an older relay, say) and then stopped
// heartbeating come back within seconds, not after the 10-minute lease.
func TestDeadRelayClaimsRecoveredFast(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 40, "Crash")
	dead := lead.New(testenv.OpenDB(t, path))
	ctx := context.Background()
	if _, err := dead.Heartbeat(ctx, "dead", 0, 10*time.Minute, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := app.Exec(`UPDATE event_queue SET status = 'processing', claimed_at = ?, claimed_by = ?`, time.Now().UnixMilli(), dead.Instance()); err != nil {
		t.Fatal(err)
	}
	// dead never heartbeats again: it was killed.
	start := time.Now()
	h := startRelay(t, path, n.URL(), harnessOptions{lease: 10 * time.Minute})
	waitAllSettled(t, app, 40, 15*time.Second)
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("recovery took %v", d)
	}
	metricsReach(t, h, map[string]float64{"outbox_relay_leases_reclaimed_total": 40})
}

// noGoodbye is a lead whose relay dies without removing its heartbeat
// row, as a killed process does.
type noGoodbye struct{ relay.Lead }

func (noGoodbye) Leave(context.Context) error { return nil }

// TestOneRelayLeadsTheOtherStandsBy: of two relays on one file, the first
// leads and publishes every row while the other stands by, reclaiming
// nothing; when the leader dies without a goodbye, the standby takes over
// within seconds and publishes what comes next, each event once.
func TestOneRelayLeadsTheOtherStandsBy(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	a := startRelay(t, path, n.URL(), harnessOptions{batch: 20, lease: time.Minute, wrapLead: func(l relay.Lead) relay.Lead { return noGoodbye{l} }})
	testenv.Eventually(t, 10*time.Second, "the first relay to lead", func() bool { return metrics.Value(a.metrics.Leader) == 1 })
	b := startRelay(t, path, n.URL(), harnessOptions{batch: 20, lease: time.Minute})
	testenv.Eventually(t, 10*time.Second, "the second relay to stand by", func() bool {
		return logCount(b, "standing by: another relay of this outbox table leads") == 1
	})
	// What /readyz adds to its "ok".
	if ra, rb := a.relay.Role(), b.relay.Role(); !strings.HasPrefix(ra, "leading, ") || rb != "standing by: another relay of this outbox table leads" {
		t.Fatalf("roles %q and %q", ra, rb)
	}
	for i := 0; i < 100; i++ {
		testenv.InsertN(t, app, 15, "Shared")
		if i%20 == 0 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitAllSettled(t, app, 1500, 60*time.Second)
	if ra, rb := metrics.Value(a.metrics.LeasesReclaimed), metrics.Value(b.metrics.LeasesReclaimed); ra != 0 || rb != 0 {
		t.Fatalf("live relays reclaimed each other's rows: %v and %v", ra, rb)
	}
	// All by the leader, none by the standby.
	metricsReach(t, a, map[string]float64{"outbox_relay_published_total": 1500})
	metricsReach(t, b, map[string]float64{"outbox_relay_published_total": 0})
	// The leader dies; its heartbeat row stays behind.
	a.stop()
	died := time.Now()
	testenv.Eventually(t, 10*time.Second, "the standby to lead", func() bool { return metrics.Value(b.metrics.Leader) == 1 })
	t.Logf("the standby led %v after the leader died", time.Since(died).Round(100*time.Millisecond))
	testenv.InsertN(t, app, 100, "AfterTakeover")
	waitAllSettled(t, app, 1600, 30*time.Second)
	// The new leader published the 100 rows written after the takeover.
	metricsReach(t, b, map[string]float64{"outbox_relay_published_total": 100})
	assertOncePerEvent(t, n, app, 1600)
}

// TestApplicationHoldingTheLock: the application holding the write lock
// longer than busy_timeout is waited out, logged once, and loses nothing.
func TestApplicationHoldingTheLock(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{busyTimeout: 200 * time.Millisecond})
	testenv.InsertN(t, app, 100, "Before")
	waitAllSettled(t, app, 100, 10*time.Second)
	tx, err := app.Begin() // BEGIN IMMEDIATE: the application's long write
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		if _, err := tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'During', 'x')`, event.NewID()); err != nil {
			t.Fatal(err)
		}
	}
	h.wake()
	time.Sleep(2 * time.Second)
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	testenv.InsertN(t, app, 100, "After")
	waitAllSettled(t, app, 250, 20*time.Second)
	if c := testenv.Counts(t, app); c["done"] != 250 {
		t.Fatalf("counts %v", c)
	}
	testenv.Eventually(t, 5*time.Second, "recovery line", func() bool { return logCount(h, "database available again") == 1 })
	if got := logCount(h, "database unavailable; retrying"); got != 1 {
		t.Fatalf("%d 'database unavailable' lines, want 1", got)
	}
	assertOncePerEvent(t, n, app, 250)
}
