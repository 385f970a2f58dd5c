package ledger_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/ledger"
)

type ledgerRow struct {
	Status    string
	StartedAt sql.NullInt64
	Processed sql.NullInt64
}

func readRow(t *testing.T, db *sql.DB, eventID, handler string) (r ledgerRow, found bool) {
	t.Helper()
	err := db.QueryRow(`SELECT status, started_at, processed_at FROM processed_events WHERE event_id = ? AND handler = ?`, eventID, handler).
		Scan(&r.Status, &r.StartedAt, &r.Processed)
	if errors.Is(err, sql.ErrNoRows) {
		return r, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return r, true
}

func TestClaimDoneAndRelease(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	clk := newClock(time.Now())
	l := ledger.New(db, ledger.Options{Now: clk.Now})

	c, state, _, err := l.Claim(ctx, "ev-1", "mailer")
	if err != nil || state != ledger.Claimed || c == nil || c.Token != clk.Now().UnixMilli() {
		t.Fatalf("first claim: %v %v %+v", state, err, c)
	}
	if r, _ := readRow(t, db, "ev-1", "mailer"); r.Status != "in_progress" || r.StartedAt.Int64 != c.Token || r.Processed.Int64 != c.Token {
		t.Fatalf("claimed row %+v; want its token in started_at and its first heartbeat in processed_at", r)
	}
	// Another process while the claim is fresh: busy until its heartbeat
	// could go stale.
	clk.Add(10 * time.Second)
	if _, state, until, err := l.Claim(ctx, "ev-1", "mailer"); err != nil || state != ledger.Busy || !until.Equal(time.UnixMilli(c.Token).Add(ledger.DefaultStaleAfter+time.Millisecond)) {
		t.Fatalf("claim of a held claim: %v until %v (%v)", state, until, err)
	}
	if err := c.Done(ctx); err != nil {
		t.Fatal(err)
	}
	if r, _ := readRow(t, db, "ev-1", "mailer"); r.Status != "done" || r.Processed.Int64 != clk.Now().UnixMilli() {
		t.Fatalf("done row %+v", r)
	}
	// Done is done, however old.
	clk.Add(24 * time.Hour)
	if _, state, _, err := l.Claim(ctx, "ev-1", "mailer"); err != nil || state != ledger.AlreadyDone {
		t.Fatalf("claim after done: %v (%v)", state, err)
	}
	// Another handler of the same event has a row of its own.
	c2, state, _, err := l.Claim(ctx, "ev-1", "indexer")
	if err != nil || state != ledger.Claimed {
		t.Fatalf("second handler: %v (%v)", state, err)
	}
	if err := c2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, found := readRow(t, db, "ev-1", "indexer"); found {
		t.Fatal("a released claim left its row")
	}
	if _, state, _, err := l.Claim(ctx, "ev-1", "indexer"); err != nil || state != ledger.Claimed {
		t.Fatalf("claim after release: %v (%v)", state, err)
	}
}

// TestStaleWorkerCannotClobber: once a claim's lease expired and another
// process took it over, the first holder can neither mark it done nor
// release it; the new holder can.
func TestStaleWorkerCannotClobber(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	clk := newClock(time.Now())
	lease := 10 * time.Second
	l := ledger.New(db, ledger.Options{Now: clk.Now, Lease: lease})
	stale, _, _, err := l.Claim(ctx, "ev-2", "h")
	if err != nil {
		t.Fatal(err)
	}
	clk.Add(lease + time.Millisecond)
	fresh, state, _, err := l.Claim(ctx, "ev-2", "h")
	if err != nil || state != ledger.Claimed || fresh.Token <= stale.Token {
		t.Fatalf("takeover: %v (%v), token %d after %d", state, err, fresh.Token, stale.Token)
	}
	if err := stale.Done(ctx); !errors.Is(err, ledger.ErrClaimLost) {
		t.Fatalf("stale Done = %v; want ErrClaimLost", err)
	}
	if err := stale.Release(ctx); !errors.Is(err, ledger.ErrClaimLost) {
		t.Fatalf("stale Release = %v; want ErrClaimLost", err)
	}
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	if err := stale.DoneTx(ctx, tx); !errors.Is(err, ledger.ErrClaimLost) {
		t.Fatalf("stale DoneTx = %v; want ErrClaimLost", err)
	}
	tx.Rollback()
	if r, _ := readRow(t, db, "ev-2", "h"); r.Status != "in_progress" || r.StartedAt.Int64 != fresh.Token {
		t.Fatalf("the stale worker changed the new claim: %+v", r)
	}
	if err := fresh.Done(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestTakeoverTokenMovesOn: a claim whose started_at is ahead of the
// taker's clock (another host's clock) or NULL is still taken over with a
// token unlike the old one.
func TestTakeoverTokenMovesOn(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	clk := newClock(time.Now())
	l := ledger.New(db, ledger.Options{Now: clk.Now, Lease: time.Millisecond})
	now := clk.Now().UnixMilli()
	testenv.MustExec(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at) VALUES ('a', 'h', 'in_progress', NULL), ('b', 'h', 'in_progress', ?)`, now-2)
	for _, id := range []string{"a", "b"} {
		c, state, _, err := l.Claim(ctx, id, "h")
		if err != nil || state != ledger.Claimed || c.Token != now {
			t.Fatalf("%s: %v (%v) %+v", id, state, err, c)
		}
	}
	// Held exactly as long as the lease: still held, until a millisecond
	// later.
	testenv.MustExec(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at) VALUES ('c', 'h', 'in_progress', ?)`, now-1)
	_, state, until, err := l.Claim(ctx, "c", "h")
	if err != nil || state != ledger.Busy || until.UnixMilli() != now+1 {
		t.Fatalf("c: %v until %v (%v); want busy until %v", state, until, err, time.UnixMilli(now+1))
	}
	clk.Add(time.Millisecond)
	if _, state, _, err := l.Claim(ctx, "c", "h"); err != nil || state != ledger.Claimed {
		t.Fatalf("c at its expiry: %v (%v); want claimed", state, err)
	}
}

// TestDispatch runs an event through two handlers: both run once; the
// next delivery skips both; a failing handler is released and reported,
// and runs again on the next delivery, while the one that succeeded is
// skipped.
func TestDispatch(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	reg := prometheus.NewRegistry()
	h := handlersWith(t, db, ledger.Options{}, reg)
	var fails atomic.Bool
	fails.Store(true)
	var plain atomic.Int64
	h.HandleTx("OrderPlaced", "record", func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO effects (event_id, handler) VALUES (?, 'record')`, ev.ID)
		return err
	})
	h.Handle("OrderPlaced", "notify", func(ctx context.Context, ev ledger.Event) error {
		plain.Add(1)
		if fails.Load() {
			return errors.New("mail server down")
		}
		return nil
	})
	ev := ledger.Event{ID: "ev-3", Type: "OrderPlaced", Data: []byte(`{}`), Delivery: 1}
	v, err := h.Dispatch(ctx, ev)
	if err != nil || v.Done() || len(v.Failed) != 1 || v.Failed[0].Handler != "notify" || !strings.Contains(v.Failed[0].Error(), "mail server down") {
		t.Fatalf("first delivery: %+v (%v)", v, err)
	}
	if _, found := readRow(t, db, "ev-3", "notify"); found {
		t.Fatal("the failed handler's claim was not released")
	}
	fails.Store(false)
	ev.Delivery = 2
	if v, err := h.Dispatch(ctx, ev); err != nil || !v.Done() {
		t.Fatalf("second delivery: %+v (%v)", v, err)
	}
	ev.Delivery = 3
	if v, err := h.Dispatch(ctx, ev); err != nil || !v.Done() {
		t.Fatalf("third delivery: %+v (%v)", v, err)
	}
	var effects int
	db.QueryRow(`SELECT count(*) FROM effects`).Scan(&effects)
	if effects != 1 || plain.Load() != 2 {
		t.Fatalf("%d effects of record (want 1), notify ran %d times (want 2)", effects, plain.Load())
	}
	for handler, want := range map[string]map[string]float64{
		"record": {"handled": 1, "skipped": 2},
		"notify": {"failed": 1, "handled": 1, "skipped": 1},
	} {
		for outcome, n := range want {
			if got := metricValue(t, reg, "outbox_ledger_handled_total", "handler", handler, "outcome", outcome); got != n {
				t.Errorf("%s %s = %v; want %v", handler, outcome, got, n)
			}
		}
	}
	// Every run is timed: record ran once, notify twice.
	for handler, want := range map[string]uint64{"record": 1, "notify": 2} {
		if got := durationSamples(t, reg, handler); got != want {
			t.Errorf("%s duration samples = %d; want %d", handler, got, want)
		}
	}
	// An event of a type nobody handles is done at once.
	if v, err := h.Dispatch(ctx, ledger.Event{ID: "ev-4", Type: "Unknown"}); err != nil || !v.Done() {
		t.Fatalf("unhandled type: %+v (%v)", v, err)
	}
}

// TestLedgerErrorRunsNoHandler: when the ledger cannot be read, no
// handler runs and Dispatch returns the error.
func TestLedgerErrorRunsNoHandler(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	h := handlersWith(t, db, ledger.Options{}, nil)
	var ran atomic.Int64
	h.Handle("T", "h", func(context.Context, ledger.Event) error { ran.Add(1); return nil })
	testenv.MustExec(t, db, `ALTER TABLE processed_events RENAME TO processed_events_away`)
	if _, err := h.Dispatch(ctx, ledger.Event{ID: "ev-5", Type: "T"}); err == nil || !strings.Contains(err.Error(), "processed_events") {
		t.Fatalf("Dispatch without the ledger table = %v; want an error naming it", err)
	}
	if ran.Load() != 0 {
		t.Fatal("a handler ran without its claim")
	}
}

// TestEventWithoutIDSkipsTheLedger: an event with no id runs its handlers
// on every delivery, writes no ledger row, and is counted.
func TestEventWithoutIDSkipsTheLedger(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	reg := prometheus.NewRegistry()
	h := handlersWith(t, db, ledger.Options{}, reg)
	var ran atomic.Int64
	h.Handle("T", "h", func(context.Context, ledger.Event) error { ran.Add(1); return nil })
	for range 2 {
		if v, err := h.Dispatch(ctx, ledger.Event{Type: "T"}); err != nil || !v.Done() {
			t.Fatalf("%+v (%v)", v, err)
		}
	}
	var rows int
	db.QueryRow(`SELECT count(*) FROM processed_events`).Scan(&rows)
	if ran.Load() != 2 || rows != 0 {
		t.Fatalf("ran %d times (want 2), %d ledger rows (want 0)", ran.Load(), rows)
	}
	if got := metricValue(t, reg, "outbox_ledger_events_without_id_total"); got != 2 {
		t.Fatalf("events without id counted %v; want 2", got)
	}
}

// metricValue sums the counters named name in reg whose labels include
// the given name, value pairs.
func metricValue(t testing.TB, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue metrics
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// TestTxHandlerWithoutID: a HandleTx handler of an event with no id runs in
// a transaction of its own, committed, on every delivery.
func TestTxHandlerWithoutID(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.HandleTx("T", "h", func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO effects (handler) VALUES ('h')`)
		return err
	})
	for range 2 {
		if v, err := h.Dispatch(ctx, ledger.Event{Type: "T"}); err != nil || !v.Done() {
			t.Fatalf("%+v (%v)", v, err)
		}
	}
	var n int
	db.QueryRow(`SELECT count(*) FROM effects`).Scan(&n)
	if n != 2 {
		t.Fatalf("%d effects; want one per delivery", n)
	}
}

// TestDispatchStopsAtABusyHandler: when another delivery holds a handler's
// claim, the handlers after it are left to that delivery.
func TestDispatchStopsAtABusyHandler(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	h := handlersWith(t, db, ledger.Options{}, nil)
	var later atomic.Int64
	h.Handle("T", "first", func(context.Context, ledger.Event) error { return nil })
	h.Handle("T", "second", func(context.Context, ledger.Event) error { later.Add(1); return nil })
	testenv.MustExec(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at) VALUES ('ev-6', 'first', 'in_progress', ?)`, time.Now().UnixMilli())
	v, err := h.Dispatch(ctx, ledger.Event{ID: "ev-6", Type: "T"})
	if err != nil || v.Done() || len(v.Busy) != 1 || v.Busy[0] != "first" || later.Load() != 0 {
		t.Fatalf("verdict %+v (%v), second ran %d times; want first busy and second left alone", v, err, later.Load())
	}
}

// durationSamples counts outbox_ledger_handler_duration_seconds samples
// of handler in reg.
func durationSamples(t testing.TB, reg prometheus.Gatherer, handler string) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "outbox_ledger_handler_duration_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "handler" && l.GetValue() == handler {
					return m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return 0
}

// TestDispatchAfterAPlainHandlerTakenOver: a plain handler's claim is
// taken over while it runs (by a process whose clock finds it stale). Its
// done mark is lost; the handlers after it did not run in this delivery,
// so the verdict is not done: the event comes again once the new owner's
// claim could go stale, as for a busy handler, and is not acknowledged
// while a handler after the lost one has never run.
func TestDispatchAfterAPlainHandlerTakenOver(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	h := handlersWith(t, db, ledger.Options{}, nil)
	later := ledger.New(db, ledger.Options{Now: func() time.Time { return time.Now().Add(time.Hour) }})
	running, finish := make(chan struct{}), make(chan struct{})
	var second atomic.Int64
	h.Handle("T", "first", func(context.Context, ledger.Event) error { close(running); <-finish; return nil })
	h.Handle("T", "second", func(context.Context, ledger.Event) error { second.Add(1); return nil })
	type result struct {
		v   ledger.Verdict
		err error
	}
	out := make(chan result, 1)
	go func() {
		v, err := h.Dispatch(ctx, ledger.Event{ID: "ev-lost", Type: "T"})
		out <- result{v, err}
	}()
	<-running
	if _, state, _, err := later.Claim(ctx, "ev-lost", "first"); err != nil || state != ledger.Claimed {
		t.Fatalf("take the claim over: %v (%v)", state, err)
	}
	close(finish)
	r := <-out
	if r.err != nil || r.v.Done() || len(r.v.Busy) != 1 || r.v.Busy[0] != "first" || r.v.BusyUntil.IsZero() {
		t.Fatalf("verdict %+v (%v); want first busy until its new claim could go stale", r.v, r.err)
	}
	if n := second.Load(); n != 0 {
		t.Errorf("second ran %d times in the delivery whose first handler was taken over", n)
	}
}

// TestHandleTxRolledBackBySQLite: a transactional handler ignores the
// error of a statement SQLite interrupted (its own deadline), which rolled
// the whole transaction back, and returns nil. The handler has failed: its
// effect is gone, and no done mark commits on its own.
func TestHandleTxRolledBackBySQLite(t *testing.T) {
	ctx := context.Background()
	db := appDB(t)
	testenv.MustExec(t, db, `CREATE TABLE counter (n INTEGER)`)
	testenv.MustExec(t, db, `INSERT INTO counter VALUES (0)`)
	h := handlersWith(t, db, ledger.Options{}, nil)
	h.HandleTx("T", "count", func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		if _, err := tx.ExecContext(ctx, `UPDATE counter SET n = n + 1`); err != nil {
			return err
		}
		// Best effort, with a deadline far shorter than the statement:
		// its error is ignored.
		short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
		defer cancel()
		_, _ = tx.ExecContext(short, `WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 1000000000)
INSERT INTO effects (event_id) SELECT NULL FROM c WHERE x < 0`)
		return nil
	})
	v, err := h.Dispatch(ctx, ledger.Event{ID: "ev-interrupted", Type: "T"})
	if err != nil || len(v.Failed) != 1 || v.Failed[0].Handler != "count" {
		t.Fatalf("verdict %+v (%v); want count failed", v, err)
	}
	if n := count(t, db, `SELECT n FROM counter`); n != 0 {
		t.Errorf("counter %d, want 0: the transaction was rolled back", n)
	}
	if r, found := readRow(t, db, "ev-interrupted", "count"); found && r.Status == "done" {
		t.Errorf("the ledger says done; the handler's effect never committed")
	}
}
