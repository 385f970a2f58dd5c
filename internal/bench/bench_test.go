package bench

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestStartRelay: a relay child that exits before "relay starting" is
// reported at once with its exit status and its error line; one that logs
// a line of 200 KB first, and goes on writing, is still seen to start, in
// either log format.
func TestStartRelay(t *testing.T) {
	_, _, err := startRelay(exec.Command("sh", "-c", `echo '{"level":"error","msg":"boom"}' >&2; exit 3`))
	if err == nil || !strings.Contains(err.Error(), "the relay exited before logging") || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("startRelay = %v; want the exit at startup, its status and its last line", err)
	}
	for format, line := range map[string]string{
		"json":    `echo '{"level":"info","msg":"relay starting"}' >&2`,
		"console": `printf '2026-01-01T00:00:00.000Z\tINFO\trelay starting\t{"stream": "EVENTS"}\n' >&2`,
	} {
		ch, at, err := startRelay(exec.Command("sh", "-c", `head -c 200000 /dev/zero | tr '\0' x >&2; echo >&2; `+line+`; head -c 200000 /dev/zero >&2; exec sleep 30`))
		if err != nil {
			t.Fatalf("%s, after a 200 KB line: %v", format, err)
		}
		if at.IsZero() {
			t.Errorf("%s: no start time", format)
		}
		ch.Kill()
	}
}

// TestCheckKeyOrder: the read-back of a drain with ordering keys passes a
// stream that holds every row once, with its key, each key's rows in id
// order; and fails, naming what is wrong, on a stream where one key's rows
// are swapped (though the rows of all keys together are not in id order
// either way), a row is missing or stored twice, a message lacks its key,
// or a row of the table is not done.
func TestCheckKeyOrder(t *testing.T) {
	ctx := context.Background()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	const rows, keys = 12, 3
	if err := benchkit.Seed(ctx, db, "event_queue", rows, 8, "done", benchkit.Keys(keys)); err != nil {
		t.Fatal(err)
	}
	// A stream of the rows in the given order, with each row's key (or key(row)).
	publishRows := func(name string, order []int64, key func(row int64) string) string {
		t.Helper()
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}}); err != nil {
			t.Fatal(err)
		}
		for _, row := range order {
			m := nats.NewMsg(name + ".BenchEvent")
			m.Header.Set(publish.HeaderRowID, strconv.FormatInt(row, 10))
			if k := key(row); k != "" {
				m.Header.Set(publish.HeaderOrderingKey, k)
			}
			if _, err := js.PublishMsg(ctx, m); err != nil {
				t.Fatal(err)
			}
		}
		return name
	}
	seeded := func(row int64) string { return benchkit.OrderingKey(int(row-1) % keys) }
	// Key by key: each key's rows in order, the keys interleaved unlike the ids.
	var byKey []int64
	for k := keys - 1; k >= 0; k-- {
		for row := int64(k + 1); row <= rows; row += keys {
			byKey = append(byKey, row)
		}
	}
	msgs, nkeys, err := checkKeyOrder(ctx, js, publishRows("GOOD", byKey, seeded), path)
	if err != nil || msgs != rows || nkeys != keys {
		t.Fatalf("in order per key: %d messages, %d keys, %v; want %d, %d, no error", msgs, nkeys, err, rows, keys)
	}

	swapped := append([]int64(nil), byKey...)
	swapped[0], swapped[1] = swapped[1], swapped[0] // rows 3 and 6, of key 2
	missing := byKey[1:]
	twice := append(append([]int64(nil), byKey...), byKey[0])
	for name, tc := range map[string]struct {
		order []int64
		key   func(int64) string
		want  string
	}{
		"SWAPPED": {swapped, seeded, fmt.Sprintf("ordering key %q out of order: row 3 stored at stream sequence 2, after row 6 at sequence 1", benchkit.OrderingKey(2))},
		"MISSING": {missing, seeded, fmt.Sprintf("the stream holds %d of the %d rows", rows-1, rows)},
		"TWICE":   {twice, seeded, fmt.Sprintf("message %d is row %d, stored before", rows+1, byKey[0])},
		"NOKEY":   {byKey, func(int64) string { return "" }, fmt.Sprintf("message 1 (row %d) has Outbox-Ordering-Key \"\", the row has %q", byKey[0], seeded(byKey[0]))},
	} {
		if _, _, err := checkKeyOrder(ctx, js, publishRows(name, tc.order, tc.key), path); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want an error saying %q", name, err, tc.want)
		}
	}

	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'dead_lettered' WHERE id = 5`)
	if _, _, err := checkKeyOrder(ctx, js, "GOOD", path); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("1 of %d rows are not done", rows)) {
		t.Errorf("with a row dead-lettered: %v; want it named", err)
	}
}

// TestReadStreamLeavesNoConsumer: reading a stream through leaves no
// consumer on it. A fleet's stream lives through the whole run, and a
// consumer left there made every message of the drains after it count
// for that consumer too, which the single file's fresh streams did not
// pay.
func TestReadStreamLeavesNoConsumer(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if err := benchkit.ReplaceStream(ctx, js, "", "BENCH_READ", []string{"bench_read.>"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, err := js.Publish(ctx, "bench_read.x", []byte(strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		var read int
		if err := readStream(ctx, js, "BENCH_READ", func(jetstream.Msg, *jetstream.MsgMetadata) error { read++; return nil }); err != nil || read != 3 {
			t.Fatalf("read %d messages (%v); want 3", read, err)
		}
	}
	s, err := js.Stream(ctx, "BENCH_READ")
	if err != nil {
		t.Fatal(err)
	}
	if n := s.CachedInfo().State.Consumers; n != 0 {
		t.Fatalf("the stream has %d consumers after two reads; want none", n)
	}
}
