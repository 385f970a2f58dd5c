package audit_test

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/audit"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// publishDone publishes one message per event id to the stream, as the
// relay does (Nats-Msg-Id, Outbox-Row-Id), and marks each id's row done
// with the sequence the PubAck gave, at the time of the ack; forged
// overrides the sequence recorded, where set.
func publishDone(t *testing.T, js jetstream.JetStream, app *sql.DB, ids []string, forged map[string]uint64) {
	t.Helper()
	for _, id := range ids {
		ev := testenv.NewEvent("Thing", []byte(id))
		ev.EventID = &id
		rowID := testenv.InsertIDs(t, app, ev)[0]
		m := nats.NewMsg("events.Thing")
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Header.Set("Outbox-Row-Id", strconv.FormatInt(rowID, 10))
		ack, err := js.PublishMsg(context.Background(), m)
		if err != nil {
			t.Fatal(err)
		}
		seq := ack.Sequence
		if s, ok := forged[id]; ok {
			seq = s
		}
		testenv.MustExec(t, app, `UPDATE event_queue SET status = 'done', stream_seq = ?, processed_at = ? WHERE id = ?`, seq, time.Now().UnixMilli(), rowID)
	}
}

// eventsDB starts a server with the EVENTS stream, and returns it with a
// migrated outbox file and an application's connection to it.
func eventsDB(t *testing.T) (js jetstream.JetStream, path string, app *sql.DB) {
	t.Helper()
	js = testenv.StartNATS(t).JetStream(t)
	testenv.EventsStream(t, js, 0)
	path = testenv.NewDB(t)
	return js, path, testenv.AppDB(t, path)
}

// eventsReader reads the EVENTS stream's messages by sequence, four
// requests in flight, as the audit command does.
func eventsReader(js jetstream.JetStream) audit.Reader {
	return func(ctx context.Context, seqs []uint64) ([]streamsync.Stored, streamsync.StreamState, error) {
		return streamsync.ReadStored(ctx, js, "EVENTS", seqs, 4)
	}
}

// TestRowsOfADeletedStream: rows published to a stream that was then
// deleted and created again are reported as published to an earlier
// stream, whether the new stream holds another event at their sequence
// or nothing yet; the new stream's rows match, and a forged row of the new
// stream is still a mismatch.
func TestRowsOfADeletedStream(t *testing.T) {
	ctx := context.Background()
	js, path, app := eventsDB(t)
	publishDone(t, js, app, []string{"old-1", "old-2", "old-3", "old-4", "old-5"}, nil)

	testenv.BystanderStream(t, js) // the account keeps a stream while EVENTS is deleted and created again
	if err := js.DeleteStream(ctx, "EVENTS"); err != nil {
		t.Fatal(err)
	}
	// The recreated stream is younger than every old row, to the
	// millisecond the table keeps.
	last := time.Now().UnixMilli()
	testenv.Eventually(t, time.Second, "the clock past the old rows' millisecond", func() bool { return time.Now().UnixMilli() > last })
	testenv.EventsStream(t, js, 0)
	// new-3 is forged: it records sequence 2, which holds new-2.
	publishDone(t, js, app, []string{"new-1", "new-2", "new-3"}, map[string]uint64{"new-3": 2})

	read := eventsReader(js)
	for _, batch := range []int{500, 2} { // one read, and batches that split the old rows from the new
		r, err := audit.Run(ctx, testenv.OpenDB(t, path), read, audit.Options{Batch: batch})
		if err != nil {
			t.Fatal(err)
		}
		if r.Audited != 8 || r.Matched != 2 || r.EarlierStream != 5 || r.Removed != 0 || len(r.Mismatches) != 1 || r.Mismatches[0].EventID != "new-3" {
			t.Fatalf("batch %d: audit after the stream was deleted and created again: %+v", batch, r)
		}
		if r.Created.IsZero() || r.Created.UnixMilli() <= last {
			t.Fatalf("batch %d: stream created at %v, want after the old rows (%d)", batch, r.Created, last)
		}
	}
}

// TestRecordsOfDeletedRows: the records of rows deleted when settled
// (retention.done_rows: delete) are audited with the done rows still in
// the table, in one id order: a forged record is a mismatch.
func TestRecordsOfDeletedRows(t *testing.T) {
	ctx := context.Background()
	js, path, app := eventsDB(t)
	publishDone(t, js, app, []string{"kept-1", "gone-2", "kept-3", "gone-4", "gone-5"}, map[string]uint64{"gone-5": 1})
	testenv.MustExec(t, app, `INSERT INTO outbox_relay_done_event_queue (id, event_id, event_type, ordering_key, created_at, processed_at, stream_seq)
		SELECT id, event_id, event_type, ordering_key, created_at, processed_at, stream_seq FROM event_queue WHERE event_id LIKE 'gone-%'`)
	testenv.MustExec(t, app, `DELETE FROM event_queue WHERE event_id LIKE 'gone-%'`)
	read := eventsReader(js)
	for _, batch := range []int{500, 2} {
		r, err := audit.Run(ctx, testenv.OpenDB(t, path), read, audit.Options{Batch: batch})
		if err != nil {
			t.Fatal(err)
		}
		if r.Audited != 5 || r.Matched != 4 || len(r.Mismatches) != 1 || r.Mismatches[0].EventID != "gone-5" || r.Mismatches[0].MsgID != "kept-1" {
			t.Fatalf("batch %d: audit of rows and records: %+v", batch, r)
		}
	}
}

// TestSequenceNeverStored: a done row whose recorded sequence is above the
// stream's last (a stream restored from an older snapshot) was never
// stored there: a mismatch, not a message the stream removed. A row whose
// message was deleted is still removed.
func TestSequenceNeverStored(t *testing.T) {
	ctx := context.Background()
	js, path, app := eventsDB(t)
	publishDone(t, js, app, []string{"kept", "deleted", "beyond"}, map[string]uint64{"beyond": 99999})
	s, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteMsg(ctx, 2); err != nil {
		t.Fatal(err)
	}
	r, err := audit.Run(ctx, testenv.OpenDB(t, path), eventsReader(js), audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r.Matched != 1 || r.Removed != 1 || len(r.Mismatches) != 1 || r.Mismatches[0].EventID != "beyond" || r.Mismatches[0].MsgID != "" || r.LastSeq != 3 {
		t.Fatalf("audit: %+v; want kept matched, deleted removed, beyond a mismatch past the last sequence 3", r)
	}
	var out strings.Builder
	audit.Summary{Report: r}.Print(&out)
	if !strings.Contains(out.String(), "stream sequence 99999 was never stored (the stream's last is 3)") {
		t.Errorf("the summary does not say the sequence was never stored:\n%s", out.String())
	}
}
