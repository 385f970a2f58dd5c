package benchkit

import (
	"context"
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestPinWAL: while the pin holds its snapshot, settling rows of 64 KiB
// as done (an UPDATE that changes each record's size, so that SQLite
// writes the whole record again) grows the WAL by at least a 64 KiB
// record per row, and checkpoints, passive or not, neither copy a frame
// nor shrink it; once the pin is closed a checkpoint empties it.
func TestPinWAL(t *testing.T) {
	ctx := context.Background()
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	const rows, size = 40, 64 << 10
	if err := Seed(ctx, db, "event_queue", rows, size, "pending"); err != nil {
		t.Fatal(err)
	}
	pin, err := PinWAL(ctx, path, "event_queue")
	if err != nil {
		t.Fatal(err)
	}
	defer pin.Close()
	if fi, err := os.Stat(path + "-wal"); err == nil && fi.Size() != 0 {
		t.Fatalf("the WAL holds %d bytes after the pin's checkpoint", fi.Size())
	}
	for id := 1; id <= rows; id += 10 {
		testenv.MustExec(t, db, `UPDATE event_queue SET status = 'done', processed_at = created_at + 1, stream_seq = id WHERE id BETWEEN ? AND ?`, id, id+9)
		var busy, frames, copied int
		if err := db.QueryRow(`PRAGMA wal_checkpoint(PASSIVE)`).Scan(&busy, &frames, &copied); err != nil || copied != 0 {
			t.Fatalf("a passive checkpoint under the pin copied %d of %d frames (%v)", copied, frames, err)
		}
	}
	grown, err := pin.Grown()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d bytes of WAL per row of %d bytes (pages of %d bytes)", grown/rows, size, pin.PageSize())
	if perRow := grown / rows; perRow < 60_000 || perRow > 2*(size+int64(pin.PageSize())+24) || pin.PageSize() <= 0 {
		t.Fatalf("%d bytes of WAL per 64 KiB row settled (pages of %d bytes); want one record's pages and little more", perRow, pin.PageSize())
	}
	// On a connection that does not wait for the pin.
	now, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=0")
	if err != nil {
		t.Fatal(err)
	}
	defer now.Close()
	var busy, frames, copied int
	if err := now.QueryRow(`PRAGMA wal_checkpoint(TRUNCATE)`).Scan(&busy, &frames, &copied); err != nil || busy == 0 {
		t.Fatalf("a truncating checkpoint under the pin: busy %d (%v); want busy", busy, err)
	}
	if again, err := pin.Grown(); err != nil || again != grown {
		t.Fatalf("the WAL grew by %d bytes, then %d after a checkpoint (%v)", grown, again, err)
	}
	if err := pin.Close(); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`PRAGMA wal_checkpoint(TRUNCATE)`).Scan(&busy, &frames, &copied); err != nil || busy != 0 || frames != 0 {
		t.Fatalf("a truncating checkpoint after the pin: busy %d, %d frames left (%v)", busy, frames, err)
	}
}

// TestDoneTableReadBack: the read-backs count the records of the done
// table (retention.done_rows: delete) as done rows, beside the rows
// marked done; MoveDone turns seeded done rows into such records.
func TestDoneTableReadBack(t *testing.T) {
	ctx := context.Background()
	db := testenv.AppDB(t, testenv.NewDB(t))
	if ok, err := HasDoneTable(ctx, db, "event_queue"); err != nil || !ok {
		t.Fatalf("no %s after the relay's migrations (%v)", schema.DoneTable("event_queue"), err)
	}
	if err := Seed(ctx, db, "event_queue", 3, 0, "done"); err != nil {
		t.Fatal(err)
	}
	if err := MoveDone(ctx, db, "event_queue"); err != nil {
		t.Fatal(err)
	}
	if err := Seed(ctx, db, "event_queue", 4, 16, "pending", Keys(2)); err != nil {
		t.Fatal(err)
	}
	if got := testenv.Strings(t, db, `SELECT (SELECT count(*) FROM event_queue) || ' ' || (SELECT group_concat(id) FROM outbox_relay_done_event_queue)`); got[0] != "4 1,2,3" {
		t.Fatalf("rows left and records moved: %q; want 4 rows and the records of rows 1 to 3", got[0])
	}
	keys, notDone, err := DoneKeys(ctx, db, "event_queue")
	if err != nil || len(keys) != 3 || notDone != 4 {
		t.Fatalf("DoneKeys: %v, %d not done (%v); want the 3 records and 4 rows not done", keys, notDone, err)
	}
	// Rows 4 and 5 settled as a relay deleting done rows does, 6 marked done.
	testenv.MustExec(t, db, `INSERT INTO outbox_relay_done_event_queue (id, event_id, event_type, ordering_key, created_at, processed_at)
SELECT id, event_id, event_type, ordering_key, created_at, created_at + 5 FROM event_queue WHERE id IN (4, 5)`)
	testenv.MustExec(t, db, `DELETE FROM event_queue WHERE id IN (4, 5)`)
	testenv.MustExec(t, db, `UPDATE event_queue SET status = 'done', processed_at = created_at + 9 WHERE id = 6`)
	lags, err := Lags(ctx, db, "event_queue", 3)
	if err != nil || len(lags) != 3 || lags[0] != 5 || lags[1] != 5 || lags[2] != 9 {
		t.Fatalf("lags after the 3 seeded done rows: %v (%v); want [5 5 9]", lags, err)
	}
	keys, notDone, err = DoneKeys(ctx, db, "event_queue")
	if err != nil || len(keys) != 6 || notDone != 1 || keys[4] != OrderingKey(0) || keys[5] != OrderingKey(1) || keys[6] != OrderingKey(0) {
		t.Fatalf("DoneKeys: %v, %d not done (%v)", keys, notDone, err)
	}
	testenv.MustExec(t, db, `UPDATE outbox_relay_done_event_queue SET processed_at = processed_at + 3600000 WHERE id = 5`)
	last, err := LastProcessed(ctx, db, "event_queue")
	if err != nil || time.Until(last) < 59*time.Minute {
		t.Fatalf("last processed %v (%v); want record 5's, an hour ahead", last, err)
	}
}
