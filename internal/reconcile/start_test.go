package reconcile_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/claim"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestNothingPendingReadsNothing: the first reconciliation of a table
// (the first start of this release, or one while the position names
// another stream) with no pending row has nothing to find: it reads no
// done row and no message, however large the table.
func TestNothingPendingReadsNothing(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	testenv.EventsStream(t, js, 0)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	const rows = 1000
	testenv.MustExec(t, app, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
INSERT INTO event_queue (event_id, event_type, payload, status, processed_at, stream_seq)
SELECT 'e' || i, 'Thing', randomblob(64), 'done', 1, i FROM n`, rows)
	for i := range 5 { // messages of the table's, and others'
		if _, err := js.Publish(ctx, fmt.Sprint("events.Thing"), []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	db := testenv.OpenDB(t, path)
	origin, err := reconcile.Origin(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	o := reconcile.Options{DB: db, Store: claim.New(db, claim.Options{Stream: "EVENTS"}), JS: js, Stream: "EVENTS", Subjects: "events.>", Origin: origin}
	p, err := reconcile.Run(ctx, o)
	if err != nil || p.Scans() || p.Read != 0 {
		t.Fatalf("with nothing pending: %+v, %v; want nothing read", p, err)
	}
	var from int64
	if err := app.QueryRow(`SELECT scan_from FROM outbox_relay_published`).Scan(&from); err != nil || from != 6 {
		t.Fatalf("position %d (%v), want 6: past the stream's last message", from, err)
	}
}
