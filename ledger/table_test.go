package ledger_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/ledger"
)

// wait bounds every condition a test polls for.
const wait = 10 * time.Second

// clock is a settable clock, read by the source's goroutine.
type clock struct{ ms atomic.Int64 }

func newClock(t time.Time) *clock {
	c := &clock{}
	c.ms.Store(t.UnixMilli())
	return c
}

func (c *clock) Now() time.Time              { return time.UnixMilli(c.ms.Load()) }
func (c *clock) Add(d time.Duration)         { c.ms.Add(d.Milliseconds()) }
func (c *clock) Set(t time.Time)             { c.ms.Store(t.UnixMilli()) }
func (c *clock) Ms() int64                   { return c.ms.Load() }
func (c *clock) After(d time.Duration) int64 { return c.Now().Add(d).UnixMilli() }

// appDB is a migrated outbox file as the application opens it, with a
// table for handlers' effects.
func appDB(t *testing.T) *sql.DB {
	t.Helper()
	db := testenv.AppDB(t, testenv.NewDB(t))
	effectsTable(t, db)
	return db
}

// effectsTable creates the table recordTx writes handlers' effects to.
func effectsTable(t *testing.T, db *sql.DB) {
	t.Helper()
	testenv.MustExec(t, db, `CREATE TABLE effects (event_id TEXT, handler TEXT, payload BLOB, delivery INTEGER)`)
}

// newHandlers returns Handlers on db, the ledger on clk (time.Now when nil).
func newHandlers(t *testing.T, db *sql.DB, clk *clock, lease time.Duration) *ledger.Handlers {
	t.Helper()
	o := ledger.Options{Lease: lease}
	if clk != nil {
		o.Now = clk.Now
	}
	return handlersWith(t, db, o, nil)
}

// recordTx is a HandleTx handler that writes its effect in the ledger's
// transaction.
func recordTx(name string) ledger.TxHandlerFunc {
	return func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		var id any
		if ev.ID != "" {
			id = ev.ID
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO effects (event_id, handler, payload, delivery) VALUES (?, ?, ?, ?)`, id, name, ev.Data, ev.Delivery)
		return err
	}
}

// running is a TableSource's Run in its own goroutine.
type running struct {
	cancel context.CancelFunc
	done   chan error
}

func start(t *testing.T, db *sql.DB, h *ledger.Handlers, o ledger.TableOptions) (*ledger.TableSource, *running) {
	t.Helper()
	if o.PollInterval == 0 {
		o.PollInterval = 10 * time.Millisecond
	}
	if o.Log == nil {
		o.Log = zaptest.NewLogger(t)
	}
	s, err := ledger.NewTableSource(db, h, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-r.done })
	return s, r
}

// result waits for Run to return.
func (r *running) result(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return err
	case <-time.After(wait):
		t.Fatal("Run did not return")
		return nil
	}
}

// stop cancels Run and returns its result.
func (r *running) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	return r.result(t)
}

type outboxRow struct {
	Status                   string
	Attempts                 int
	AvailableAt, ProcessedAt sql.NullInt64
	ClaimedAt                sql.NullInt64
	ClaimedBy, LastError     sql.NullString
}

func rowOf(t *testing.T, db *sql.DB, id int64) outboxRow {
	t.Helper()
	var r outboxRow
	err := db.QueryRow(`SELECT status, attempts, available_at, processed_at, claimed_at, claimed_by, last_error FROM event_queue WHERE id = ?`, id).
		Scan(&r.Status, &r.Attempts, &r.AvailableAt, &r.ProcessedAt, &r.ClaimedAt, &r.ClaimedBy, &r.LastError)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func count(t *testing.T, db *sql.DB, q string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// probe inserts a row of type Probe and waits until it is done: the
// source has claimed after everything the test did before it, and every
// row before it in id order was seen by that claim or an earlier one.
func probe(t *testing.T, db *sql.DB) {
	t.Helper()
	id := testenv.InsertIDs(t, db, testenv.NewEvent("Probe", []byte("probe")))[0]
	testenv.Eventually(t, wait, "the probe row handled", func() bool { return rowOf(t, db, id).Status == "done" })
}

func TestTableSourceHandlesEveryRowOnceAndMarksItDone(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	h.HandleTx("Thing", "count", recordTx("count"))
	var evs []testenv.Event
	for i := range 25 {
		evs = append(evs, testenv.NewEvent("Thing", fmt.Appendf(nil, "p%d", i)))
	}
	// A row without an event id runs its handlers without the ledger.
	var noID atomic.Value
	h.Handle("NoID", "no-id", func(ctx context.Context, ev ledger.Event) error {
		noID.Store(fmt.Sprintf("id=%q data=%q delivery=%d", ev.ID, ev.Data, ev.Delivery))
		return nil
	})
	evs = append(evs,
		testenv.Event{EventType: "NoID", Payload: []byte("no id")}, // event_id NULL
		testenv.NewEvent("Unhandled", []byte("x")),
	)
	if err := testenv.Insert(db, evs...); err != nil {
		t.Fatal(err)
	}
	s, r := start(t, db, h, ledger.TableOptions{Batch: 10})
	if !strings.HasPrefix(s.ID(), "table-source-") {
		t.Fatalf("ID() = %q", s.ID())
	}
	testenv.Eventually(t, wait, "every row done", func() bool { return testenv.Counts(t, db)["done"] == 27 })

	// Rows written while the source runs are picked up too.
	more := []testenv.Event{testenv.NewEvent("Thing", []byte("late 1")), testenv.NewEvent("Thing", []byte("late 2"))}
	if err := testenv.Insert(db, more...); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, wait, "the late rows done", func() bool { return testenv.Counts(t, db)["done"] == 29 })
	if err := r.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}

	for _, ev := range slices.Concat(evs[:25], more) {
		var n, delivery int
		var payload []byte
		if err := db.QueryRow(`SELECT count(*), max(delivery), max(payload) FROM effects WHERE event_id = ?`, *ev.EventID).Scan(&n, &delivery, &payload); err != nil {
			t.Fatal(err)
		}
		if n != 1 || delivery != 1 || string(payload) != string(ev.Payload) {
			t.Fatalf("event %s: %d effects, delivery %d, payload %q; want 1, 1, %q", *ev.EventID, n, delivery, payload, ev.Payload)
		}
	}
	if got, want := noID.Load(), `id="" data="no id" delivery=1`; got != want {
		t.Fatalf("the row without an event id was handled as %v; want %s", got, want)
	}
	if n := count(t, db, `SELECT count(*) FROM effects`); n != 27 {
		t.Fatalf("%d effects, want 27", n)
	}
	if n := count(t, db, `SELECT count(*) FROM processed_events WHERE handler = 'count' AND status = 'done'`); n != 27 {
		t.Fatalf("%d ledger rows done, want 27", n)
	}
	if n := count(t, db, `SELECT count(*) FROM event_queue WHERE processed_at IS NULL OR claimed_by IS NOT NULL OR claimed_at IS NOT NULL OR attempts <> 0`); n != 0 {
		t.Fatalf("%d done rows without processed_at, with a claim left or with attempts spent", n)
	}

	// Delivered again (an operator's retry), the ledger skips every
	// handler that ran: the rows end done, with no second effect.
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'pending', processed_at = NULL WHERE event_id IS NOT NULL`)
	start(t, db, h, ledger.TableOptions{})
	testenv.Eventually(t, wait, "every row done again", func() bool { return testenv.Counts(t, db)["done"] == 29 })
	if n := count(t, db, `SELECT count(*) FROM effects`); n != 27 {
		t.Fatalf("%d effects after a redelivery, want 27 still", n)
	}
}

func TestTableSourceRetriesOnTheBackoffAndDeadLettersAtMaxAttempts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		backoff func(int) time.Duration
	}{
		{"default backoff", nil},
		{"scaled backoff", func(n int) time.Duration { return time.Duration(n) * 7 * time.Minute }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := tc.backoff
			if want == nil {
				want = ledger.Backoff
			}
			db := appDB(t)
			clk := newClock(time.Now().Add(time.Hour)) // every row written now is due
			h := newHandlers(t, db, clk, 0)
			var mu sync.Mutex
			var deliveries []int
			h.Handle("Thing", "fails", func(ctx context.Context, ev ledger.Event) error {
				mu.Lock()
				defer mu.Unlock()
				deliveries = append(deliveries, ev.Delivery)
				return errors.New("boom")
			})
			h.Handle("Probe", "probe", func(context.Context, ledger.Event) error { return nil })
			seen := func() []int { mu.Lock(); defer mu.Unlock(); return slices.Clone(deliveries) }

			id := testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("x")))[0]
			start(t, db, h, ledger.TableOptions{MaxAttempts: 3, Backoff: tc.backoff, Now: clk.Now})

			for attempt := 1; attempt < 3; attempt++ {
				testenv.Eventually(t, wait, fmt.Sprintf("attempt %d spent", attempt), func() bool { return rowOf(t, db, id).Attempts == attempt })
				row := rowOf(t, db, id)
				if row.Status != "pending" || row.AvailableAt.Int64 != clk.After(want(attempt)) || !strings.Contains(row.LastError.String, "fails: boom") || row.ClaimedBy.Valid {
					t.Fatalf("after attempt %d: %+v; want pending, available at now+%v, last_error fails: boom, no claim", attempt, row, want(attempt))
				}
				// A millisecond before it is due, it is not delivered.
				clk.Add(want(attempt) - time.Millisecond)
				probe(t, db)
				if got := seen(); len(got) != attempt {
					t.Fatalf("deliveries %v before the backoff passed; want %d", got, attempt)
				}
				clk.Add(time.Millisecond)
			}
			testenv.Eventually(t, wait, "the row dead-lettered", func() bool { return rowOf(t, db, id).Status == "dead_lettered" })
			row := rowOf(t, db, id)
			if row.Attempts != 3 || row.ProcessedAt.Int64 != clk.Ms() || !strings.Contains(row.LastError.String, "fails: boom") || row.ClaimedBy.Valid {
				t.Fatalf("dead-lettered row %+v; want 3 attempts, processed_at now, last_error fails: boom, no claim", row)
			}
			clk.Add(time.Hour)
			probe(t, db)
			if got := seen(); !slices.Equal(got, []int{1, 2, 3}) {
				t.Fatalf("deliveries %v, want [1 2 3]", got)
			}
			if n := count(t, db, `SELECT count(*) FROM processed_events WHERE handler = 'fails'`); n != 0 {
				t.Fatalf("%d ledger rows for the failing handler; its claims must be released", n)
			}
		})
	}
}

func TestTableSourceSpendsAnAttemptWhenTheLedgerFails(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	ran := atomic.Int32{}
	h.Handle("Thing", "count", func(context.Context, ledger.Event) error { ran.Add(1); return nil })
	testenv.MustExec(t, db, `DROP TABLE processed_events`)
	id := testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("x")))[0]
	start(t, db, h, ledger.TableOptions{})
	testenv.Eventually(t, wait, "an attempt spent", func() bool { return rowOf(t, db, id).Attempts == 1 })
	row := rowOf(t, db, id)
	if row.Status != "pending" || !strings.Contains(row.LastError.String, "processed_events") || ran.Load() != 0 {
		t.Fatalf("row %+v, handler ran %d times; want pending with the ledger's error, handler not run", row, ran.Load())
	}
}

func TestTableSourceDefersARowWhoseLedgerClaimIsHeldElsewhere(t *testing.T) {
	db := appDB(t)
	clk := newClock(time.Now().Add(time.Hour))
	h := newHandlers(t, db, clk, time.Minute)
	h.HandleTx("Thing", "count", recordTx("count"))
	ev := testenv.NewEvent("Thing", []byte("x"))
	id := testenv.InsertIDs(t, db, ev)[0]
	// Another process is running the handler on this event.
	started := clk.Ms() - 1000
	testenv.MustExec(t, db, `INSERT INTO processed_events (event_id, handler, status, started_at) VALUES (?, 'count', 'in_progress', ?)`, *ev.EventID, started)
	start(t, db, h, ledger.TableOptions{Now: clk.Now})

	until := started + time.Minute.Milliseconds() + 1 // taken over a millisecond after the lease
	testenv.Eventually(t, wait, "the row deferred", func() bool { return rowOf(t, db, id).AvailableAt.Int64 == until })
	row := rowOf(t, db, id)
	if row.Status != "pending" || row.Attempts != 0 || row.LastError.Valid || row.ClaimedBy.Valid {
		t.Fatalf("deferred row %+v; want pending, no attempt spent, no error, no claim", row)
	}
	if n := count(t, db, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("%d effects while the claim is held elsewhere", n)
	}

	// Once that claim's lease has expired, the source takes it over.
	clk.Set(time.UnixMilli(until).Add(time.Second))
	testenv.Eventually(t, wait, "the row done", func() bool { return rowOf(t, db, id).Status == "done" })
	if row := rowOf(t, db, id); row.Attempts != 0 {
		t.Fatalf("done row %+v; want no attempt spent", row)
	}
	if n := count(t, db, `SELECT count(*) FROM effects WHERE event_id = ?`, *ev.EventID); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

func TestTableSourceTakesBackRowsWhoseClaimOutlivedTheLease(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	h.HandleTx("Thing", "count", recordTx("count"))
	stale := testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("stale")))[0]
	noTime := testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("no claim time")))[0]
	fresh := testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("fresh")))[0]
	now := time.Now()
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'processing', claimed_by = 'crashed', claimed_at = ? WHERE id = ?`,
		now.Add(-ledger.DefaultTableLease-time.Second).UnixMilli(), stale)
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'processing', claimed_by = 'crashed', claimed_at = NULL WHERE id = ?`, noTime)
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'processing', claimed_by = 'alive', claimed_at = ? WHERE id = ?`, now.UnixMilli(), fresh)
	start(t, db, h, ledger.TableOptions{})

	testenv.Eventually(t, wait, "the expired claims handled", func() bool {
		return rowOf(t, db, stale).Status == "done" && rowOf(t, db, noTime).Status == "done"
	})
	probe(t, db)
	if row := rowOf(t, db, fresh); row.Status != "processing" || row.ClaimedBy.String != "alive" || row.ClaimedAt.Int64 != now.UnixMilli() {
		t.Fatalf("a claim within its lease was touched: %+v", row)
	}
	if n := count(t, db, `SELECT count(*) FROM effects WHERE CAST(payload AS TEXT) IN ('stale', 'no claim time')`); n != 2 {
		t.Fatalf("%d effects of the taken-back rows, want 2", n)
	}
	if n := count(t, db, `SELECT count(*) FROM effects WHERE CAST(payload AS TEXT) = 'fresh'`); n != 0 {
		t.Fatalf("the row claimed elsewhere was handled")
	}
}

func heartbeat(t *testing.T, db *sql.DB, instance, host string, pid int, at time.Time) {
	t.Helper()
	testenv.MustExec(t, db, `INSERT INTO outbox_relay_instances (instance_id, started_at, heartbeat_at, hostname, pid, version) VALUES (?1, ?2, ?2, ?3, ?4, 'test')
ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at`, instance, at.UnixMilli(), host, pid)
}

func TestTableSourceRefusesToStartWhileARelayHeartbeats(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	var ran atomic.Int32
	h.Handle("Thing", "count", func(context.Context, ledger.Event) error { ran.Add(1); return nil })
	id := testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("x")))[0]
	heartbeat(t, db, "relay-1", "relay-host", 4242, time.Now().Add(-time.Second))

	s, err := ledger.NewTableSource(db, h, ledger.TableOptions{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	err = s.Run(ctx)
	if !errors.Is(err, ledger.ErrRelayRunning) {
		t.Fatalf("Run = %v; want ErrRelayRunning", err)
	}
	for _, want := range []string{"relay-1", `"relay-host"`, "pid 4242", "must not both consume the same table", "event_queue"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
	if row := rowOf(t, db, id); row.Status != "pending" || row.ClaimedBy.Valid || ran.Load() != 0 {
		t.Fatalf("a refused source touched the row: %+v, handler ran %d times", row, ran.Load())
	}

	// A heartbeat older than RelayStaleAfter is a relay that is gone.
	heartbeat(t, db, "relay-1", "relay-host", 4242, time.Now().Add(-ledger.RelayStaleAfter-time.Second))
	_, r := start(t, db, h, ledger.TableOptions{})
	testenv.Eventually(t, wait, "the row done", func() bool { return rowOf(t, db, id).Status == "done" })
	if err := r.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

func TestTableSourceStopsWhenARelayStartsHeartbeating(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	entered, proceed := make(chan struct{}), make(chan struct{})
	var ran atomic.Int32
	// Not a HandleTx handler: its transaction would hold the write lock
	// the test's heartbeat needs.
	h.Handle("Thing", "count", func(ctx context.Context, ev ledger.Event) error {
		if ran.Add(1) == 1 {
			close(entered)
			<-proceed
		}
		return nil
	})
	var ids []int64
	for range 3 {
		ids = append(ids, testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("x")))[0])
	}
	_, r := start(t, db, h, ledger.TableOptions{})
	<-entered
	heartbeat(t, db, "relay-2", "late-host", 77, time.Now())
	close(proceed)

	err := r.result(t)
	if !errors.Is(err, ledger.ErrRelayRunning) || !strings.Contains(err.Error(), `"late-host"`) {
		t.Fatalf("Run = %v; want ErrRelayRunning naming late-host", err)
	}
	if row := rowOf(t, db, ids[0]); row.Status != "done" {
		t.Fatalf("the row being handled was not finished: %+v", row)
	}
	for _, id := range ids[1:] {
		if row := rowOf(t, db, id); row.Status != "pending" || row.Attempts != 0 || row.ClaimedBy.Valid || row.ClaimedAt.Valid {
			t.Fatalf("an unstarted row was not put back as it was: %+v", row)
		}
	}
	if ran.Load() != 1 {
		t.Fatalf("handler ran %d times after the relay appeared; want only the row under way", ran.Load())
	}
}

func TestTableSourceShutdownFinishesTheRowUnderWayAndReleasesTheRest(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	entered, proceed := make(chan struct{}), make(chan struct{})
	var ran atomic.Int32
	var ctxErr atomic.Value
	h.Handle("Thing", "count", func(ctx context.Context, ev ledger.Event) error {
		if ran.Add(1) == 1 {
			close(entered)
			<-proceed
			ctxErr.Store(fmt.Sprint(ctx.Err()))
		}
		return nil
	})
	var ids []int64
	for range 5 {
		ids = append(ids, testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("x")))[0])
	}
	_, r := start(t, db, h, ledger.TableOptions{Batch: 10})
	<-entered
	if n := testenv.Counts(t, db)["processing"]; n != 5 {
		t.Fatalf("%d rows processing while the first is handled, want the batch of 5", n)
	}
	r.cancel()
	close(proceed)
	if err := r.result(t); err != nil {
		t.Fatalf("Run = %v after its context ended; want nil", err)
	}
	if got := ctxErr.Load(); got != "<nil>" {
		t.Fatalf("the handler's context was cancelled by the shutdown: %v", got)
	}
	if row := rowOf(t, db, ids[0]); row.Status != "done" {
		t.Fatalf("the row being handled was not settled: %+v", row)
	}
	for _, id := range ids[1:] {
		if row := rowOf(t, db, id); row.Status != "pending" || row.Attempts != 0 || row.ClaimedBy.Valid || row.ClaimedAt.Valid {
			t.Fatalf("an unstarted row was not put back as it was: %+v", row)
		}
	}
	if n := testenv.Counts(t, db)["processing"]; n != 0 {
		t.Fatalf("%d rows left processing", n)
	}
	if ran.Load() != 1 {
		t.Fatalf("handler ran %d times; want only the row under way", ran.Load())
	}
}

func TestNewTableSourceRejectsWhatItCannotWorkWith(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	if _, err := ledger.NewTableSource(db, h, ledger.TableOptions{Table: "event_queue; DROP TABLE x"}); err == nil || !strings.Contains(err.Error(), "plain SQL identifier") {
		t.Fatalf("a table name that is no identifier: %v", err)
	}
	if _, err := ledger.NewTableSource(nil, h, ledger.TableOptions{}); err == nil {
		t.Fatal("no error without a database")
	}
	testenv.MustExec(t, db, `CREATE TABLE bare (id INTEGER PRIMARY KEY, event_type TEXT, payload BLOB, status TEXT, available_at INTEGER)`)
	s, err := ledger.NewTableSource(db, h, ledger.TableOptions{Table: "bare"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	err = s.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "claimed_by") || !strings.Contains(err.Error(), "outbox-relay migrate") {
		t.Fatalf("Run on a table without the relay's columns = %v; want an error naming them", err)
	}
}

// TestTableSourcesNeverHandleARowTwice: a batch that takes longer than
// the lease loses its later rows to another source, which takes them
// back; no row without an event id (no ledger to stop a second run) is
// handled twice.
func TestTableSourcesNeverHandleARowTwice(t *testing.T) {
	db := appDB(t)
	const rows = 8
	for i := range rows {
		testenv.InsertIDs(t, db, testenv.Event{EventType: "Slow", Payload: []byte(fmt.Sprint(i))})
	}
	var mu sync.Mutex
	runs := map[string]int{}
	h := newHandlers(t, db, nil, 0)
	h.Handle("Slow", "slow", func(_ context.Context, ev ledger.Event) error {
		mu.Lock()
		runs[string(ev.Data)]++
		mu.Unlock()
		time.Sleep(150 * time.Millisecond)
		return nil
	})
	o := ledger.TableOptions{Lease: 400 * time.Millisecond, Batch: rows}
	start(t, db, h, o)
	start(t, db, h, o)
	testenv.Eventually(t, wait, "every row done", func() bool {
		return count(t, db, `SELECT count(*) FROM event_queue WHERE status = 'done'`) == rows
	})
	mu.Lock()
	defer mu.Unlock()
	for i := range rows {
		if n := runs[fmt.Sprint(i)]; n != 1 {
			t.Errorf("row %d handled %d times", i, n)
		}
	}
}

// TestTableSourceAndARealRelay: beside a running outbox-relay the source
// refuses to start, naming the relay's host and pid; once the relay has
// stopped (and left), the source runs.
func TestTableSourceAndARealRelay(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	cfg := config.Default()
	cfg.Database.Path, cfg.NATS.URL, cfg.Metrics.Listen = path, n.URL(), ""
	a, err := daemon.Open(context.Background(), cfg, zaptest.NewLogger(t).Named("relay"), daemon.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	relayCtx, stopRelay := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- a.Run(relayCtx) }()
	db := testenv.AppDB(t, path)
	testenv.Eventually(t, wait, "the relay's heartbeat", func() bool {
		return count(t, db, `SELECT count(*) FROM `+schema.InstancesTable) > 0
	})

	h := newHandlers(t, db, nil, 0)
	var ran atomic.Int32
	h.Handle("Thing", "count", func(context.Context, ledger.Event) error { ran.Add(1); return nil })
	s, err := ledger.NewTableSource(db, h, ledger.TableOptions{})
	if err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	err = s.Run(context.Background())
	if !errors.Is(err, ledger.ErrRelayRunning) || !strings.Contains(err.Error(), host) || !strings.Contains(err.Error(), fmt.Sprint("pid ", os.Getpid())) {
		t.Fatalf("Run beside a relay = %v; want ErrRelayRunning naming host %s and pid %d", err, host, os.Getpid())
	}

	stopRelay()
	if err := <-relayDone; err != nil {
		t.Fatal(err)
	}
	// The relay stopped and sent everything; the source takes what comes
	// after it.
	id := testenv.InsertIDs(t, db, testenv.NewEvent("Thing", []byte("x")))[0]
	start(t, db, h, ledger.TableOptions{})
	testenv.Eventually(t, wait, "the row done by the source", func() bool { return rowOf(t, db, id).Status == "done" })
	if ran.Load() != 1 {
		t.Fatalf("the handler ran %d times", ran.Load())
	}
}

// TestTableSourceDeadLettersEventIDsTheRelayCouldNotPublish: a row whose
// event_id is a BLOB (which the unique index lets in beside the TEXT of
// the same bytes), empty, or with surrounding whitespace is dead-lettered
// at once with the reason, as the relay does, and runs no handler: the
// BLOB's event is not taken for the TEXT one's and skipped.
func TestTableSourceDeadLettersEventIDsTheRelayCouldNotPublish(t *testing.T) {
	db := appDB(t)
	h := newHandlers(t, db, nil, 0)
	h.HandleTx("T", "rec", recordTx("rec"))
	valid := testenv.InsertIDs(t, db, testenv.NewEvent("T", []byte("text id")))[0]
	invalid := map[string]string{"X'616263'": "BLOB", "''": "empty", "'a '": "whitespace"}
	ids := map[int64]string{}
	for lit, why := range invalid {
		res, err := db.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (` + lit + `, 'T', 'x')`)
		if err != nil {
			t.Fatal(err)
		}
		id, _ := res.LastInsertId()
		ids[id] = why
	}
	testenv.MustExec(t, db, `UPDATE event_queue SET event_id = 'abc' WHERE id = ?`, valid)
	start(t, db, h, ledger.TableOptions{})
	probe(t, db)
	if r := rowOf(t, db, valid); r.Status != "done" {
		t.Errorf("the row with a TEXT id is %s, want done", r.Status)
	}
	for id, why := range ids {
		r := rowOf(t, db, id)
		if r.Status != "dead_lettered" || r.Attempts != 1 || !strings.Contains(r.LastError.String, why) {
			t.Errorf("row %d (%s id): %s, %d attempts, %q; want dead_lettered at once naming why", id, why, r.Status, r.Attempts, r.LastError.String)
		}
	}
	if n := count(t, db, `SELECT count(*) FROM effects WHERE handler = 'rec'`); n != 1 {
		t.Errorf("%d effects, want 1: the TEXT id's row's", n)
	}
}
