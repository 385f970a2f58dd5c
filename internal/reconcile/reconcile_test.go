package reconcile_test

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/claim"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// fixture is an outbox whose rows were published, as the relay publishes
// them, and left pending.
type fixture struct {
	js     jetstream.JetStream
	app    *sql.DB
	db     *sqlitedb.DB
	origin string
	ids    []int64
}

func newFixture(t testing.TB, rows int) *fixture {
	t.Helper()
	f := &fixture{js: testenv.StartNATS(t).JetStream(t)}
	testenv.EventsStream(t, f.js, 0)
	path := testenv.NewDB(t)
	f.app = testenv.AppDB(t, path)
	f.db = testenv.OpenDB(t, path)
	var err error
	if f.origin, err = reconcile.Origin(context.Background(), f.db); err != nil {
		t.Fatal(err)
	}
	evs := make([]testenv.Event, rows)
	for i := range evs {
		evs[i] = testenv.NewEvent("Thing", []byte("x"))
	}
	f.ids = testenv.InsertIDs(t, f.app, evs...)
	for i, id := range f.ids {
		f.publish(t, *evs[i].EventID, id, f.origin)
	}
	return f
}

// publish stores a message as the relay would for row id.
func (f *fixture) publish(t testing.TB, eventID string, id int64, origin string) uint64 {
	t.Helper()
	m := nats.NewMsg("events.Thing")
	m.Header.Set(publish.HeaderMsgID, eventID)
	m.Header.Set(publish.HeaderRowID, strconv.FormatInt(id, 10))
	if origin != "" {
		m.Header.Set(publish.HeaderOrigin, origin)
	}
	ack, err := f.js.PublishMsg(context.Background(), m)
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

func (f *fixture) options(store reconcile.Settler) reconcile.Options {
	return reconcile.Options{DB: f.db, Store: store, JS: f.js, Stream: "EVENTS", Subjects: "events.>", Origin: f.origin, Batch: 100}
}

// failingAfter settles through claim.Store, and fails from its n+1st
// settle on: a relay killed during the reconciliation.
type failingAfter struct {
	*claim.Store
	n int
}

var errKilled = errors.New("killed")

func (s *failingAfter) Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) ([]int, error) {
	if s.n == 0 {
		return nil, errKilled
	}
	s.n--
	return s.Store.Settle(ctx, outs, scanFrom)
}

// TestResumesWhereItStopped: a reconciliation cut short has settled the
// batches it read, and recorded where it stopped; the next one starts
// there and settles the rest, each row with its message's sequence.
func TestResumesWhereItStopped(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, 450)
	store := claim.New(f.db, claim.Options{Stream: "EVENTS"})
	p, err := reconcile.Run(ctx, f.options(&failingAfter{Store: store, n: 2}))
	if !errors.Is(err, errKilled) {
		t.Fatalf("Run = %v, want the settle's error", err)
	}
	if p.Settled != 200 || p.Next != 201 {
		t.Fatalf("cut short after two batches: %+v", p)
	}
	if c := testenv.Counts(t, f.app); c["done"] != 200 || c["pending"] != 250 {
		t.Fatalf("rows after the reconciliation was cut short: %v", c)
	}
	p, err = reconcile.Run(ctx, f.options(store))
	if err != nil {
		t.Fatal(err)
	}
	if p.From != 201 || p.To != 450 || p.Settled != 250 || p.Read != 250 || p.Orphans != 0 || p.Reused != 0 {
		t.Fatalf("resumed: %+v, want from 201 to 450, the 250 rows left settled", p)
	}
	var wrong int
	if err := f.app.QueryRow(`SELECT count(*) FROM event_queue WHERE status <> 'done' OR stream_seq <> id`).Scan(&wrong); err != nil || wrong != 0 {
		t.Fatalf("%d rows not done at their message's sequence (%v)", wrong, err)
	}
	// Nothing left: the next run reads nothing.
	if p, err = reconcile.Run(ctx, f.options(store)); err != nil || p.Scans() {
		t.Fatalf("a run with nothing left: %+v, %v", p, err)
	}
}

// TestOrphansAndOthersMessages: messages of this table whose rows are
// gone (a restore to before they were written) are counted, not
// re-created; messages of another origin with the same row ids are left
// alone; a message of another origin with a pending row's event id
// dead-letters that row, naming the other row.
func TestOrphansAndOthersMessages(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, 10)
	testenv.MustExec(t, f.app, `DELETE FROM event_queue WHERE id > 8`)
	for id := int64(1); id <= 3; id++ {
		f.publish(t, "other-"+strconv.FormatInt(id, 10), id, "another-origin")
	}
	ev := testenv.NewEvent("Thing", []byte("x"))
	*ev.EventID = "shared-id"
	row := testenv.InsertIDs(t, f.app, ev)[0]
	seq := f.publish(t, "shared-id", 77, "another-origin")
	p, err := reconcile.Run(ctx, f.options(claim.New(f.db, claim.Options{Stream: "EVENTS"})))
	if err != nil {
		t.Fatal(err)
	}
	if p.Settled != 8 || p.Orphans != 2 || p.Reused != 1 || p.Read != 14 {
		t.Fatalf("reconciled %+v, want 8 settled, 2 orphans, 1 reused id of 14 messages", p)
	}
	if p.Orphan != "sequence 9, event id "+eventID(t, f, 9)+", row 9" {
		t.Errorf("first orphan %q", p.Orphan)
	}
	var status, lastErr string
	if err := f.app.QueryRow(`SELECT status, last_error FROM event_queue WHERE id = ?`, row).Scan(&status, &lastErr); err != nil {
		t.Fatal(err)
	}
	want := (&publish.ReusedID{Stream: "EVENTS", Seq: seq, RowID: "77", Origin: "another-origin"}).Error()
	if status != "dead_lettered" || lastErr != want {
		t.Fatalf("row reusing another origin's event id: %s %q, want dead_lettered %q", status, lastErr, want)
	}
	if c := testenv.Counts(t, f.app); c["done"] != 8 || c["dead_lettered"] != 1 || len(c) != 2 {
		t.Fatalf("rows: %v", c)
	}
}

// eventID is the Nats-Msg-Id of the message at seq.
func eventID(t *testing.T, f *fixture, seq uint64) string {
	t.Helper()
	s, err := f.js.Stream(context.Background(), "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	m, err := s.GetMsg(context.Background(), seq)
	if err != nil {
		t.Fatal(err)
	}
	return m.Header.Get(publish.HeaderMsgID)
}

// BenchmarkReconcile reconciles 20,000 published pending rows (a restore
// from a backup taken before they were published); ns/op is per row.
func BenchmarkReconcile(b *testing.B) {
	ctx := context.Background()
	const rows = 20_000
	for range b.N {
		b.StopTimer()
		f := newFixture(b, rows)
		store := claim.New(f.db, claim.Options{Stream: "EVENTS"})
		b.StartTimer()
		p, err := reconcile.Run(ctx, f.options(store))
		if err != nil || p.Settled != rows {
			b.Fatalf("%+v %v", p, err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*rows), "ns/row")
}

// BenchmarkNothingToReconcile is what a relay's start costs when nothing
// was published since the table's position: reading the stream's state
// and the position, and writing it.
func BenchmarkNothingToReconcile(b *testing.B) {
	ctx := context.Background()
	f := newFixture(b, 1000)
	o := f.options(claim.New(f.db, claim.Options{Stream: "EVENTS"}))
	if p, err := reconcile.Run(ctx, o); err != nil || p.Settled != 1000 {
		b.Fatalf("%+v %v", p, err)
	}
	for b.Loop() {
		if p, err := reconcile.Run(ctx, o); err != nil || p.Scans() {
			b.Fatalf("%+v %v", p, err)
		}
	}
}
