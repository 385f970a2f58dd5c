package bench

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestBenchGroups: with Group the bench drains the rows a second time,
// every Group consecutive rows in one atomic group (the last group with
// the rows left over), reports its rate and its ratio to the unordered
// drain, and reads the stream back: every group whole, in consecutive
// sequences of one atomic batch; the printed report says so.
func TestBenchGroups(t *testing.T) {
	bin := relayBinary(t)
	const rows, group = 305, 10
	b := &bench{o: Options{Rows: rows, Size: 64, Group: group, CeilingBatches: []int{500}}, exe: bin}
	rep, err := b.run()
	if err != nil {
		t.Fatal(err)
	}
	g := rep.GroupedDrain
	if rep.Group != group || g == nil || g.Rows != rows || g.RowsPerSec <= 0 || g.CPUSeconds <= 0 || g.LagP50Ms <= 0 || rep.Drain == nil || rep.Drain.Rows != rows {
		t.Fatalf("report %+v, grouped drain %+v", rep, g)
	}
	if want := g.RowsPerSec / rep.Drain.RowsPerSec; rep.GroupedRatio != want {
		t.Fatalf("grouped / unordered %v, want %v", rep.GroupedRatio, want)
	}
	// The check read every row back, of every group (31: the last of 5
	// rows); the other drains have none, and the grouped one no keys.
	if g.GroupCheckedMessages != rows || g.GroupCheckedGroups != (rows+group-1)/group || rep.Drain.GroupCheckedMessages != 0 || g.OrderCheckedMessages != 0 {
		t.Fatalf("groups checked over %d messages of %d groups (unordered drain: %d); want %d of %d (0)",
			g.GroupCheckedMessages, g.GroupCheckedGroups, rep.Drain.GroupCheckedMessages, rows, (rows+group-1)/group)
	}
	var text bytes.Buffer
	Print(&text, rep)
	for _, want := range []string{"relay drain ", "relay drain, groups of 10", "grouped / unordered", "groups checked", "305 messages of 31 groups, each whole in one atomic batch"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("the printed report lacks %q:\n%s", want, text.String())
		}
	}
}

// TestCheckGroups: the read-back of a drain with atomic groups passes a
// stream that holds every row once, each group's rows in one atomic batch
// (a group of one row in none); and fails, naming what is wrong, on a
// stream where a group is cut into two batches, has another message
// between its rows, is missing a row, shares its batch with a row of no
// group, or went one message at a time, or where a row is stored twice
// or a row of the table is not done.
func TestCheckGroups(t *testing.T) {
	ctx := context.Background()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	const rows, size = 10, 4 // groups of 4, 4 and 2
	if err := benchkit.Seed(ctx, db, "event_queue", rows, 8, "done", benchkit.GroupsOf(size)); err != nil {
		t.Fatal(err)
	}
	groups, err := benchkit.AtomicGroups(ctx, db, "event_queue")
	if err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, db, `INSERT INTO event_queue (event_id, event_type, payload, status, processed_at) VALUES ('single', 'BenchEvent', x'00', 'done', 1)`)
	// A stream of the given parts in turn: each a batch of those rows, or
	// a single row published alone (a part of one).
	publishParts := func(name string, parts ...[]int64) string {
		t.Helper()
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, AllowAtomicPublish: true}); err != nil {
			t.Fatal(err)
		}
		for _, part := range parts {
			msgs := make([]*nats.Msg, len(part))
			for i, row := range part {
				msgs[i] = nats.NewMsg(name + ".BenchEvent")
				msgs[i].Header.Set(publish.HeaderRowID, strconv.FormatInt(row, 10))
			}
			if len(msgs) == 1 {
				if _, err := js.PublishMsg(ctx, msgs[0]); err != nil {
					t.Fatal(err)
				}
				continue
			}
			if _, err := jetstreamext.PublishMsgBatch(ctx, js, msgs); err != nil {
				t.Fatal(err)
			}
		}
		return name
	}
	good := [][]int64{{1, 2, 3, 4}, {11}, {5, 6, 7, 8}, {9, 10}}
	msgs, ngroups, err := checkGroups(ctx, js, publishParts("GOOD", good...), path, groups)
	if err != nil || msgs != rows+1 || ngroups != 3 {
		t.Fatalf("every group whole: %d messages, %d groups, %v; want %d, 3, no error", msgs, ngroups, err, rows+1)
	}
	// Several whole groups may share a batch.
	if _, _, err := checkGroups(ctx, js, publishParts("TOGETHER", []int64{1, 2, 3, 4, 5, 6, 7, 8}, []int64{11}, []int64{9, 10}), path, groups); err != nil {
		t.Fatalf("two groups in one batch: %v", err)
	}
	// A group of one row is published as any row.
	one := map[int64]string{1: "alone", 2: "g", 3: "g", 4: "g", 5: "h", 6: "h", 7: "h", 8: "h", 9: "i", 10: "i"}
	if _, _, err := checkGroups(ctx, js, publishParts("ONE", []int64{1}, []int64{2, 3, 4}, []int64{11}, []int64{5, 6, 7, 8}, []int64{9, 10}), path, one); err != nil {
		t.Fatalf("a group of one row alone: %v", err)
	}

	g0, g2 := benchkit.GroupName(0), benchkit.GroupName(2)
	for name, tc := range map[string]struct {
		parts [][]int64
		want  string
	}{
		"CUT":          {[][]int64{{1, 2}, {3, 4}, {11}, {5, 6, 7, 8}, {9, 10}}, fmt.Sprintf("atomic group %q in two batches: row 3 at sequence 3", g0)},
		"BETWEEN":      {[][]int64{{1, 2}, {11}, {3, 4}, {5, 6, 7, 8}, {9, 10}}, fmt.Sprintf("atomic group %q in two batches", g0)},
		"MISSING":      {[][]int64{{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10}}, fmt.Sprintf("the stream holds %d of the %d rows", rows, rows+1)},
		"PART":         {[][]int64{{1, 2, 3}, {11}, {5, 6, 7, 8}, {9, 10}}, fmt.Sprintf("the stream holds %d of the %d rows", rows, rows+1)},
		"SHARED":       {[][]int64{{1, 2, 3, 4}, {5, 6, 7, 8, 11}, {9, 10}}, `(row 11, atomic group "") has Nats-Batch-Id`},
		"ONE_BY_ONE":   {[][]int64{{1, 2, 3, 4}, {11}, {5, 6, 7, 8}, {9}, {10}}, fmt.Sprintf("row 9, the first of atomic group %q, of 2 rows) was not stored in an atomic batch", g2)},
		"TWICE":        {[][]int64{{1, 2, 3, 4}, {11}, {5, 6, 7, 8}, {9, 10}, {11}}, "message 12 is row 11, stored before"},
		"OUT_OF_ORDER": {[][]int64{{1, 2, 4, 3}, {11}, {5, 6, 7, 8}, {9, 10}}, fmt.Sprintf("atomic group %q out of row id order: row 3 at sequence 4, after row 4", g0)},
	} {
		if _, _, err := checkGroups(ctx, js, publishParts(name, tc.parts...), path, groups); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want an error saying %q", name, err, tc.want)
		}
	}

	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'dead_lettered' WHERE id = 5`)
	if _, _, err := checkGroups(ctx, js, "GOOD", path, groups); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("1 of %d rows are not done", rows+1)) {
		t.Errorf("with a row dead-lettered: %v; want it named", err)
	}
}
