package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// unsettled is a store that publishes as the relay does and settles
// nothing, as a relay killed between the PubAck and the settle: every
// outcome is stale, and the rows stay pending.
type unsettled struct{ relay.Store }

func (unsettled) Settle(_ context.Context, outs []event.Outcome, _ uint64) ([]int, error) {
	stale := make([]int, len(outs))
	for i := range stale {
		stale[i] = i
	}
	return stale, nil
}

// publishUnsettled runs a relay on path that publishes its pending rows
// and settles none, until the stream holds want messages in all; the
// rows stay pending, their messages stored.
func publishUnsettled(t *testing.T, n *testenv.NATS, path string, want int) {
	t.Helper()
	js := n.JetStream(t)
	testenv.EventsStream(t, js, 0)
	h := startRelay(t, path, n.URL(), harnessOptions{wrapStore: func(s relay.Store) relay.Store { return unsettled{s} }})
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("%d messages in the stream", want), func() bool {
		return len(testenv.StreamMessages(t, js, "EVENTS")) >= want
	})
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
}

// pastTheWindow shrinks the stream's duplicate window to 1 s and waits
// past it: JetStream no longer drops a republished event.
//
// It shrinks the window in two steps. The server forgets the ids it holds
// by a timer, which a change of the window makes fire at once; but
// nats-server (2.15.2) does that before it takes the new window, so a
// timer that fires in between purges by the old window and sets itself
// for the old window's end (an hour on), and until then every id stays.
// The second change finds the server on a window of 2 s: whichever of the
// two its timer sees, the ids older than 2 s go at once and the others
// within 2 s.
func pastTheWindow(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	for _, window := range []time.Duration{2 * time.Second, time.Second} {
		testenv.EditStream(t, js, "EVENTS", func(c *jetstream.StreamConfig) { c.Duplicates = window })
	}
	time.Sleep(2500 * time.Millisecond)
}

// storedRow is a done row with its event id and stream sequence.
type storedRow struct {
	id      int64
	eventID string
	status  string
	seq     uint64
	lastErr string
}

func storedRows(t *testing.T, db *sql.DB) []storedRow {
	t.Helper()
	rows, err := db.Query(`SELECT id, event_id, status, coalesce(stream_seq, 0), coalesce(last_error, '') FROM event_queue ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []storedRow
	for rows.Next() {
		var r storedRow
		if err := rows.Scan(&r.id, &r.eventID, &r.status, &r.seq, &r.lastErr); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	return out
}

// checkOwnMessages checks that every done row of db is at a sequence whose
// message carries its event id, row id and origin, and that the stream
// holds each of its event ids once.
func checkOwnMessages(t *testing.T, js jetstream.JetStream, db *sql.DB, rows []storedRow) {
	t.Helper()
	var origin string
	if err := db.QueryRow(`SELECT origin FROM outbox_relay_published`).Scan(&origin); err != nil {
		t.Fatal(err)
	}
	bySeq := map[uint64]*jetstream.RawStreamMsg{}
	ids := map[string]int{}
	for _, m := range testenv.StreamMessages(t, js, "EVENTS") {
		bySeq[m.Sequence] = m
		ids[m.Header.Get(publish.HeaderMsgID)]++
	}
	for _, r := range rows {
		if r.status != "done" {
			continue
		}
		m := bySeq[r.seq]
		if m == nil || m.Header.Get(publish.HeaderMsgID) != r.eventID || m.Header.Get(publish.HeaderRowID) != strconv.FormatInt(r.id, 10) ||
			m.Header.Get(publish.HeaderOrigin) != origin {
			t.Fatalf("row %d (%s) done at sequence %d, which holds %v", r.id, r.eventID, r.seq, m)
		}
		if ids[r.eventID] != 1 {
			t.Fatalf("event %s of row %d stored %d times", r.eventID, r.id, ids[r.eventID])
		}
	}
}

// TestNothingStoredTwicePastTheWindow: rows stored by a relay that never
// settled them are found in the stream by the next leader and settled
// with their sequences, though the duplicate window has passed: nothing
// is published twice. Without the reconciliation the same run stores
// every one of them twice.
func TestNothingStoredTwicePastTheWindow(t *testing.T) {
	t.Parallel()
	for _, reconciled := range []bool{true, false} {
		t.Run(fmt.Sprint("reconciled=", reconciled), func(t *testing.T) {
			t.Parallel()
			const rows = 500
			n := testenv.StartNATS(t)
			js := n.JetStream(t)
			path := testenv.NewDB(t)
			app := testenv.AppDB(t, path)
			testenv.InsertN(t, app, rows, "Thing")
			publishUnsettled(t, n, path, rows)
			if c := testenv.Counts(t, app); c["pending"] != rows {
				t.Fatalf("rows after the relay that did not settle: %v", c)
			}
			pastTheWindow(t, js)
			ho := harnessOptions{window: time.Second}
			if !reconciled {
				ho.mutateOpt = func(o *relay.Options) { o.Reconcile = nil }
			}
			h := startRelay(t, path, n.URL(), ho)
			waitAllSettled(t, app, rows, 30*time.Second)
			stored := len(testenv.StreamMessages(t, js, "EVENTS"))
			if !reconciled {
				if stored != 2*rows {
					t.Fatalf("without reconciliation the stream holds %d messages, want every row twice (%d)", stored, 2*rows)
				}
				return
			}
			if stored != rows {
				t.Fatalf("the stream holds %d messages, want %d", stored, rows)
			}
			checkOwnMessages(t, js, app, storedRows(t, app))
			if err := h.stop(); err != nil {
				t.Fatal(err)
			}
			if got := metrics.Value(h.metrics.Reconciled); got != rows {
				t.Errorf("reconciled_rows_total %v, want %d", got, rows)
			}
			if got := metrics.Value(h.metrics.Published); got != 0 {
				t.Errorf("published_total %v, want 0: every row was published already", got)
			}
			if logCount(h, "reconciled the outbox with the stream; publishing") != 1 {
				t.Errorf("no line saying the reconciliation ended")
			}
		})
	}
}

// TestSharedStreamReconcilesItsOwn: two databases whose rows have the same
// ids publish to one stream, and neither settles; past the window each
// relay settles its own rows from its own messages only. A row of the
// second database that reuses an event id of the first is dead-lettered
// with a reason naming the other database's row, not marked done.
func TestSharedStreamReconcilesItsOwn(t *testing.T) {
	t.Parallel()
	const rows = 200
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	paths := []string{testenv.NewDB(t), testenv.NewDB(t)}
	apps := []*sql.DB{testenv.AppDB(t, paths[0]), testenv.AppDB(t, paths[1])}
	for _, app := range apps {
		testenv.InsertN(t, app, rows, "Thing")
	}
	publishUnsettled(t, n, paths[0], rows)
	// The second database's last row takes an event id of the first's.
	var reused string
	if err := apps[0].QueryRow(`SELECT event_id FROM event_queue WHERE id = 7`).Scan(&reused); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, apps[1], `UPDATE event_queue SET event_id = ? WHERE id = ?`, reused, rows)
	publishUnsettled(t, n, paths[1], 2*rows-1) // its reused id is dropped as a duplicate
	pastTheWindow(t, js)
	var wg sync.WaitGroup
	for _, p := range paths {
		wg.Add(1)
		go func() { defer wg.Done(); startRelay(t, p, n.URL(), harnessOptions{window: time.Second}) }()
	}
	wg.Wait()
	for _, app := range apps {
		waitAllSettled(t, app, rows, 30*time.Second)
	}
	if stored := len(testenv.StreamMessages(t, js, "EVENTS")); stored != 2*rows-1 {
		t.Fatalf("the stream holds %d messages, want the %d stored before", stored, 2*rows-1)
	}
	for i, app := range apps {
		all := storedRows(t, app)
		checkOwnMessages(t, js, app, all)
		for _, r := range all {
			switch {
			case i == 1 && r.id == rows:
				if r.status != "dead_lettered" || !strings.Contains(r.lastErr, "published for row 7 of another database (Outbox-Origin ") {
					t.Errorf("the row reusing another database's event id is %s (%q), want dead_lettered naming the other row", r.status, r.lastErr)
				}
			case r.status != "done":
				t.Errorf("database %d row %d is %s (%s)", i, r.id, r.status, r.lastErr)
			}
		}
	}
}

// TestReadyzSaysReconciling: while the reconciliation runs the relay is
// not ready, and /readyz says how far it got; remaining messages are on a
// gauge. Once it ends the relay is ready and publishes.
func TestReadyzSaysReconciling(t *testing.T) {
	t.Parallel()
	const rows = 300
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, rows, "Thing")
	publishUnsettled(t, n, path, rows)
	gate := make(chan struct{})
	var batches sync.WaitGroup
	batches.Add(1)
	var once sync.Once
	h := startRelay(t, path, n.URL(), harnessOptions{wrapStore: func(s relay.Store) relay.Store {
		return gatedReconcile{Store: s, gate: gate, first: func() { once.Do(batches.Done) }}
	}})
	batches.Wait() // the first batch is held
	var err error
	testenv.Eventually(t, 10*time.Second, "/readyz to say it reconciles", func() bool {
		err = h.app.Ready(context.Background())
		return err != nil && strings.Contains(err.Error(), "reconciling the outbox with the stream before publishing: ")
	})
	if !strings.Contains(err.Error(), "stream sequences left to read") {
		t.Errorf("/readyz while reconciling: %v", err)
	}
	if got := metrics.Value(h.metrics.ReconcileRemaining); got != rows {
		t.Errorf("reconcile_remaining_messages %v while the first batch is held, want %d", got, rows)
	}
	close(gate)
	waitAllSettled(t, app, rows, 30*time.Second)
	testenv.Eventually(t, 10*time.Second, "ready", func() bool { return h.app.Ready(context.Background()) == nil })
	if got := metrics.Value(h.metrics.ReconcileRemaining); got != 0 {
		t.Errorf("reconcile_remaining_messages %v after it ended", got)
	}
}

// gatedReconcile holds the reconciliation's settles (those that move the
// mark with rows) until gate is closed, calling first at the first.
type gatedReconcile struct {
	relay.Store
	gate  chan struct{}
	first func()
}

func (g gatedReconcile) Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) ([]int, error) {
	if scanFrom > 0 && len(outs) > 0 && outs[0].Settlement == event.Done && outs[0].Row.Payload == nil && outs[0].Row.EventType == "" {
		g.first()
		select {
		case <-g.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return g.Store.Settle(ctx, outs, scanFrom)
}

// unansweredOnce is a publisher whose first message is stored but whose
// answer is lost: it reports a timeout, late, as an ack lost in an
// outage would be.
type unansweredOnce struct {
	relay.Publisher
	once sync.Once
	late time.Duration
}

func (u *unansweredOnce) Publish(ctx context.Context, msgs []publish.Message) []publish.Ack {
	acks := u.Publisher.Publish(ctx, msgs)
	u.once.Do(func() { acks[0] = lostAck{Ack: acks[0], late: u.late} })
	return acks
}

type lostAck struct {
	publish.Ack
	late time.Duration
}

func (l lostAck) Wait(ctx context.Context) publish.Result {
	if res := l.Ack.Wait(ctx); res.Kind != publish.Stored {
		return res
	}
	time.Sleep(l.late)
	return publish.Result{Kind: publish.Transport, Err: fmt.Errorf("nats: timeout")}
}

// TestUnansweredPublishPastTheWindow: a row whose publish was stored but
// got no answer goes back to pending as in an outage; when it goes again
// the window has passed, and the relay finds its message first instead of
// storing it twice.
func TestUnansweredPublishPastTheWindow(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{window: time.Second,
		wrapPublisher: func(p relay.Publisher) relay.Publisher {
			return &unansweredOnce{Publisher: p, late: 2500 * time.Millisecond}
		}})
	testenv.InsertN(t, app, 1, "Thing")
	waitAllSettled(t, app, 1, 30*time.Second)
	if msgs := testenv.StreamMessages(t, js, "EVENTS"); len(msgs) != 1 {
		t.Fatalf("the stream holds %d messages, want the row's once", len(msgs))
	}
	checkOwnMessages(t, js, app, storedRows(t, app))
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	if got := metrics.Value(h.metrics.Reconciled); got != 1 {
		t.Errorf("reconciled_rows_total %v, want the row found after the outage", got)
	}
}
