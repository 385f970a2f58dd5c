package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/publish"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestSubjectAtItsLimitWaitsAlone: a stream with max_msgs_per_subject,
// discard new per subject, refuses one subject at its limit (err_code
// 10077) and takes the others. That subject's rows wait, spending no
// attempt, with one warning and /readyz naming it, while the other
// subjects' rows go out: no outage begins. Once the limit is raised, its
// rows go out too and the hold ends. The same for an atomic group's rows,
// refused as a batch.
func TestSubjectAtItsLimitWaitsAlone(t *testing.T) {
	for _, c := range []struct {
		name  string
		group string
	}{{"one row at a time", ""}, {"an atomic group", "g"}} {
		t.Run(c.name, func(t *testing.T) { subjectAtItsLimit(t, c.group) })
	}
}

// subjectAtItsLimit runs TestSubjectAtItsLimitWaitsAlone; the three rows
// refused form an atomic group when group is not empty.
func subjectAtItsLimit(t *testing.T, group string) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour,
		MaxMsgsPerSubject: 2, Discard: jetstream.DiscardNew, DiscardNewPerSubject: true}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 2, "Full") // they fit; the next 3 are refused
	for range 3 {
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, atomic_group) VALUES (?, 'Full', 'x', nullif(?, ''))`, event.NewID(), group)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.Eventually(t, 20*time.Second, "the full subject held", func() bool { return h.relay.Held() != nil })
	for i := range 10 {
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, ?, 'x')`, event.NewID(), fmt.Sprint("Other", i))
		time.Sleep(50 * time.Millisecond)
	}
	testenv.Eventually(t, 20*time.Second, "the other subjects' rows done", func() bool { return testenv.Counts(t, app)["done"] == 12 })
	if c := testenv.Counts(t, app); c["pending"] != 3 {
		t.Fatalf("rows %v; want the full subject's 3 pending", c)
	}
	err := h.app.Ready(ctx)
	if err == nil || !strings.Contains(err.Error(), "events.Full") || !strings.Contains(err.Error(), "max_msgs_per_subject") {
		t.Fatalf("/readyz with a subject at its limit: %v; want it named, with the limit", err)
	}
	if h.relay.Paused() != nil || logCount(h, "broker unavailable; pausing without spending attempts") > 0 {
		t.Fatalf("an outage began for one subject at its limit: %v", h.relay.Paused())
	}
	if c := logCount(h, "the stream refuses a subject at its max_msgs_per_subject; its rows wait without spending attempts"); c != 1 {
		t.Errorf("%d warnings of the held subject; want one", c)
	}
	nothingSpent(t, app, "on a subject at its limit")
	stream, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	cfg = stream.CachedInfo().Config // as the relay patched it (allow_atomic)
	cfg.MaxMsgsPerSubject = 10
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the full subject's rows done once the limit is raised", func() bool { return testenv.Counts(t, app)["done"] == 15 })
	testenv.Eventually(t, 5*time.Second, "/readyz ready", func() bool { return h.app.Ready(ctx) == nil })
	if c := logCount(h, "the stream takes the subject again"); c != 1 {
		t.Errorf("%d lines of the hold's end; want one", c)
	}
	nothingSpent(t, app, "on a subject at its limit")
}

// fullSubjectStream makes EVENTS with max_msgs_per_subject 100, discard
// new per subject, and events.Full already at its limit.
func fullSubjectStream(t *testing.T) *testenv.NATS {
	t.Helper()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour,
		MaxMsgsPerSubject: 100, Discard: jetstream.DiscardNew, DiscardNewPerSubject: true}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	for range 100 {
		if _, err := js.Publish(ctx, "events.Full", []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

// TestKeyBatchWithAFullSubjectHoldsOnlyThatSubject: an ordering key's
// due rows go as one atomic batch (32 or more waiting), its last row on a
// subject at its max_msgs_per_subject. The batch refused, its rows go one
// at a time: the rows before that one in the key, on another subject, are
// stored, and /readyz names the full subject only.
func TestKeyBatchWithAFullSubjectHoldsOnlyThatSubject(t *testing.T) {
	n := fullSubjectStream(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	evs := make([]testenv.Event, 0, 60)
	for i := range 60 {
		e := testenv.NewEvent("Other", []byte("x"))
		if i == 59 {
			e = testenv.NewEvent("Full", []byte("x"))
		}
		e.OrderingKey = "K"
		evs = append(evs, e)
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.Eventually(t, 20*time.Second, "a subject held", func() bool { return h.relay.Held() != nil })
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) && testenv.Counts(t, app)["done"] < 59 {
		time.Sleep(50 * time.Millisecond)
	}
	ready := h.app.Ready(context.Background())
	c := testenv.Counts(t, app)
	t.Logf("rows %v; /readyz: %v", c, ready)
	if c["done"] < 59 {
		t.Errorf("after 20 s, %d of the 59 rows on events.Other (before the events.Full row in their key) done; want all: a full subject holds only its own rows", c["done"])
	}
	if ready == nil || strings.Contains(ready.Error(), "events.Other") || !strings.Contains(ready.Error(), "events.Full") {
		t.Errorf("/readyz: %v; want events.Full named held, and only it", ready)
	}
}

// TestHoldEndsWhenTheSubjectsRowsAreGone: a subject held, then its only
// pending row is removed by the application. Nothing of that subject is
// left to publish, so no refusal renews the hold: it ends, and /readyz is
// ready again.
func TestHoldEndsWhenTheSubjectsRowsAreGone(t *testing.T) {
	n := fullSubjectStream(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	id := event.NewID()
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'Full', 'x')`, id)
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.Eventually(t, 20*time.Second, "the full subject held", func() bool { return h.relay.Held() != nil })
	testenv.MustExec(t, app, `DELETE FROM event_queue WHERE event_id = ?`, id)
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'Other', 'x')`, event.NewID())
	testenv.Eventually(t, 20*time.Second, "the other row done", func() bool { return testenv.Counts(t, app)["done"] == 1 })
	testenv.Eventually(t, 30*time.Second, "/readyz ready once the held subject has no row left", func() bool { return h.app.Ready(context.Background()) == nil })
}

// stoppedMidDrain starts a relay draining mixedRows and stops the server
// once some of them are done; it returns the server, the application's
// database and how many rows it holds.
func stoppedMidDrain(t *testing.T) (*testenv.NATS, *sql.DB, int) {
	t.Helper()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	total := mixedRows(t, app, 100)
	startRelay(t, path, n.URL(), harnessOptions{batch: 50, inFlight: 200})
	testenv.Eventually(t, 30*time.Second, "some rows done", func() bool { return testenv.Counts(t, app)["done"] > 300 })
	n.Stop()
	return n, app, total
}

// mixedRows writes rows unordered, rows of ordering keys and atomic
// groups of three, in transactions of 30 rows.
func mixedRows(t *testing.T, app *sql.DB, txs int) int {
	t.Helper()
	total := 0
	for i := 0; i < txs; i++ {
		evs := make([]testenv.Event, 0, 30)
		for j := 0; j < 30; j++ {
			e := testenv.NewEvent("Mixed", []byte(fmt.Sprint(i, "-", j)))
			switch j % 3 {
			case 1:
				e.OrderingKey = fmt.Sprint("key-", j%7)
			case 2:
				e.AtomicGroup = fmt.Sprint("g-", i, "-", j/9)
			}
			evs = append(evs, e)
		}
		if err := testenv.Insert(app, evs...); err != nil {
			t.Fatal(err)
		}
		total += len(evs)
	}
	return total
}

// TestRestartWithoutStoreMidDrain: nats-server restarted on its
// port without its store (the stream is gone) in the middle of a drain
// of unordered rows, ordering keys and atomic groups. The relay creates
// the stream again; every done row is at its stream_seq in the new stream,
// or in the old one (its ack came before the stop, its settle after: a
// copy of the old store tells), each key in id order in the new stream,
// each group whole; no attempt is spent.
func TestRestartWithoutStoreMidDrain(t *testing.T) {
	n, app, total := stoppedMidDrain(t)
	oldStore := t.TempDir()
	if err := os.CopyFS(oldStore, os.DirFS(n.StoreDir())); err != nil {
		t.Fatal(err)
	}
	var err error
	for i := 0; i < 20; i++ { // the server's last writes may still be landing
		if err = os.RemoveAll(n.StoreDir()); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	n.Restart()
	waitAllSettled(t, app, total, 90*time.Second)
	nothingSpent(t, app, "across a restart without the store")
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	var rows *sql.Rows
	seqOf := map[string]uint64{}
	for _, m := range msgs {
		id := m.Header.Get(publish.HeaderMsgID)
		if _, dup := seqOf[id]; dup {
			t.Errorf("event %s twice in the new stream", id)
		}
		seqOf[id] = m.Sequence
	}
	oldSeqOf := map[string]uint64{}
	old := testenv.StartNATS(t, func(o *server.Options) { o.StoreDir = oldStore })
	for _, m := range testenv.StreamMessages(t, old.JetStream(t), "EVENTS") {
		oldSeqOf[m.Header.Get(publish.HeaderMsgID)] = m.Sequence
	}
	rows, err = app.Query(`SELECT id, event_id, coalesce(ordering_key, ''), coalesce(atomic_group, ''), processed_at, coalesce(stream_seq, 0) FROM event_queue ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	lastSeq := map[string]uint64{}
	groupSeqs := map[string][]uint64{}
	groupSize := map[string]int{}
	for _, g := range testenv.Strings(t, app, `SELECT atomic_group || ':' || count(*) FROM event_queue WHERE atomic_group IS NOT NULL GROUP BY atomic_group`) {
		var name string
		var size int
		fmt.Sscanf(strings.Replace(g, ":", " ", 1), "%s %d", &name, &size)
		groupSize[name] = size
	}
	var after, missing, wrongSeq, outOfOrder int
	for rows.Next() {
		var id, processed int64 // processed_at: read, not judged
		var eid, key, group string
		var seq uint64
		if err := rows.Scan(&id, &eid, &key, &group, &processed, &seq); err != nil {
			t.Fatal(err)
		}
		got, in := seqOf[eid]
		if !in {
			if oldSeq, stored := oldSeqOf[eid]; !stored || oldSeq != seq {
				missing++
				if missing < 10 {
					t.Logf("row %d (key %q group %q) done at stream_seq %d, in neither stream at it", id, key, group, seq)
				}
			}
			continue
		}
		after++
		if got != seq {
			wrongSeq++
		}
		if key != "" {
			if got < lastSeq[key] {
				outOfOrder++
			}
			lastSeq[key] = got
		}
		if group != "" {
			groupSeqs[group] = append(groupSeqs[group], got)
		}
	}
	broken := 0
	for g, seqs := range groupSeqs {
		whole := len(seqs) == groupSize[g]
		for i := 1; i < len(seqs); i++ {
			whole = whole && seqs[i] == seqs[i-1]+1
		}
		if !whole {
			broken++
			t.Logf("group %s in the new stream at %v", g, seqs)
		}
	}
	t.Logf("%d rows in the new stream; %d messages in it", after, len(msgs))
	if missing+wrongSeq+outOfOrder+broken > 0 {
		t.Fatalf("after the restart without store: %d done rows in neither stream, %d with another stream_seq, %d out of key order, %d groups not whole", missing, wrongSeq, outOfOrder, broken)
	}
}

// TestRestartKeepingStoreMidDrain: the same drain, the server
// stopped for 3 s and started again with its store: every row once in
// the stream, at its stream_seq, nothing spent (the fault suite checks
// the keys' order and the groups across restarts).
func TestRestartKeepingStoreMidDrain(t *testing.T) {
	n, app, total := stoppedMidDrain(t)
	time.Sleep(3 * time.Second)
	n.Restart()
	waitAllSettled(t, app, total, 90*time.Second)
	nothingSpent(t, app, "across a restart")
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	seqOf := map[string]uint64{}
	for _, m := range msgs {
		id := m.Header.Get(publish.HeaderMsgID)
		if _, dup := seqOf[id]; dup {
			t.Errorf("event %s twice in the stream", id)
		}
		seqOf[id] = m.Sequence
	}
	if len(msgs) != total {
		t.Errorf("%d messages in the stream for %d rows", len(msgs), total)
	}
	var bad int
	for _, r := range testenv.Strings(t, app, `SELECT id || ' ' || event_id || ' ' || coalesce(stream_seq, 0) FROM event_queue`) {
		var id, eid string
		var seq uint64
		fmt.Sscanf(r, "%s %s %d", &id, &eid, &seq)
		if seqOf[eid] != seq {
			bad++
		}
	}
	if bad > 0 {
		t.Fatalf("%d rows whose stream_seq is not their message's", bad)
	}
}

// TestFullStreamNamedInReadyz: a stream full with discard new answers
// probes and refuses every message: the relay pauses, and /readyz names
// the stream as full and says what to do ("paused", as for a sealed
// stream), not an unavailable broker.
func TestFullStreamNamedInReadyz(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour, MaxMsgs: 3, Discard: jetstream.DiscardNew}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 6, "Full")
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.Eventually(t, 20*time.Second, "the relay to pause on the full stream", func() bool { return h.relay.Paused() != nil })
	err := h.app.Ready(ctx)
	t.Logf("/readyz: %v", err)
	sealed := "paused" // what the sealed stream's /readyz says instead of "broker unavailable"
	if err == nil || !strings.Contains(err.Error(), "EVENTS") || strings.Contains(err.Error(), "broker unavailable") || !strings.Contains(err.Error(), sealed) {
		t.Fatalf("/readyz for a full stream: %v; want it to name stream EVENTS as full (max_msgs, discard new) and what to do, as for a sealed stream", err)
	}
}

// freezer is a TCP proxy to a server that can stop forwarding in both
// directions while keeping the connections open: a server that hangs
// (SIGSTOP, a full disk that blocks its writes), as opposed to one that
// is gone.
type freezer struct {
	ln     net.Listener
	target string
	frozen atomic.Bool
	// mute stops only the server's answers.
	mute   atomic.Bool
	server string
}

func startFreezer(t *testing.T, target string) *freezer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &freezer{ln: ln, target: target}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			go f.pipe(c, s, &f.mute)
			go f.pipe(s, c, nil)
		}
	}()
	return f
}

func (f *freezer) pipe(dst, src net.Conn, mute *atomic.Bool) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		for f.frozen.Load() {
			time.Sleep(5 * time.Millisecond)
		}
		if mute != nil && mute.Load() {
			continue // the answers are lost
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (f *freezer) url() string { return "nats://" + f.ln.Addr().String() }

// TestShutdownUnderAHungServer: the server hangs mid-drain (its
// connections open, nothing answered). The relay pauses without spending
// attempts; SIGTERM stops it within shutdown_timeout and a few seconds;
// once the server answers again a new relay publishes every row once.
func TestShutdownUnderAHungServer(t *testing.T) {
	n := testenv.StartNATS(t)
	f := startFreezer(t, strings.TrimPrefix(n.URL(), "nats://"))
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	const total = 3000
	testenv.InsertN(t, app, total, "Hung")
	h := startRelay(t, path, f.url(), harnessOptions{batch: 50, inFlight: 200, ackTimeout: 2 * time.Second, shutdown: 3 * time.Second})
	testenv.Eventually(t, 30*time.Second, "some rows done", func() bool { return testenv.Counts(t, app)["done"] > 200 })
	f.frozen.Store(true)
	testenv.Eventually(t, 30*time.Second, "the relay to pause", func() bool { return h.relay.Paused() != nil })
	time.Sleep(3 * time.Second) // probes against the hung server
	nothingSpent(t, app, "under a hung server")
	began := time.Now()
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(began)
	t.Logf("stopped in %v; counts %v", took, testenv.Counts(t, app))
	if took > 3*time.Second+6*time.Second {
		t.Errorf("shutdown under a hung server took %v", took)
	}
	f.frozen.Store(false)
	startRelay(t, path, n.URL(), harnessOptions{batch: 50, inFlight: 200})
	waitAllSettled(t, app, total, 60*time.Second)
	nothingSpent(t, app, "")
	assertOncePerEvent(t, n, app, total)
}

// TestAcksLost: the server stores messages and its answers are
// lost (it dies before the client reads them), then it restarts with its
// store. Every row once in the stream, each row done at its message's
// sequence, no attempt spent.
func TestAcksLost(t *testing.T) {
	n := testenv.StartNATS(t)
	f := startFreezer(t, strings.TrimPrefix(n.URL(), "nats://"))
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	const total = 3000
	evs := make([]testenv.Event, 0, total)
	for i := 0; i < total; i++ {
		e := testenv.NewEvent("Lost", []byte(fmt.Sprint(i)))
		if i%2 == 1 {
			e.OrderingKey = fmt.Sprint("k", i%5)
		}
		evs = append(evs, e)
	}
	h := startRelay(t, path, f.url(), harnessOptions{batch: 50, inFlight: 200, ackTimeout: 2 * time.Second})
	testenv.Eventually(t, 20*time.Second, "connected", func() bool { return h.relay.Paused() == nil && h.relay.LastClaim().IsZero() == true })
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "some rows done", func() bool { return testenv.Counts(t, app)["done"] > 100 })
	f.mute.Store(true)
	time.Sleep(300 * time.Millisecond)
	n.Restart()
	f.mute.Store(false)
	waitAllSettled(t, app, total, 90*time.Second)
	nothingSpent(t, app, "for lost acks")
	assertOncePerEvent(t, n, app, total)
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	seqOf := map[string]uint64{}
	for _, m := range msgs {
		seqOf[m.Header.Get(publish.HeaderMsgID)] = m.Sequence
	}
	bad := 0
	for _, r := range testenv.Strings(t, app, `SELECT event_id || ' ' || coalesce(stream_seq, 0) FROM event_queue`) {
		var eid string
		var seq uint64
		fmt.Sscanf(r, "%s %d", &eid, &seq)
		if seqOf[eid] != seq {
			bad++
		}
	}
	t.Logf("reconciled %v, duplicates %v", scrape(t, h, "outbox_relay_reconciled_rows_total"), scrape(t, h, "outbox_relay_duplicates_total"))
	if bad > 0 {
		t.Fatalf("%d rows whose stream_seq is not their message's", bad)
	}
}

// TestStreamLevelRefusalsOfAtomicBatches: a stream that refuses
// every message (sealed; full with discard new) refuses atomic groups
// and a key's atomic batches too: no attempt spent, nothing
// dead-lettered; once the stream takes messages again every group is
// whole.
func TestStreamLevelRefusalsOfAtomicBatches(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*jetstream.StreamConfig)
		fix  func(t *testing.T, js jetstream.JetStream)
	}{
		{"sealed", func(c *jetstream.StreamConfig) { c.Sealed = true }, func(t *testing.T, js jetstream.JetStream) {
			if err := js.DeleteStream(context.Background(), "EVENTS"); err != nil {
				t.Fatal(err)
			}
		}},
		{"full", func(c *jetstream.StreamConfig) { c.MaxMsgs, c.Discard = 5, jetstream.DiscardNew }, func(t *testing.T, js jetstream.JetStream) {
			testenv.EditStream(t, js, "EVENTS", func(c *jetstream.StreamConfig) { c.MaxMsgs = -1 })
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			app, h, js := relayedRows(t, 5)
			testenv.EditStream(t, js, "EVENTS", tc.edit)
			var evs []testenv.Event
			for g := 0; g < 10; g++ {
				for j := 0; j < 3; j++ {
					e := testenv.NewEvent("Grouped", []byte("x"))
					e.AtomicGroup = fmt.Sprint("g", g)
					evs = append(evs, e)
				}
			}
			for i := 0; i < 80; i++ {
				e := testenv.NewEvent("Keyed", []byte("x"))
				e.OrderingKey = "one-key"
				evs = append(evs, e)
			}
			if err := testenv.Insert(app, evs...); err != nil {
				t.Fatal(err)
			}
			testenv.Eventually(t, 20*time.Second, "the relay to pause", func() bool { return h.relay.Paused() != nil })
			deferred := func() float64 { return scrape(t, h, `outbox_relay_deferred_total{reason="outage"}`) }
			first := deferred()
			testenv.Eventually(t, 30*time.Second, "a try after the pause began", func() bool { return deferred() > first })
			nothingSpent(t, app, "on a stream that refuses every message")
			tc.fix(t, js)
			waitAllSettled(t, app, 115, 90*time.Second)
			nothingSpent(t, app, "")
		})
	}
}
