package bench

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// relayBinary builds this module's outbox-relay for the bench's children
// (the test binary has no run command).
func relayBinary(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary and runs the relay")
	}
	bin := filepath.Join(t.TempDir(), "outbox-relay")
	if out, err := exec.Command("go", "build", "-o", bin, "../../cmd/outbox-relay").CombinedOutput(); err != nil {
		t.Fatalf("build the relay: %v\n%s", err, out)
	}
	return bin
}

// TestSettleWAL: the drain with the WAL pinned, with the real relay as a
// child, settles every row and measures what the relay's writes add to
// the WAL per row. Settling a row of 64 KiB as done changes its record's
// size, and SQLite then writes the whole record again: more than 60,000
// bytes of WAL per row, and not several records' worth.
func TestSettleWAL(t *testing.T) {
	bin := relayBinary(t)
	ctx := context.Background()
	n := testenv.StartNATS(t)
	names := benchNames{stream: "BENCH_WAL", prefix: "bench_wal"}
	if err := benchkit.ReplaceStream(ctx, n.JetStream(t), "", names.stream, []string{names.prefix + ".>"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	const rows, size = 300, 64 << 10
	b := &bench{o: Options{Size: size}, exe: bin}
	path := filepath.Join(t.TempDir(), "wal.db")
	r, err := b.benchRelay(ctx, path, n.URL(), names, drain{rows: rows, pinWAL: true})
	if err != nil {
		t.Fatal(err)
	}
	perRow := float64(r.WALBytes) / float64(r.Rows)
	t.Logf("%.0f bytes of WAL per row of %d bytes (%d rows, pages of %d bytes)", perRow, size, r.Rows, r.WALPageSize)
	if r.Rows != rows || r.WALPageSize <= 0 || perRow < 60_000 || perRow > 3*size {
		t.Fatalf("%d rows, %d bytes of WAL (pages of %d bytes): %.0f per row; want %d rows and 60,000 to %d bytes per row", r.Rows, r.WALBytes, r.WALPageSize, perRow, rows, 3*size)
	}
	if lags, err := benchkit.Lags(ctx, testenv.AppDB(t, path), "event_queue", 0); err != nil || len(lags) != rows {
		t.Fatalf("%d rows done (%v); want %d", len(lags), err, rows)
	}
}

// TestDrainDeleteDone: with --delete-done the relay children delete the
// rows they settle and record them in outbox_relay_done_event_queue, and the bench
// reads those records as done rows: the seeded done rows are records
// there, the drain's rows are counted and their lags read, and a keyed
// drain's order check passes.
func TestDrainDeleteDone(t *testing.T) {
	if !slices.ContainsFunc(config.Keys(), func(k config.Key) bool { return k.Name == "retention.done_rows" }) {
		t.Skip("this relay has no retention.done_rows")
	}
	bin := relayBinary(t)
	ctx := context.Background()
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	names := benchNames{stream: "BENCH_DELETE", prefix: "bench_delete"}
	if err := benchkit.ReplaceStream(ctx, js, "", names.stream, []string{names.prefix + ".>"}, time.Hour); err != nil {
		t.Fatal(err)
	}
	const rows, done, keys = 400, 100, 7
	b := &bench{o: Options{Size: 512, DeleteDone: true}, exe: bin}
	path := filepath.Join(t.TempDir(), "delete.db")
	r, err := b.benchRelay(ctx, path, n.URL(), names, drain{rows: rows, done: done, keys: keys, pinWAL: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d rows at %.0f rows/s; %.0f bytes of WAL per row of 512 bytes", r.Rows, r.RowsPerSec, float64(r.WALBytes)/float64(r.Rows))
	if r.Rows != rows || r.DoneRows != done || r.RowsPerSec <= 0 || r.LagP50Ms <= 0 || r.WALBytes <= 0 {
		t.Fatalf("run %+v", r)
	}
	db := testenv.AppDB(t, path)
	if got := testenv.Strings(t, db, `SELECT (SELECT count(*) FROM event_queue) || ' ' || (SELECT count(*) FROM outbox_relay_done_event_queue) || ' ' || (SELECT min(id) FROM outbox_relay_done_event_queue)`); got[0] != fmt.Sprintf("0 %d 1", rows+done) {
		t.Fatalf("rows left, records, first record: %q; want none left and %d records from id 1", got[0], rows+done)
	}
	// The seeded records have no key; the drained rows have theirs.
	msgs, nkeys, err := checkKeyOrder(ctx, js, names.stream, path)
	if err == nil || !strings.Contains(err.Error(), "the stream holds") {
		t.Fatalf("order check with the seeded records, which were never published: %d messages, %d keys, %v", msgs, nkeys, err)
	}
	testenv.MustExec(t, db, `DELETE FROM outbox_relay_done_event_queue WHERE id <= ?`, done)
	if msgs, nkeys, err = checkKeyOrder(ctx, js, names.stream, path); err != nil || msgs != rows || nkeys != keys {
		t.Fatalf("order check: %d messages, %d keys, %v; want %d and %d", msgs, nkeys, err, rows, keys)
	}
}
