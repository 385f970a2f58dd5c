package reconcile_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/claim"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// unreconciled is a table no relay has reconciled, given its origin, and
// an empty stream EVENTS on events.>: the options that reconcile them,
// and the application's connection.
func unreconciled(t *testing.T) (jetstream.JetStream, *sql.DB, reconcile.Options) {
	t.Helper()
	js := testenv.StartNATS(t).JetStream(t)
	testenv.EventsStream(t, js, 0)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	db := testenv.OpenDB(t, path)
	origin, err := reconcile.Origin(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	return js, app, reconcile.Options{DB: db, Store: claim.New(db, claim.Options{Stream: "EVENTS"}), JS: js, Stream: "EVENTS", Subjects: "events.>", Origin: origin}
}

// TestNothingPendingReadsNothing: the first reconciliation of a table
// (the first start of this release, or one while the position names
// another stream) with no pending row has nothing to find: it reads no
// done row and no message, however large the table.
func TestNothingPendingReadsNothing(t *testing.T) {
	ctx := context.Background()
	js, app, o := unreconciled(t)
	const rows = 1000
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
INSERT INTO event_queue (event_id, event_type, payload, status, processed_at, stream_seq)
SELECT 'e' || i, 'Thing', randomblob(64), 'done', 1, i FROM n`, rows)
	for i := range 5 { // messages of the table's, and others'
		if _, err := js.Publish(ctx, fmt.Sprint("events.Thing"), []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	p, err := reconcile.Run(ctx, o)
	if err != nil || p.Scans() || p.Read != 0 {
		t.Fatalf("with nothing pending: %+v, %v; want nothing read", p, err)
	}
	var from int64
	if err := app.QueryRow(`SELECT scan_from FROM outbox_relay_published`).Scan(&from); err != nil || from != 6 {
		t.Fatalf("position %d (%v), want 6: past the stream's last message", from, err)
	}
}

// TestOthersMessagesAloneReadNothing: in a stream shared with other
// tables (a fleet's tenants, each on its own subjects), messages stored
// past a table's position on others' subjects only leave it nothing to
// read; a message of its own among them is read and its row settled.
// Whether or not the stream allows direct gets (the look asks the
// stream's leader either way).
func TestOthersMessagesAloneReadNothing(t *testing.T) {
	for _, direct := range []bool{false, true} {
		t.Run(fmt.Sprintf("allow_direct=%v", direct), func(t *testing.T) {
			ctx := context.Background()
			f := newFixture(t, 3)
			s, err := f.js.Stream(ctx, "EVENTS")
			if err != nil {
				t.Fatal(err)
			}
			cfg := s.CachedInfo().Config
			cfg.AllowDirect = direct
			if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
				t.Fatal(err)
			}
			o := f.options(claim.New(f.db, claim.Options{Stream: "EVENTS"}))
			o.Subjects = "events.*" // a wildcard, as a fleet's tenant's filter is
			if p, err := reconcile.Run(ctx, o); err != nil || p.Settled != 3 {
				t.Fatalf("first run: %+v, %v; want 3 settled", p, err)
			}
			others := func() {
				for range 5 {
					if _, err := f.js.Publish(ctx, "events.globex.Thing", []byte("another table's")); err != nil {
						t.Fatal(err)
					}
				}
			}
			others()
			p, err := reconcile.Run(ctx, o)
			if err != nil || p.Scans() || p.Read != 0 {
				t.Fatalf("with only others' messages past the position: %+v, %v; want nothing read", p, err)
			}
			var from uint64
			if err := f.app.QueryRow(`SELECT scan_from FROM outbox_relay_published`).Scan(&from); err != nil || from != 9 {
				t.Fatalf("position %d (%v), want 9: past the stream's last message", from, err)
			}
			// Subjects on which the stream holds nothing at all (a
			// fleet's new tenant): the server's "no message found", which
			// is also its answer for a store that failed to read, is
			// confirmed by the stream's index of its subjects, and
			// nothing is read.
			others()
			none := o
			none.Subjects = "events.initech.>"
			if p, err := reconcile.Run(ctx, none); err != nil || p.Scans() || p.Read != 0 {
				t.Fatalf("with no message on its subjects: %+v, %v; want nothing read", p, err)
			}
			if err := f.app.QueryRow(`SELECT scan_from FROM outbox_relay_published`).Scan(&from); err != nil || from != 14 {
				t.Fatalf("position %d (%v), want 14: past the stream's last message", from, err)
			}

			ev := testenv.NewEvent("Thing", []byte("x"))
			id := testenv.InsertIDs(t, f.app, ev)[0]
			seq := f.publish(t, *ev.EventID, id, f.origin)
			others()
			p, err = reconcile.Run(ctx, o)
			if err != nil || p.From != seq || p.Read != 1 || p.Settled != 1 {
				t.Fatalf("with a message of its own among others': %+v, %v; want it read from %d and its row settled", p, err, seq)
			}
			var got uint64
			if err := f.app.QueryRow(`SELECT stream_seq FROM event_queue WHERE id = ?`, id).Scan(&got); err != nil || got != seq {
				t.Fatalf("row %d: stream_seq %d (%v), want %d", id, got, err, seq)
			}
		})
	}
}

// TestEmptyStreamReadsNothing: a stream that has never stored a message
// (just created, as a fleet's first file finds it) holds none of a
// table's pending rows: nothing is read, and the position is its first
// sequence, from which the next reconciliation finds a message of a
// pending row and settles it.
func TestEmptyStreamReadsNothing(t *testing.T) {
	ctx := context.Background()
	js, app, o := unreconciled(t)
	ev := testenv.NewEvent("Thing", []byte("x"))
	id := testenv.InsertIDs(t, app, ev)[0]
	p, err := reconcile.Run(ctx, o)
	if err != nil || p.Scans() || p.Read != 0 {
		t.Fatalf("on an empty stream: %+v, %v; want nothing read", p, err)
	}
	var from int64
	if err := app.QueryRow(`SELECT scan_from FROM outbox_relay_published`).Scan(&from); err != nil || from != 1 {
		t.Fatalf("position %d (%v), want 1: the empty stream's first sequence", from, err)
	}
	m := nats.NewMsg("events.Thing")
	m.Header.Set(publish.HeaderMsgID, *ev.EventID)
	m.Header.Set(publish.HeaderRowID, fmt.Sprint(id))
	m.Header.Set(publish.HeaderOrigin, o.Origin)
	if _, err := js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	if p, err = reconcile.Run(ctx, o); err != nil || p.From != 1 || p.Settled != 1 {
		t.Fatalf("with the row's message stored: %+v, %v; want it read from 1 and its row settled", p, err)
	}
}
