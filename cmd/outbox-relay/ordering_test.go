package main

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// checkKeyOrder reads the stream back and fails unless it holds exactly
// one message per event id, want in all, and the messages of each
// ordering key are in row-id order. It returns the messages per key.
func checkKeyOrder(t *testing.T, js jetstream.JetStream, want int) map[string]int {
	t.Helper()
	msgs := testenv.StreamMessages(t, js, "EVENTS")
	seen := map[string]bool{}
	last := map[string]int64{}
	perKey := map[string]int{}
	for _, m := range msgs {
		id := m.Header.Get(publish.HeaderMsgID)
		if seen[id] {
			t.Fatalf("event %s stored twice (sequence %d)", id, m.Sequence)
		}
		seen[id] = true
		key := m.Header.Get(publish.HeaderOrderingKey)
		if key == "" {
			continue
		}
		row, err := strconv.ParseInt(m.Header.Get(publish.HeaderRowID), 10, 64)
		if err != nil {
			t.Fatalf("sequence %d: %s %q", m.Sequence, publish.HeaderRowID, m.Header.Get(publish.HeaderRowID))
		}
		if row <= last[key] {
			t.Fatalf("key %s: row %d stored at sequence %d, after row %d", key, row, m.Sequence, last[key])
		}
		last[key] = row
		perKey[key]++
	}
	if len(msgs) != want {
		t.Fatalf("stream holds %d messages, want %d", len(msgs), want)
	}
	return perKey
}

// relayUser sets up the server's users: "relay" (password "pw"), which
// may not publish to the subjects deny, and "admin", the user of
// connections without credentials (the test's own), which may do
// anything. Passed to testenv.NATS.Reload, it changes the relay's
// permissions in place.
func relayUser(deny ...string) func(*server.Options) {
	return func(o *server.Options) {
		o.Users = []*server.User{{Username: "admin", Password: "admin"},
			{Username: "relay", Password: "pw", Permissions: &server.Permissions{Publish: &server.SubjectPermission{Deny: deny}}}}
		o.NoAuthUser = "admin"
	}
}

// chaosEnv is the environment of a relay run through kills, an outage and
// refusals on n, as relayUser's user "relay": refused rows are retried
// (100 attempts), an unanswered publish is a transport failure within 2 s,
// and the table is polled every 200 ms; then extra.
func chaosEnv(n *testenv.NATS, extra ...string) []string {
	return append([]string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_NATS_USER=relay", "OUTBOX_RELAY_NATS_PASSWORD=pw", "OUTBOX_RELAY_LOG_LEVEL=info",
		"OUTBOX_RELAY_METRICS_LISTEN=", "OUTBOX_RELAY_RELAY_MAX_ATTEMPTS=100", "OUTBOX_RELAY_RELAY_ACK_TIMEOUT=2s", "OUTBOX_RELAY_RELAY_POLL_INTERVAL=200ms"}, extra...)
}

// TestOrderedKeysSurviveChaos: 20,000 rows, most of them over 50 ordering
// keys, the rest unordered, written while the relay is killed (kill -9)
// twice, the first time under a standby that takes over, the broker goes
// away and comes back, and the broker refuses some rows (a subject the
// relay's user may not publish to) until the permission is granted. The
// server takes atomic batches of at most 100 messages, and many of the
// keys' rows go in batches. At the end every row is done, the stream holds
// one message per event, and each key's messages are in row-id order.
func TestOrderedKeysSurviveChaos(t *testing.T) {
	const (
		total   = 20_000
		keys    = 50
		batches = 100
	)
	// The relay's user may not publish events.Restricted until that is
	// granted, late in the test.
	// Batches of at most 100: the relay learns the server's limit from its
	// first refusal of a larger batch.
	lowBatches := func(o *server.Options) { o.JetStreamLimits.MaxBatchSize = 100 }
	n := testenv.StartNATS(t, relayUser("events.Restricted"), lowBatches)
	js := n.JetStream(t)
	testenv.EventsStream(t, js, 0)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	env := chaosEnv(n)
	relay := func() *process {
		return startDaemon(t, env, "run", "--database-path", path)
	}

	// The application writes for about 10 s: 100 transactions of 200 rows.
	rng := rand.New(rand.NewPCG(1, 2))
	var restricted int
	written := make(chan struct{})
	var writeErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(written)
		for b := 0; b < batches; b++ {
			evs := make([]testenv.Event, 0, total/batches)
			for range total / batches {
				ev := testenv.NewEvent("Thing", []byte("small"))
				if rng.IntN(10) < 7 {
					ev.OrderingKey = fmt.Sprintf("order-%d", rng.IntN(keys))
				}
				if rng.IntN(100) < 2 {
					ev.EventType = "Restricted"
					restricted++
				}
				evs = append(evs, ev)
			}
			if writeErr = testenv.Insert(app, evs...); writeErr != nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	done := func() int { return testenv.Counts(t, app)["done"] }

	first := relay()
	first.waitFor("leading: this relay claims and publishes the rows")
	testenv.Eventually(t, 30*time.Second, "rows flowing", func() bool { return done() > 2000 })
	// A standby takes over from the leader killed under it.
	second := relay()
	second.waitFor("standing by: another relay of this outbox table leads")
	first.Kill()
	second.waitFor("leading: this relay claims and publishes the rows")
	// An outage of 2 s.
	n.Stop()
	second.waitFor("broker unavailable; pausing without spending attempts")
	time.Sleep(2 * time.Second)
	n.Restart()
	second.waitFor("broker recovered; resuming")
	second.Kill()
	if d := done(); d == total {
		t.Fatal("every row was done before the second kill: the chaos came too late")
	}
	// The restricted rows were refused meanwhile; now the relay may
	// publish them.
	var refused int
	if app.QueryRow(`SELECT count(*) FROM event_queue WHERE attempts > 0`).Scan(&refused); refused == 0 {
		t.Fatal("no row was refused before the permission was granted")
	}
	n.Reload(relayUser())
	third := relay()
	<-written
	wg.Wait()
	if writeErr != nil {
		t.Fatal(writeErr)
	}
	testenv.Eventually(t, 90*time.Second, "every row done", func() bool { return done() == total })
	third.stop()
	perKey := checkKeyOrder(t, js, total)
	if len(perKey) != keys {
		t.Fatalf("%d keys in the stream, want %d", len(perKey), keys)
	}
	batched := 0
	for _, m := range testenv.StreamMessages(t, js, "EVENTS") {
		if m.Header.Get("Nats-Batch-Id") != "" {
			batched++
		}
	}
	if batched == 0 {
		t.Fatal("no message was stored in an atomic batch: nothing tested the order of batches")
	}
	var retried, keyedRetried int
	app.QueryRow(`SELECT count(*), count(ordering_key) FROM event_queue WHERE attempts > 0`).Scan(&retried, &keyedRetried)
	if keyedRetried == 0 {
		t.Fatalf("no row with a key was refused (%d refused in all): nothing tested the order across rejections", retried)
	}
	t.Logf("%d restricted rows, %d rows refused at least once (%d of them with a key), %d messages stored in atomic batches", restricted, retried, keyedRetried, batched)
}

// parkedKeyRun writes three keys of three rows each, the first row of key
// "a" too large for the stream, and runs the relay with the given
// on_dead_letter until nothing is pending but what waits behind a parked
// key. It returns the app's connection, the stream's JetStream, the relay
// and the database's path.
func parkedKeyRun(t *testing.T, onDeadLetter string) (*sql.DB, jetstream.JetStream, *process, string) {
	t.Helper()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	testenv.EventsStream(t, js, 1024)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	var evs []testenv.Event
	for i := range 3 {
		for _, key := range []string{"a", "b", "c"} {
			ev := testenv.NewEvent("Thing", []byte(fmt.Sprintf("%s-%d", key, i)))
			ev.OrderingKey = key
			if key == "a" && i == 0 {
				ev.Payload = []byte(strings.Repeat("x", 2048))
			}
			evs = append(evs, ev)
		}
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN=", "OUTBOX_RELAY_RELAY_MAX_ATTEMPTS=2",
		"OUTBOX_RELAY_RELAY_POLL_INTERVAL=200ms", "OUTBOX_RELAY_ORDERING_ON_DEAD_LETTER=" + onDeadLetter}, "run", "--database-path", path)
	testenv.Eventually(t, 30*time.Second, "the large row dead-lettered", func() bool {
		return testenv.Counts(t, app)["dead_lettered"] == 1
	})
	return app, js, d, path
}

// keyStatus returns the status of each row of key, in id order.
func keyStatus(t *testing.T, app *sql.DB, key string) string {
	t.Helper()
	return strings.Join(testenv.Strings(t, app, `SELECT status FROM event_queue WHERE ordering_key = ? ORDER BY id`, key), " ")
}

// TestDeadLetterParksItsKey: by default (hold) a dead-lettered row parks
// its key: the key's later rows stay pending, spending no attempts, while
// the other keys are published; once the cause is fixed, dead-letters
// retry un-parks it and its rows follow in order.
func TestDeadLetterParksItsKey(t *testing.T) {
	app, js, d, path := parkedKeyRun(t, "hold")
	testenv.Eventually(t, 30*time.Second, "the other keys done", func() bool {
		return keyStatus(t, app, "b") == "done done done" && keyStatus(t, app, "c") == "done done done"
	})
	// The parked key's rows wait (the relay's rescans come every 200 ms).
	time.Sleep(time.Second)
	if got := keyStatus(t, app, "a"); got != "dead_lettered pending pending" {
		t.Fatalf("key a: %s, want dead_lettered pending pending", got)
	}
	var spent int
	app.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue WHERE ordering_key = 'a' AND status = 'pending'`).Scan(&spent)
	if spent != 0 {
		t.Fatalf("the rows behind the parked row spent %d attempts", spent)
	}
	testenv.EventsStream(t, js, 1<<20)
	if code, out, errOut := runCLI(t, "dead-letters", "retry", "--all", "--database-path", path); code != 0 {
		t.Fatalf("dead-letters retry: %d %s %s", code, out, errOut)
	}
	testenv.Eventually(t, 30*time.Second, "key a done", func() bool { return keyStatus(t, app, "a") == "done done done" })
	d.stop()
	perKey := checkKeyOrder(t, js, 9)
	if perKey["a"] != 3 {
		t.Fatalf("key a has %d messages in the stream, want 3", perKey["a"])
	}
}

// TestSkipMovesOn: with ordering.on_dead_letter skip, the key's later rows
// are published past its dead letter.
func TestSkipMovesOn(t *testing.T) {
	app, js, d, _ := parkedKeyRun(t, "skip")
	testenv.Eventually(t, 30*time.Second, "every key done past the dead letter", func() bool {
		return keyStatus(t, app, "a") == "dead_lettered done done" && keyStatus(t, app, "b") == "done done done" && keyStatus(t, app, "c") == "done done done"
	})
	d.stop()
	if perKey := checkKeyOrder(t, js, 8); perKey["a"] != 2 {
		t.Fatalf("key a has %d messages in the stream, want 2", perKey["a"])
	}
}

// TestBatchStoredBeforeACrash: the stream already holds the events of a
// key's first 200 rows, stored by a relay that died between the PubAck
// and its settle. The relay sends the key's rows in an atomic batch, which
// the stream refuses whole for the ids it holds: each of those rows ends
// done with the sequence its event was stored at, nothing is stored twice,
// and the rest of the key follows in order.
func TestBatchStoredBeforeACrash(t *testing.T) {
	n, js, path, app, evs, ids := oneKeyBacklog(t)
	seqs := map[int64]uint64{}
	for i, id := range ids[:200] {
		ack, err := js.PublishMsg(context.Background(), relayMsg(evs[i], id))
		if err != nil {
			t.Fatal(err)
		}
		seqs[id] = ack.Sequence
	}
	d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN=", "OUTBOX_RELAY_ORDERING_BATCH_MAX=50"}, "run", "--database-path", path)
	d.waitFor("atomic batches on: an ordering key's due rows go as one batch, all or none")
	testenv.Eventually(t, 30*time.Second, "every row done", func() bool { return testenv.Counts(t, app)["done"] == len(ids) })
	statusSays(t, path, "an ordering key's due rows go in atomic batches of up to 50")
	d.stop()
	checkKeyOrder(t, js, len(ids))
	rows, err := app.Query(`SELECT id, stream_seq FROM event_queue ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var seq uint64
		if err := rows.Scan(&id, &seq); err != nil {
			t.Fatal(err)
		}
		if want, stored := seqs[id]; stored && seq != want {
			t.Fatalf("row %d done at stream sequence %d, its event was stored at %d", id, seq, want)
		}
	}
}

// relayMsg is the message the relay publishes for ev, at row id: as a
// relay that died between the PubAck and the settle stored it.
func relayMsg(ev testenv.Event, id int64) *nats.Msg {
	msg := nats.NewMsg("events." + ev.EventType)
	msg.Data = ev.Payload
	msg.Header.Set(publish.HeaderMsgID, *ev.EventID)
	msg.Header.Set(publish.HeaderRowID, strconv.FormatInt(id, 10))
	if ev.OrderingKey != "" {
		msg.Header.Set(publish.HeaderOrderingKey, ev.OrderingKey)
	}
	return msg
}

// TestNoAtomicBatches: with stream.allow_atomic false the relay leaves the
// stream without allow_atomic, says so, and a key's rows go one at a time,
// all of them, in order.
func TestNoAtomicBatches(t *testing.T) {
	n, js, path, app, evs, _ := oneKeyBacklog(t)
	d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN=", "OUTBOX_RELAY_STREAM_ALLOW_ATOMIC=false"}, "run", "--database-path", path)
	d.waitFor("atomic batches off (stream.allow_atomic is false): an ordering key's rows go one at a time, and rows of atomic groups are held, pending")
	testenv.Eventually(t, 30*time.Second, "every row done", func() bool { return testenv.Counts(t, app)["done"] == len(evs) })
	statusSays(t, path, "an ordering key's rows go one at a time: the stream takes no atomic batches")
	d.stop()
	checkKeyOrder(t, js, len(evs))
	for _, m := range testenv.StreamMessages(t, js, "EVENTS") {
		if id := m.Header.Get("Nats-Batch-Id"); id != "" {
			t.Fatalf("message %d was stored in atomic batch %s", m.Sequence, id)
		}
	}
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil || s.CachedInfo().Config.AllowAtomicPublish {
		t.Fatalf("the stream allows atomic publish (%v): the relay turned it on", err)
	}
}

// statusSays waits until status, on the database at path, says want of
// the leading relay (its heartbeat, once a second, carries it).
func statusSays(t *testing.T, path, want string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "status says "+want, func() bool {
		code, out, _ := runCLI(t, "status", "--database-path", path)
		return code == 0 && strings.Contains(out, want)
	})
}

// oneKeyBacklog starts a server with the stream EVENTS (without
// allow_atomic) and writes 300 rows of one ordering key to a new
// database; it returns the server, its JetStream, the database's path, the
// application's connection, the events and their row ids.
func oneKeyBacklog(t *testing.T) (*testenv.NATS, jetstream.JetStream, string, *sql.DB, []testenv.Event, []int64) {
	t.Helper()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	testenv.EventsStream(t, js, 0)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	evs := make([]testenv.Event, 300)
	for i := range evs {
		evs[i] = testenv.NewEvent("Thing", []byte("x"))
		evs[i].OrderingKey = "k"
	}
	return n, js, path, app, evs, testenv.InsertIDs(t, app, evs...)
}
