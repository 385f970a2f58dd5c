package claim

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestSettleDeletesDoneRows: with DeleteDone a row settled as done leaves
// the outbox table and its record (event id, type, key, times, stream
// sequence) is in the records table; retried and dead-lettered rows stay
// as they are; a row settled meanwhile by someone else is stale and
// leaves no record.
func TestSettleDeletesDoneRows(t *testing.T) {
	ctx := context.Background()
	s := New(testenv.MigratedDB(t), Options{DeleteDone: true})
	db := testenv.AppDB(t, s.db.Path())
	testenv.InsertRows(t, db, 4, "pending")
	testenv.MustExec(t, db, `UPDATE event_queue SET ordering_key = 'k' WHERE id = 1`)
	rows, err := s.Claim(ctx, 4, 0)
	if err != nil || len(rows) != 4 {
		t.Fatal(rows, err)
	}
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'done' WHERE id = ?`, rows[3].ID)
	outs := []event.Outcome{
		{Row: rows[0], Settlement: event.Done, StreamSeq: 41},
		{Row: rows[1], Settlement: event.Done, StreamSeq: 42},
		event.Reject(rows[2], "refused", 1, time.Now()),
		{Row: rows[3], Settlement: event.Done, StreamSeq: 43},
	}
	stale, err := s.Settle(ctx, outs, 0)
	if err != nil || fmt.Sprint(stale) != "[3]" {
		t.Fatalf("stale %v, %v; want [3]: row 4 was done already", stale, err)
	}
	if got := testenv.Strings(t, db, `SELECT id || ':' || status FROM event_queue ORDER BY id`); fmt.Sprint(got) != "[3:dead_lettered 4:done]" {
		t.Errorf("outbox rows %v, want the done rows gone and the others as they were", got)
	}
	got := testenv.Strings(t, db, `SELECT d.id || ' ' || d.event_id || ' ' || d.event_type || ' ' || coalesce(d.ordering_key, '-') || ' ' || d.stream_seq || ' ' || (d.processed_at >= d.created_at)
		FROM outbox_relay_done_event_queue AS d ORDER BY d.id`)
	want := fmt.Sprint([]string{
		fmt.Sprintf("1 %s %s k 41 1", rows[0].EventID, rows[0].EventType),
		fmt.Sprintf("2 %s %s - 42 1", rows[1].EventID, rows[1].EventType),
	})
	if fmt.Sprint(got) != want {
		t.Errorf("done records %v, want %v", got, want)
	}
	if inFlight(s) != 0 {
		t.Errorf("%d rows still in flight", inFlight(s))
	}
}

// TestSettlingWritesLittleWhateverThePayload measures what settling rows
// as done adds to the WAL, a reader pinning it so that no checkpoint
// moves or restarts it. Marking a row done rewrites its whole record,
// overflow pages and all, since the record changes size: a 64 KiB row
// costs more than 64 KiB. Deleting it (DeleteDone) frees the pages
// without writing them: what is left (the indexes, the record in the
// records table, the freelist) is the same for 256 B and for 64 KiB.
func TestSettlingWritesLittleWhateverThePayload(t *testing.T) {
	const n, batch = 400, 100
	keepLarge := settleWALBytes(t, false, n, 64<<10, batch)
	small, large := settleWALBytes(t, true, n, 256, batch), settleWALBytes(t, true, n, 64<<10, batch)
	t.Logf("WAL bytes per row settled: marked done, 64 KiB: %d; deleted, 256 B: %d, 64 KiB: %d", keepLarge, small, large)
	if keepLarge < 64<<10 {
		t.Errorf("marking a 64 KiB row done wrote %d bytes of WAL: less than the record", keepLarge)
	}
	if large > small+256 || large > 1024 {
		t.Errorf("deleting a 64 KiB row wrote %d bytes of WAL, a 256 B row %d: want at most 256 more, and at most 1 KiB", large, small)
	}
}

// claimSeeded seeds a new database with n pending rows of size bytes and
// claims them all with a Store that deletes done rows or keeps them.
func claimSeeded(t *testing.T, deleteDone bool, n, size int) (*Store, *sql.DB, []event.Row) {
	t.Helper()
	s := New(testenv.MigratedDB(t), Options{DeleteDone: deleteDone})
	db := testenv.AppDB(t, s.db.Path())
	if err := benchkit.Seed(context.Background(), db, "event_queue", n, size, "pending"); err != nil {
		t.Fatal(err)
	}
	rows, err := s.Claim(context.Background(), n, 0)
	if err != nil || len(rows) != n {
		t.Fatal(len(rows), err)
	}
	return s, db, rows
}

// settleWALBytes claims n pending rows of size bytes, settles them all as
// done in transactions of batch rows while a reader pins the WAL, and
// returns the WAL bytes per row.
func settleWALBytes(t *testing.T, deleteDone bool, n, size, batch int) int64 {
	ctx := context.Background()
	s, db, rows := claimSeeded(t, deleteDone, n, size)
	pin, err := benchkit.PinWAL(ctx, s.db.Path(), "event_queue")
	if err != nil {
		t.Fatal(err)
	}
	defer pin.Close()
	for i := 0; i < n; i += batch {
		var outs []event.Outcome
		for _, r := range rows[i:min(i+batch, n)] {
			outs = append(outs, event.Outcome{Row: r, Settlement: event.Done, StreamSeq: uint64(r.ID)})
		}
		if stale, err := s.Settle(ctx, outs, 0); err != nil || len(stale) > 0 {
			t.Fatal(stale, err)
		}
	}
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'pending'`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d rows left pending, %v", left, err)
	}
	if deleteDone {
		var recs int
		if err := db.QueryRow(`SELECT count(*) FROM ` + schema.DoneTable("event_queue")).Scan(&recs); err != nil || recs != n {
			t.Fatalf("%d done records, %v; want %d", recs, err, n)
		}
	}
	grown, err := pin.Grown()
	if err != nil {
		t.Fatal(err)
	}
	return grown / int64(n)
}

// TestSettlingReadsALargeRowOnce: settling rows of 64 KiB (16 overflow
// pages each) reads each row's pages from the file about once, in either
// mode, as the relay settles them: their payloads dropped once published,
// in one settle of many rows. Each statement of a settle that reads a
// column stored after the payload walks the row's overflow pages; they
// come from the writer's page cache only while the statement's rows fit
// in it. A reader pins the WAL, so that no checkpoint at commit reads the
// pages again (the relay checkpoints on a connection of its own). Read
// calls are counted in /proc/self/io.
func TestSettlingReadsALargeRowOnce(t *testing.T) {
	const n, size, pages = 100, 64 << 10, 16
	ctx := context.Background()
	for _, deleteDone := range []bool{true, false} {
		s, _, rows := claimSeeded(t, deleteDone, n, size)
		outs := make([]event.Outcome, n)
		for i, r := range rows {
			r.Payload = nil
			outs[i] = event.Outcome{Row: r, Settlement: event.Done, StreamSeq: uint64(r.ID)}
		}
		pin, err := benchkit.PinWAL(ctx, s.db.Path(), "event_queue")
		if err != nil {
			t.Fatal(err)
		}
		before := testenv.ProcIO(t, "syscr")
		if stale, err := s.Settle(ctx, outs, 0); err != nil || len(stale) > 0 {
			t.Fatal(stale, err)
		}
		perRow := float64(testenv.ProcIO(t, "syscr")-before) / n
		pin.Close()
		t.Logf("delete done rows %v: %.1f read calls a row settled", deleteDone, perRow)
		// In one statement for all the rows, each row's pages were read
		// twice (keep) or three times (delete).
		if perRow > 1.5*pages || perRow < pages/2 {
			t.Errorf("delete done rows %v: %.1f read calls a row of %d pages settled, want about %d", deleteDone, perRow, pages, pages)
		}
	}
}

// TestDeleteDoneKeepsARecordOfAnIDGivenAgain: an application that writes
// ids itself can write a published (deleted) row's id again; that row is
// then marked done in place, and the first row's record stays.
func TestDeleteDoneKeepsARecordOfAnIDGivenAgain(t *testing.T) {
	ctx := context.Background()
	s := New(testenv.MigratedDB(t), Options{DeleteDone: true})
	db := testenv.AppDB(t, s.db.Path())
	for i, ev := range []string{"first", "second"} {
		testenv.MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload) VALUES (7, ?, 'T', 'x')`, ev)
		rows, err := s.Claim(ctx, 10, 0)
		if err != nil || len(rows) != 1 {
			t.Fatal(rows, err)
		}
		if stale, err := s.Settle(ctx, []event.Outcome{{Row: rows[0], Settlement: event.Done, StreamSeq: uint64(i + 1)}}, 0); err != nil || len(stale) > 0 {
			t.Fatal(stale, err)
		}
	}
	if got := testenv.Strings(t, db, `SELECT event_id || ' ' || stream_seq FROM outbox_relay_done_event_queue`); fmt.Sprint(got) != "[first 1]" {
		t.Errorf("records %v, want the first row's", got)
	}
	if got := testenv.Strings(t, db, `SELECT event_id || ' ' || status || ' ' || stream_seq FROM event_queue`); fmt.Sprint(got) != "[second done 2]" {
		t.Errorf("outbox rows %v, want the second row marked done", got)
	}
}
