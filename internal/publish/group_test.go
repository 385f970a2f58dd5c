package publish

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// groupOf returns an atomic group's messages (see batchOf).
func groupOf(name string, first int64, types ...string) []Message {
	msgs := batchOf(first, types...)
	for i := range msgs {
		msgs[i].Row.Group = name
	}
	return msgs
}

// TestGroupStoredWhole: a group lands in consecutive sequences as one
// batch; published again after a crash (its ids stored), each row gets
// its original sequence, nothing stored twice.
func TestGroupStoredWhole(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch)
	ctx := context.Background()
	g := groupOf("g", 1, "A", "B", "A")
	got := waitAll(t, p.PublishGroup(ctx, g))
	for i, r := range got {
		if r.Kind != Stored || r.Seq != uint64(1+i) {
			t.Fatalf("row %d: %v at %d, want stored at %d", i+1, r.Kind, r.Seq, 1+i)
		}
	}
	again := waitAll(t, p.PublishGroup(ctx, g))
	if kinds(again) != "duplicate duplicate duplicate" || again[0].Seq != 1 || again[2].Seq != 3 {
		t.Fatalf("the group again: %s at %d..%d, want duplicates of 1..3", kinds(again), again[0].Seq, again[2].Seq)
	}
	rows, batches := streamRows(t, js)
	if strings.Join(rows, ",") != "1,2,3" || batches[0] == "" || batches[0] != batches[2] {
		t.Fatalf("stream rows %v, batch ids %q: want rows 1 to 3 in one batch, once", rows, batches)
	}
}

// TestGroupNeverStoredInParts: a group with a refused row is refused
// whole (every row rejected, naming the refused one); a group larger than
// the server's batch limit, or with a row too large, can never be stored
// whole and is invalid, every row; none of them stores anything. The
// server's lower limit is not a reason to cut a group, as it is a key's
// batch.
func TestGroupNeverStoredInParts(t *testing.T) {
	_, js, p := batchEnv(t, 5, func(o *server.Options) {
		o.JetStreamLimits.MaxBatchSize = 3
		o.MaxPayload = 4096
	})
	ctx := context.Background()
	got := waitAll(t, p.PublishGroup(ctx, groupOf("denied", 1, "A", "Denied", "A")))
	for _, r := range got {
		if r.Kind != Rejected || !strings.Contains(r.Err.Error(), `atomic group "denied" was not stored: its row 2 was refused`) || !PermissionDenied(r.Err) {
			t.Fatalf("group with a refused row: %v %v", r.Kind, r.Err)
		}
	}
	got = waitAll(t, p.PublishGroup(ctx, groupOf("big", 4, "A", "A", "A", "A")))
	for _, r := range got {
		if r.Kind != Invalid || !strings.Contains(r.Err.Error(), "can never be stored whole") {
			t.Fatalf("group over the server's limit: %v %v", r.Kind, r.Err)
		}
	}
	if p.GroupLimit() != 3 {
		t.Fatalf("group limit %d after the server said 3", p.GroupLimit())
	}
	large := groupOf("large", 8, "A", "A")
	large[1].Row.Payload = make([]byte, 5000)
	for _, r := range waitAll(t, p.PublishGroup(ctx, large)) {
		if r.Kind != Invalid || !errors.Is(r.Err, ErrTooLarge) || !strings.Contains(r.Err.Error(), "its row 9") {
			t.Fatalf("group with a row too large: %v %v", r.Kind, r.Err)
		}
	}
	if rows, _ := streamRows(t, js); len(rows) != 0 {
		t.Fatalf("stream holds rows %v, want none", rows)
	}
	if got := kinds(waitAll(t, p.PublishGroup(ctx, groupOf("ok", 10, "A", "A", "A")))); got != "stored stored stored" {
		t.Fatalf("group at the server's limit: %s", got)
	}
}

// TestGroupsHeldWithoutAtomicBatches: while the stream takes no atomic
// batches a group is withheld (ErrGroupsHeld), not published in parts; a
// group of one row is published as any row.
func TestGroupsHeldWithoutAtomicBatches(t *testing.T) {
	_, js, p := batchEnv(t, 0)
	ctx := context.Background()
	for _, r := range waitAll(t, p.PublishGroup(ctx, groupOf("g", 1, "A", "A"))) {
		if r.Kind != Withheld || !errors.Is(r.Err, ErrGroupsHeld) {
			t.Fatalf("group without atomic batches: %v %v", r.Kind, r.Err)
		}
	}
	if got := kinds(waitAll(t, p.PublishGroup(ctx, groupOf("one", 3, "A")))); got != "stored" {
		t.Fatalf("group of one row: %s", got)
	}
	if rows, _ := streamRows(t, js); strings.Join(rows, ",") != "3" {
		t.Fatalf("stream holds rows %v, want row 3 only", rows)
	}
}

// TestGroupTooManyInFlightSpendsNoAttempt: a server that holds as many
// atomic batches in flight as it allows (another publisher's, left open)
// drops the group's first message and answers "batch is incomplete": no
// row is at fault, so no attempt is spent (a transport failure), and
// nothing of the group is stored.
func TestGroupTooManyInFlightSpendsNoAttempt(t *testing.T) {
	n, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.JetStreamLimits.MaxBatchInflightPerStream = 1 })
	other := nats.NewMsg("events.Other")
	other.Header.Set(jetstreamext.BatchIDHeader, "another-publisher")
	other.Header.Set(jetstreamext.BatchSeqHeader, "1")
	if _, err := n.Conn(t).RequestMsg(other, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	for i, r := range waitAll(t, p.PublishGroup(context.Background(), groupOf("g", 1, "A", "A", "A"))) {
		if r.Kind != Transport {
			t.Fatalf("row %d of a group refused for too many batches in flight: %v (%v); want a transport failure", i+1, r.Kind, r.Err)
		}
	}
	if rows, _ := streamRows(t, js); len(rows) != 0 {
		t.Fatalf("stream holds rows %v of the group", rows)
	}
}

// TestGroupRowTooLargeAfterTheStreamShrank: once the stream's
// max_msg_size is lowered below a row of a group, the group can never be
// stored whole: the stream's refusal makes the publisher read the limit
// again, and every row is invalid as too large.
func TestGroupRowTooLargeAfterTheStreamShrank(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch)
	ctx := context.Background()
	if got := kinds(waitAll(t, p.PublishGroup(ctx, groupOf("first", 1, "A", "A")))); got != "stored stored" {
		t.Fatalf("first group: %s", got)
	}
	info, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	cfg := info.CachedInfo().Config
	cfg.MaxMsgSize = 1000
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	g := groupOf("big", 3, "A", "A")
	g[0].Row.Payload = make([]byte, 2000)
	for i, r := range waitAll(t, p.PublishGroup(ctx, g)) {
		if r.Kind != Invalid || !errors.Is(r.Err, ErrTooLarge) {
			t.Fatalf("row %d of a group with a row over the stream's new max_msg_size: %v (%v); want invalid, too large", i+1, r.Kind, r.Err)
		}
	}
}

// TestGroupWithinTheServersRaisedLimitIsStored: a server may store more
// than 1,000 messages in one atomic batch (jetstream { limits { batch {
// max_msgs } } }): a group is held only to a limit the server said.
func TestGroupWithinTheServersRaisedLimitIsStored(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.JetStreamLimits.MaxBatchSize = 2000 })
	types := make([]string, MaxBatch+1)
	for i := range types {
		types[i] = "A"
	}
	got := waitAll(t, p.PublishGroup(context.Background(), groupOf("g", 1, types...)))
	if got[0].Kind != Stored {
		t.Fatalf("group of %d rows on a server that takes 2000 in a batch: %v (%v)", len(types), got[0].Kind, got[0].Err)
	}
	if rows, _ := streamRows(t, js); len(rows) != len(types) {
		t.Fatalf("stream holds %d rows", len(rows))
	}
}

// TestManyGroupsKeepToTheBatchesInFlight: groups handed over together
// wait for room rather than go past the batches the publisher keeps in
// flight, which a server allowing no more would turn away: all are stored.
func TestManyGroupsKeepToTheBatchesInFlight(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.JetStreamLimits.MaxBatchInflightPerStream = maxBatchesInFlight })
	var acks [][]Ack
	for i := range 100 {
		acks = append(acks, p.PublishGroup(context.Background(), groupOf(fmt.Sprint("g", i), int64(1+2*i), "A", "A")))
	}
	for i, a := range acks {
		if got := kinds(waitAll(t, a)); got != "stored stored" {
			t.Fatalf("group %d: %s", i, got)
		}
	}
	if rows, _ := streamRows(t, js); len(rows) != 200 {
		t.Fatalf("stream holds %d rows, want 200", len(rows))
	}
	if room := p.BatchRoom(); room != MaxBatch {
		t.Fatalf("BatchRoom %d once every group ended", room)
	}
}

// TestGroupsShareABatch: several groups handed over together go in one
// atomic batch; when it fails because of one group's row, each group is
// published again in a batch of its own and gets its own outcome.
func TestGroupsShareABatch(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch)
	ctx := context.Background()
	three := append(append(groupOf("a", 1, "A", "A"), groupOf("b", 3, "A", "A", "A")...), groupOf("c", 6, "A")...)
	if got := kinds(waitAll(t, p.PublishGroup(ctx, three))); got != "stored stored stored stored stored stored" {
		t.Fatalf("three groups together: %s", got)
	}
	rows, batches := streamRows(t, js)
	if strings.Join(rows, ",") != "1,2,3,4,5,6" || batches[0] == "" || batches[0] != batches[5] {
		t.Fatalf("stream rows %v, batch ids %q: want the three groups in one batch", rows, batches)
	}
	var fallbacks []string
	p.OnFallback = func(reason string) { fallbacks = append(fallbacks, reason) }
	refused := append(append(groupOf("d", 7, "A", "A"), groupOf("e", 9, "A", "Denied")...), groupOf("f", 11, "A", "A")...)
	got := waitAll(t, p.PublishGroup(ctx, refused))
	if kinds(got) != "stored stored rejected rejected stored stored" || !PermissionDenied(got[2].Err) {
		t.Fatalf("groups together, one with a refused row: %s (%v)", kinds(got), got[2].Err)
	}
	if strings.Join(fallbacks, " ") != "refused" {
		t.Fatalf("fallbacks counted as %v, want one, refused", fallbacks)
	}
	rows, batches = streamRows(t, js)
	if strings.Join(rows[6:], ",") != "7,8,11,12" || batches[6] != batches[7] || batches[8] != batches[9] || batches[6] == batches[8] {
		t.Fatalf("stream rows %v, batch ids %q: want groups d and f whole, each in a batch of its own", rows[6:], batches[6:])
	}
}

// TestSharedBatchTooLargeKeepsToTheServersLimit: a server whose atomic
// batches hold fewer messages than the relay's limit refuses a shared
// batch as too large and says its limit: the publisher keeps to it from
// then on, and publishes the groups again in batches within it.
func TestSharedBatchTooLargeKeepsToTheServersLimit(t *testing.T) {
	_, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.JetStreamLimits.MaxBatchSize = 3 })
	ctx := context.Background()
	two := append(groupOf("a", 1, "A", "A"), groupOf("b", 3, "A", "A")...)
	if got := kinds(waitAll(t, p.PublishGroup(ctx, two))); got != "stored stored stored stored" {
		t.Fatalf("two groups of two rows, server limit 3: %s", got)
	}
	if rows, _ := streamRows(t, js); strings.Join(rows, ",") != "1,2,3,4" {
		t.Fatalf("stream rows %v", rows)
	}
	if l, g := p.BatchLimit(), p.GroupLimit(); l > 3 || g != 3 {
		t.Fatalf("after the server refused a shared batch as too large (its limit 3): BatchLimit %d, GroupLimit %d; want at most 3, and 3", l, g)
	}
}

// TestSharedBatchBackPressureFailsAtOnce: a shared batch the server turns
// away for too many batches in flight, which no row caused, fails every
// row alike as a transport failure, at once: its groups are not published
// again one by one.
func TestSharedBatchBackPressureFailsAtOnce(t *testing.T) {
	n, js, p := batchEnv(t, MaxBatch, func(o *server.Options) { o.JetStreamLimits.MaxBatchInflightPerStream = 1 })
	var fallbacks []string
	p.OnFallback = func(reason string) { fallbacks = append(fallbacks, reason) }
	other := nats.NewMsg("events.Other")
	other.Header.Set(jetstreamext.BatchIDHeader, "another-publisher")
	other.Header.Set(jetstreamext.BatchSeqHeader, "1")
	if _, err := n.Conn(t).RequestMsg(other, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	var msgs []Message
	for i := range 24 {
		msgs = append(msgs, groupOf(fmt.Sprint("g", i), int64(1+2*i), "A", "A")...)
	}
	for i, r := range waitAll(t, p.PublishGroup(context.Background(), msgs)) {
		if r.Kind != Transport {
			t.Fatalf("row %d of 24 groups sharing a batch under back-pressure: %v (%v); want transport", i, r.Kind, r.Err)
		}
	}
	if len(fallbacks) != 0 {
		t.Fatalf("the groups were published again one by one (%v): no row was at fault", fallbacks)
	}
	if rows, _ := streamRows(t, js); len(rows) != 0 {
		t.Fatalf("stream holds %v", rows)
	}
}
