package publish

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// batchEnv is a server whose user "relay" may not publish on
// events.Denied, a stream EVENTS that allows atomic batches, and a
// publisher with batches enabled.
func batchEnv(t *testing.T, limit int, opts ...func(*server.Options)) (*testenv.NATS, jetstream.JetStream, *JetStream) {
	t.Helper()
	n := testenv.StartNATS(t, append([]func(*server.Options){func(o *server.Options) {
		o.Users = []*server.User{{Username: "admin", Password: "admin"},
			{Username: "relay", Password: "pw", Permissions: &server.Permissions{Publish: &server.SubjectPermission{Deny: []string{"events.Denied"}}}}}
		o.NoAuthUser = "admin"
	}}, opts...)...)
	js := n.JetStream(t)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour, AllowAtomicPublish: true}); err != nil {
		t.Fatal(err)
	}
	p := newJS(t, connect(t, n.URL(), ConnectOptions{User: "relay", Password: "pw"}), 5*time.Second)
	p.EnableBatches(limit)
	return n, js, p
}

// batchOf returns n messages on events.<type>, rows first..first+n-1.
func batchOf(first int64, types ...string) []Message {
	msgs := make([]Message, len(types))
	for i, typ := range types {
		r := row(typ, []byte("x"))
		r.ID = first + int64(i)
		msgs[i] = Message{Row: r, Subject: "events." + typ}
	}
	return msgs
}

func waitAll(t *testing.T, acks []Ack) []Result {
	t.Helper()
	out := make([]Result, len(acks))
	for i, a := range acks {
		out[i] = a.Wait(ctxTimeout(t, 20*time.Second))
	}
	return out
}

// kinds returns the results' kinds as one string, for comparing.
func kinds(rs []Result) string {
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = r.Kind.String()
	}
	return strings.Join(s, " ")
}

// streamRows returns the Outbox-Row-Id of every message in EVENTS, in
// stream order, and each message's Nats-Batch-Id.
func streamRows(t *testing.T, js jetstream.JetStream) (rows, batches []string) {
	t.Helper()
	for _, m := range testenv.StreamMessages(t, js, "EVENTS") {
		rows = append(rows, m.Header.Get(HeaderRowID))
		batches = append(batches, m.Header.Get(batchIDHeader))
	}
	return rows, batches
}

const batchIDHeader = jetstreamext.BatchIDHeader

// TestBatchStoredAllAtOnce: a batch lands in consecutive sequences, in
// order, and each message's result carries its own sequence.
func TestBatchStoredAllAtOnce(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch)
	if got := waitAll(t, p.Publish(context.Background(), batchOf(1, "A"))); got[0].Kind != Stored {
		t.Fatalf("a single message first: %v", got[0])
	}
	got := waitAll(t, p.PublishBatch(context.Background(), batchOf(2, "A", "B", "A")))
	for i, r := range got {
		if r.Kind != Stored || r.Seq != uint64(2+i) {
			t.Fatalf("message %d: %v sequence %d, want stored at %d", i, r.Kind, r.Seq, 2+i)
		}
	}
	rows, batches := streamRows(t, js)
	if strings.Join(rows, ",") != "1,2,3,4" {
		t.Fatalf("stream holds rows %v", rows)
	}
	if batches[0] != "" || batches[1] == "" || batches[1] != batches[3] {
		t.Fatalf("batch ids %q: the single message has none, the three share one", batches)
	}
}

// TestBatchFallsBackOneByOne: a batch the stream refuses because of one
// message is published again one message at a time: the rows before the
// faulty one are stored once, the faulty one gets its own outcome (a
// refusal, or a duplicate with the original's sequence), the rest are
// withheld.
func TestBatchFallsBackOneByOne(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch)
	var reasons []string
	p.OnFallback = func(reason string) { reasons = append(reasons, reason) }
	ctx := context.Background()
	// A duplicate inside the batch: stored before (a crash between the
	// PubAck and the settle), it fails the batch whole.
	first := batchOf(1, "A", "A")
	if got := kinds(waitAll(t, p.PublishBatch(ctx, first))); got != "stored stored" {
		t.Fatalf("first batch: %s", got)
	}
	again := append(first, batchOf(3, "A")...)
	got := waitAll(t, p.PublishBatch(ctx, again))
	if kinds(got) != "duplicate duplicate stored" || got[0].Seq != 1 || got[1].Seq != 2 || got[2].Seq != 3 {
		t.Fatalf("batch with stored ids: %s, sequences %d %d %d; want duplicates of 1 and 2, then stored at 3", kinds(got), got[0].Seq, got[1].Seq, got[2].Seq)
	}
	// A refused subject in the middle, and as the last message (which the
	// server does not answer).
	for _, c := range []struct {
		types []string
		want  string
	}{
		{[]string{"A", "Denied", "A"}, "stored rejected withheld"},
		{[]string{"A", "Denied"}, "stored rejected"},
	} {
		start := time.Now()
		got := waitAll(t, p.PublishBatch(ctx, batchOf(10, c.types...)))
		if kinds(got) != c.want || !PermissionDenied(got[1].Err) {
			t.Fatalf("batch %v: %s (%v), want %s", c.types, kinds(got), got[1].Err, c.want)
		}
		if d := time.Since(start); d > 4*time.Second {
			t.Fatalf("batch %v: the refusal took %v, the ack timeout (5 s) is not how it is found", c.types, d)
		}
	}
	if got := strings.Join(reasons, " "); got != "duplicate incomplete refused" {
		t.Fatalf("fallbacks counted as %q", got)
	}
	rows, _ := streamRows(t, js)
	if strings.Join(rows, ",") != "1,2,3,10,10" {
		t.Fatalf("stream holds rows %v: each stored row once, the refused ones and those after them not", rows)
	}
}

// TestBatchTransportSpendsNothing: a batch that the server does not answer
// (it is down) is a transport failure for every row: no attempt spent.
func TestBatchTransportSpendsNothing(t *testing.T) {
	n, _, p := batchEnv(t, MaxBatch)
	n.Stop()
	for _, r := range waitAll(t, p.PublishBatch(context.Background(), batchOf(1, "A", "A", "A"))) {
		if r.Kind != Transport {
			t.Fatalf("broker down: %v %v, want transport", r.Kind, r.Err)
		}
	}
}

// TestBatchLimits: a server with a lower batch limit is kept to (a batch
// it refused as too large goes as batches of its size), and a stream that
// does not allow atomic publish turns batches off (the rows go one at a
// time, and BatchesOff says why).
func TestBatchLimits(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch, func(o *server.Options) {
		o.JetStreamLimits.MaxBatchSize = 3
	})
	got := waitAll(t, p.PublishBatch(context.Background(), batchOf(1, "A", "A", "A", "A", "A")))
	if kinds(got) != "stored stored stored stored stored" {
		t.Fatalf("batch over the server's limit: %s", kinds(got))
	}
	if p.BatchLimit() != 3 {
		t.Fatalf("batch limit %d after the server said 3", p.BatchLimit())
	}
	if got := kinds(waitAll(t, p.PublishBatch(context.Background(), batchOf(6, "A", "A", "A")))); got != "stored stored stored" {
		t.Fatalf("batch at the server's limit: %s", got)
	}
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.AllowAtomicPublish = false
	if _, err := js.UpdateStream(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	if got := kinds(waitAll(t, p.PublishBatch(context.Background(), batchOf(9, "A", "A")))); got != "stored stored" {
		t.Fatalf("batch on a stream without allow_atomic: %s", got)
	}
	if p.BatchLimit() != 0 || p.BatchesOff() == nil || !strings.Contains(p.BatchesOff().Error(), "allow_atomic") {
		t.Fatalf("after the stream refused batches: limit %d, %v", p.BatchLimit(), p.BatchesOff())
	}
	rows, batches := streamRows(t, js)
	if strings.Join(rows, ",") != "1,2,3,4,5,6,7,8,9,10" {
		t.Fatalf("stream rows %v", rows)
	}
	// Rows 1 to 5 in two batches of the server's size, 6 to 8 in one,
	// 9 and 10 one at a time.
	for _, c := range []struct{ from, to int }{{0, 2}, {3, 4}, {5, 7}} {
		for i := c.from; i <= c.to; i++ {
			if batches[i] == "" || batches[i] != batches[c.from] || (c.from > 0 && batches[c.from] == batches[c.from-1]) {
				t.Fatalf("batch ids %q: want rows %d to %d in a batch of their own", batches, c.from+1, c.to+1)
			}
		}
	}
	if batches[8] != "" || batches[9] != "" {
		t.Fatalf("batch ids %q: rows 9 and 10 were to go one at a time", batches)
	}
}

// TestBatchTooManyInFlightGoesOneByOne: a server that holds as many
// batches in flight as it allows (another publisher's, left open) refuses
// the next batch's first message, and the batch is incomplete: its rows go
// one at a time, stored in order, no attempt spent.
func TestBatchTooManyInFlightGoesOneByOne(t *testing.T) {
	n, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.JetStreamLimits.MaxBatchInflightPerStream = 1 })
	other := nats.NewMsg("events.Other")
	other.Header.Set(jetstreamext.BatchIDHeader, "another-publisher")
	other.Header.Set(jetstreamext.BatchSeqHeader, "1")
	nc := n.Conn(t)
	if _, err := nc.RequestMsg(other, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := kinds(waitAll(t, p.PublishBatch(context.Background(), batchOf(1, "A", "A", "A")))); got != "stored stored stored" {
		t.Fatalf("batch beyond the server's limit: %s", got)
	}
	rows, batches := streamRows(t, js)
	if strings.Join(rows, ",") != "1,2,3" || strings.Join(batches, "") != "" {
		t.Fatalf("stream rows %v, batch ids %q: want rows 1 to 3 stored one at a time", rows, batches)
	}
}

// TestBatchHeadersCountTowardsTheSize: a row that fits max_payload alone,
// but not with the batch's headers, is not sent in a batch: the rows go
// one at a time, all stored, instead of failing the batch as an outage.
func TestBatchHeadersCountTowardsTheSize(t *testing.T) {
	const maxPayload = 4096
	_, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.MaxPayload = maxPayload })
	msgs := batchOf(1, "A", "A")
	probe := NewMsg(msgs[1])
	msgs[1].Row.Payload = make([]byte, maxPayload-40-(Size(probe)-len(probe.Data)))
	if err := p.fits(context.Background(), NewMsg(msgs[1])); err != nil {
		t.Fatalf("row 2 alone does not fit: %v", err)
	}
	if got := waitAll(t, p.PublishBatch(context.Background(), msgs)); kinds(got) != "stored stored" {
		t.Fatalf("batch of two rows that each fit max_payload: %s (%v)", kinds(got), got[1].Err)
	}
	if _, batches := streamRows(t, js); strings.Join(batches, "") != "" {
		t.Fatalf("batch ids %q: the rows were to go one at a time", batches)
	}
}

// TestBatchRoomCountsBatchesHandedOver: BatchRoom counts a batch from the
// moment it is handed over, not from when it starts.
func TestBatchRoomCountsBatchesHandedOver(t *testing.T) {
	_, _, p := batchEnv(t, MaxBatch)
	var acks [][]Ack
	for i := range maxBatchesInFlight {
		acks = append(acks, p.PublishBatch(context.Background(), batchOf(int64(1+2*i), "A", "A")))
	}
	room := p.BatchRoom()
	for _, a := range acks {
		waitAll(t, a)
	}
	if room != 0 {
		t.Fatalf("BatchRoom %d with %d batches handed over, want 0", room, maxBatchesInFlight)
	}
	if room := p.BatchRoom(); room != MaxBatch {
		t.Fatalf("BatchRoom %d once they ended", room)
	}
}

// TestBatchAckPrefersItsResult: once a batch's outcome is known, every row
// of it gets that outcome, even when the wait ends at the same time (at
// shutdown), so that a key's rows are not settled some done, some not.
func TestBatchAckPrefersItsResult(t *testing.T) {
	b := &batch{done: make(chan struct{}), results: []Result{{Kind: Stored, Seq: 7}}}
	close(b.done)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 100 {
		if r := (batchAck{b, 0}).Wait(ctx); r.Kind != Stored {
			t.Fatalf("wait %d: %v, want stored (the batch was stored)", i, r.Kind)
		}
	}
}

// TestBatchInPartsStopsAtARefusal: a batch sent as several (the server
// takes fewer) stops at the first part not stored whole: the parts after
// it are withheld, not sent.
func TestBatchInPartsStopsAtARefusal(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.JetStreamLimits.MaxBatchSize = 3 })
	got := waitAll(t, p.PublishBatch(context.Background(), batchOf(1, "A", "Denied", "A", "A", "A")))
	if kinds(got) != "stored rejected withheld withheld withheld" {
		t.Fatalf("batch in parts with a refused row in the first: %s", kinds(got))
	}
	if rows, _ := streamRows(t, js); strings.Join(rows, ",") != "1" {
		t.Fatalf("stream holds rows %v, want only row 1", rows)
	}
}
