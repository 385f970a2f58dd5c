package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestDeleteDoneRows: with retention.done_rows delete, every published row
// leaves event_queue and its record in outbox_relay_done_event_queue names the stream
// sequence that holds its message; a row that cannot be published stays,
// dead-lettered; each key's messages are in row order; status counts the
// records as done; retention prunes old records and counts them.
func TestDeleteDoneRows(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	old := time.Now().Add(-2 * time.Hour).UnixMilli()
	testenv.MustExec(t, app, `INSERT INTO outbox_relay_done_event_queue (id, event_id, event_type, processed_at, stream_seq) VALUES (1000000, 'old', 'T', ?, NULL)`, old)
	for i := range 300 {
		testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES (?, 'Keyed', randomblob(20000), ?)`,
			fmt.Sprintf("ev-%d", i), []string{"k1", "k2", "k3"}[i%3])
	}
	testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('bad', 'no spaces allowed', 'x')`)
	h := startRelay(t, path, n.URL(), harnessOptions{doneRows: config.DoneRowsDelete, mutateKeeper: func(o *housekeeping.Options) {
		o.RetentionInterval, o.RetainDone = 50*time.Millisecond, time.Hour
	}})
	testenv.Eventually(t, 30*time.Second, "300 rows recorded done and one dead-lettered", func() bool {
		var recs, dead int
		return app.QueryRow(`SELECT (SELECT count(*) FROM outbox_relay_done_event_queue WHERE id < 1000000), (SELECT count(*) FROM event_queue WHERE status = 'dead_lettered')`).Scan(&recs, &dead) == nil &&
			recs == 300 && dead == 1
	})
	if got := testenv.Strings(t, app, `SELECT event_id || ' ' || status FROM event_queue`); len(got) != 1 || got[0] != "bad dead_lettered" {
		t.Fatalf("event_queue holds %v, want only the dead letter", got)
	}
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	bySeq := map[uint64]string{}
	lastByKey := map[string]int64{}
	for _, m := range msgs {
		bySeq[m.Sequence] = m.Header.Get(publish.HeaderMsgID)
	}
	if len(msgs) != 300 {
		t.Fatalf("stream holds %d messages, want 300", len(msgs))
	}
	rows, err := app.Query(`SELECT id, event_id, ordering_key, stream_seq FROM outbox_relay_done_event_queue WHERE id < 1000000 ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var latestSeq int64 // the sequence recorded for the highest id
	for rows.Next() {
		var id, seq int64
		var eventID, key string
		if err := rows.Scan(&id, &eventID, &key, &seq); err != nil {
			t.Fatal(err)
		}
		latestSeq = seq
		if bySeq[uint64(seq)] != eventID {
			t.Errorf("row %d (%s) recorded at sequence %d, which holds %q", id, eventID, seq, bySeq[uint64(seq)])
		}
		if seq <= lastByKey[key] {
			t.Errorf("key %s: row %d stored at %d, after a later sequence %d", key, id, seq, lastByKey[key])
		}
		lastByKey[key] = seq
	}
	testenv.Eventually(t, 10*time.Second, "the old record pruned", func() bool {
		return scrape(t, h, `outbox_relay_pruned_rows_total{table="done_records"}`) == 1
	})
	st, err := admin.ReadStatus(context.Background(), testenv.OpenDB(t, path), admin.StatusOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The latest done row's sequence: with keys side by side (and their
	// rows in atomic batches), not always the stream's last.
	if st.Rows["done"] != 300 || st.Rows["dead_lettered"] != 1 || st.LastStreamSeq != uint64(latestSeq) {
		t.Errorf("status: rows %v, last stream sequence %d; want 300 done, 1 dead letter, %d", st.Rows, st.LastStreamSeq, latestSeq)
	}
}

// TestDeleteDoneNeedsIDsNeverReused: a table whose ids SQLite may give
// again (no AUTOINCREMENT) stops startup with retention.done_rows delete,
// naming the key and the fix; with keep it starts.
func TestDeleteDoneNeedsIDsNeverReused(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path, app := testenv.LegacyDB(t, 3)
	if _, err := schema.Migrate(context.Background(), testenv.OpenDB(t, path)); err != nil {
		t.Fatal(err)
	}
	cfg := harnessConfig(path, n.URL(), harnessOptions{doneRows: config.DoneRowsDelete})
	_, err := daemon.Open(context.Background(), cfg, zap.NewNop(), daemon.Options{Version: "test"})
	var ce *config.Error
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), "retention.done_rows") || !strings.Contains(err.Error(), "AUTOINCREMENT") {
		t.Fatalf("open: %v; want a configuration error naming retention.done_rows and AUTOINCREMENT", err)
	}
	var pending int
	if err := app.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'pending'`).Scan(&pending); err != nil || pending != 3 {
		t.Fatalf("%d rows pending (%v): a refused start must touch nothing", pending, err)
	}
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 3, 10*time.Second)
}
