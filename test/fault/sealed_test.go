//go:build fault

package fault

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// sealedFor is how long the stream stays sealed: longer than a row with
// relay.max_attempts 3 takes to spend them all if the refusals counted
// against it (tries at once, after 5 s and after 10 s more).
const sealedFor = 20 * time.Second

// TestSealedStream: the operator seals the stream while keyed and
// unkeyed rows flow. A sealed stream refuses every message, which is no
// row's fault: the relay pauses as for an outage, no row spends an
// attempt (relay.max_attempts 3) or is dead-lettered, and /readyz answers
// 503 saying the stream is sealed. The operator then replaces the stream
// (deletes it; the relay creates it again, stream.create being on), and
// the rows pending since the seal are published, each once; those done
// before it went with the sealed stream.
func TestSealedStream(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.startRelay("relay", "EVENT_QUEUE_MAX_ATTEMPTS=3")
	w := e.writer("-rows", "20000", "-rate", "500", "-keys", "20")
	testenv.Eventually(t, 60*time.Second, "1,000 rows published", func() bool { return testenv.Counts(t, db)["done"] >= 1000 })
	js := e.jetStream()
	ctx := context.Background()
	testenv.EditStream(t, js, "EVENTS", func(c *jetstream.StreamConfig) { c.Sealed = true })
	sealed := time.Now()
	ready := e.watchSealed(db, sealed.Add(sealedFor))
	deferred := e.metric("relay", `outbox_relay_deferred_total{reason="outage"}`)
	if deferred == 0 {
		t.Error("no row was deferred for the sealed stream")
	}
	// Replace the stream. Its rows go with it: what was done by now is not
	// in the new one.
	gone := map[string]bool{}
	for _, id := range testenv.Strings(t, db, `SELECT event_id FROM event_queue WHERE status = 'done'`) {
		gone[id] = true
	}
	held := pendingIDs(t, db)
	if err := js.DeleteStream(ctx, "EVENTS"); err != nil {
		t.Fatalf("delete the sealed stream: %v", err)
	}
	deleted := time.Now()
	recovery := waitRowsSettled(t, db, held, deleted, 90*time.Second, "rows pending at the delete")
	sum := e.waitWriter(w)
	e.waitSettled(db, 120*time.Second)
	e.waitReadyz("relay", 200, "")
	e.stopRelay("relay")
	// One pair for the seal (a second only if an ack timed out under load).
	if down, up := e.logCount("relay", "broker unavailable; pausing without spending attempts"), e.logCount("relay", "broker recovered; resuming"); down != up || down < 1 || down > 2 {
		t.Errorf("%d 'unavailable' and %d 'recovered' lines for one sealed stream; want one each", down, up)
	}
	var attempts int
	db.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue`).Scan(&attempts)
	if attempts != 0 {
		t.Errorf("rows spent %d attempts", attempts)
	}
	lost, dups, dead := e.verifyReplaced(db, 0, gone)
	t.Logf("/readyz while sealed: %s", ready)
	t.Logf("sealed for %v: %d rows were done before, %d pending at the delete (%v deferred meanwhile) all published %v after it",
		deleted.Sub(sealed).Round(time.Second), len(gone), len(held), deferred, recovery.Round(time.Millisecond))
	summaries = append(summaries, summary{name: "stream sealed 20 s, then deleted and recreated", rows: sum.Written, outage: deleted.Sub(sealed),
		lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: recovery, elapsed: time.Since(e.started),
		notes: fmt.Sprintf("%d keyed; %d done before the seal, %d pending at the delete", sum.Keyed, len(gone), len(held))})
}

// watchSealed watches the relay until until while the stream is sealed:
// no row may spend an attempt or be dead-lettered; then /readyz must
// answer 503 saying the stream is sealed. It returns what /readyz said.
func (e *env) watchSealed(db *sql.DB, until time.Time) string {
	e.t.Helper()
	for {
		var attempts, dead int
		db.QueryRow(`SELECT coalesce(sum(attempts), 0), count(*) FILTER (WHERE status = 'dead_lettered') FROM event_queue`).Scan(&attempts, &dead)
		if attempts != 0 || dead != 0 {
			bad := testenv.Strings(e.t, db, `SELECT id || ' ' || status || ', attempts ' || attempts || ': ' || coalesce(last_error, '')
				FROM event_queue WHERE attempts > 0 ORDER BY id LIMIT 3`)
			e.t.Fatalf("with the stream sealed, rows spent %d attempts and %d were dead-lettered, e.g. %s", attempts, dead, strings.Join(bad, "; "))
		}
		if time.Now().After(until) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	return e.waitReadyz("relay", 503, "sealed")
}

// jetStream returns a JetStream handle on a new connection to the broker,
// closed when the test ends.
func (e *env) jetStream() jetstream.JetStream {
	e.t.Helper()
	nc, err := nats.Connect(e.natsURL())
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		e.t.Fatal(err)
	}
	return js
}
