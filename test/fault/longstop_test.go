//go:build fault

package fault

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestLongStopsPastTheWindow: the stream's duplicate window is 1 s, so
// JetStream's dedup cannot catch what a relay publishes again after a
// longer stop; only the reconciliation when a relay begins to lead keeps
// every event stored once. The application writes 800 rows a second
// throughout. Five times the leader is killed (kill -9) at a random
// moment while it publishes, with the application's write lock held
// (BEGIN IMMEDIATE, by the test) from just before: the relay goes on
// claiming and publishing, its PubAcks come, and it cannot settle them,
// so it dies holding rows the stream has stored (each round checks that
// the stream grew while the lock was held, and counts the stored rows the
// table still has pending). Then no relay leads for 3 to 5 s, several
// times the window, while the application goes on writing; then the relay
// is restarted, or, once, the standby (frozen with SIGSTOP over the stop)
// takes over. Each round checks that the stored rows' messages begin at
// or after the position the file records (scan_from), that the next
// leader reconciles exactly the rows stored and pending (its log line and
// outbox_relay_reconciled_rows_total), each done at the sequence its
// message was stored at, before it publishes. At the end every row is
// done, the stream holds every event once, and each done row's
// stream_seq holds its own message.
func TestLongStopsPastTheWindow(t *testing.T) {
	const window = time.Second
	relayEnv := []string{"OUTBOX_RELAY_STREAM_DUPLICATE_WINDOW=" + window.String()}
	e := newEnv(t)
	db := e.open()
	js := e.jetStream()
	// Stopped (SIGTERM) after the last round: it writes throughout.
	w := e.writer("-rows", "1000000", "-rate", "800")
	time.Sleep(2 * time.Second) // a backlog for the first relay
	leader := "a"
	e.startRelay(leader, relayEnv...)
	e.waitMetric(leader, "outbox_relay_published_total", 1)
	if d := e.streamInfo(js).Config.Duplicates; d != window {
		t.Fatalf("the relay created the stream with a duplicate window of %v, want %v", d, window)
	}
	rng := rand.New(rand.NewPCG(17, 17))
	var maxRecovery, shortest, longest time.Duration
	var stranded, reconciled int
	var perRound []string
	for round, takeover := range []string{"restart", "restart", "standby", "restart", "restart"} {
		round++
		next := leader
		if takeover == "standby" {
			next = map[string]string{"a": "b", "b": "a"}[leader]
			e.startRelay(next, relayEnv...)
			if _, err := e.relays[next].WaitFor("standing by: another relay of this outbox table leads", 30*time.Second); err != nil {
				t.Fatalf("relay %s %v", next, err)
			}
		}
		// A random moment while the leader publishes: it drains the
		// backlog of the stop, or keeps up with the application.
		e.waitMetric(leader, "outbox_relay_published_total", 1)
		time.Sleep(time.Duration(rng.IntN(300)) * time.Millisecond)
		unlock, tries := e.lockWhilePublishing(js, db, leader)
		time.Sleep(time.Duration(50+rng.IntN(350)) * time.Millisecond)
		if takeover == "standby" {
			e.relays[next].Signal(syscall.SIGSTOP) // it takes over once the stop is over
		}
		e.killRelay(leader)
		killed := time.Now()
		quiet := e.quietSeq(js)
		unlock()
		held := pendingIDs(t, db)
		stored := e.storedPending(held)
		var scanFrom int64
		if err := db.QueryRow(`SELECT coalesce(scan_from, 0) FROM outbox_relay_published`).Scan(&scanFrom); err != nil {
			t.Fatal(err)
		}
		first := quiet + 1
		for _, seq := range stored {
			first = min(first, seq)
		}
		if len(stored) == 0 {
			t.Fatalf("round %d: the stream grew while the lock was held, yet it holds no row the table has pending", round)
		}
		if first < uint64(scanFrom) {
			t.Errorf("round %d: the message of a pending row is stored at %d, before the file's scan_from %d: a reconciliation from there misses it", round, first, scanFrom)
		}
		stop := time.Duration(3000+rng.IntN(2000)) * time.Millisecond
		time.Sleep(time.Until(killed.Add(stop)))
		stopped := time.Since(killed)
		if takeover == "standby" {
			e.relays[next].Signal(syscall.SIGCONT)
		} else {
			e.startRelay(next, relayEnv...)
		}
		restarted := time.Now()
		rec := waitRowsSettled(t, db, held, restarted, 30*time.Second, fmt.Sprintf("rows pending at kill %d", round))
		line, err := e.relays[next].WaitFor("reconciled the outbox with the stream; publishing", 10*time.Second)
		if err != nil {
			t.Fatalf("round %d: relay %s %v", round, next, err)
		}
		settled := int(line.Fields["settled"].(float64))
		if settled != len(stored) || line.Fields["reused_event_ids"] != 0.0 || line.Fields["orphans"] != 0.0 {
			t.Errorf("round %d: relay %s reconciled %v, want %d rows settled, no event id reused, no orphan", round, next, line.Fields, len(stored))
		}
		if m := e.metric(next, "outbox_relay_reconciled_rows_total"); int(m) != settled {
			t.Errorf("round %d: relay %s counts %v rows reconciled and logged %d", round, next, m, settled)
		}
		e.checkDoneAt(db, stored)
		t.Logf("round %d (%s): lock taken at the %s try; killed holding %d rows stored and pending (from sequence %d, scan_from %d) among %d pending; no leader for %v; relay %s reconciled %v rows (read %v messages in %v); every row pending at the kill done %v after the %s",
			round, takeover, ordinal(tries), len(stored), first, scanFrom, len(held), stopped.Round(time.Millisecond), next, settled, line.Fields["read"], line.Fields["took"], rec.Round(time.Millisecond), takeover)
		perRound = append(perRound, strconv.Itoa(settled))
		stranded += len(stored)
		reconciled += settled
		maxRecovery = max(maxRecovery, rec)
		if shortest == 0 || stopped < shortest {
			shortest = stopped
		}
		longest = max(longest, stopped)
		leader = next
	}
	if err := w.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	s := e.waitWriter(w)
	e.waitSettled(db, 60*time.Second)
	e.stopRelay(leader)
	lost, dups, dead := e.verify(db, 0)
	e.checkStreamSeqs(db)
	if reconciled == 0 {
		t.Error("no relay reconciled a row")
	}
	t.Logf("%d rows; %d stored and unsettled at the kills, %d reconciled (%s by round)", s.Written, stranded, reconciled, strings.Join(perRound, ", "))
	summaries = append(summaries, summary{name: fmt.Sprintf("kill -9 holding stored rows, no leader for %.0f to %.0f s past a 1 s window, 5 times (once a standby's takeover); %d reconciled",
		shortest.Seconds(), longest.Seconds(), reconciled),
		rows: s.Written, kills: 5, lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: maxRecovery, elapsed: time.Since(e.started)})
}

// lockWhilePublishing takes the write lock (BEGIN IMMEDIATE), as an
// application's long transaction does, while relay name publishes, and
// holds it once the stream has stored a message since it was taken: a
// message whose row the relay cannot settle. When nothing is stored
// within 300 ms (the relay had nothing left to publish), it lets go and
// tries again. It returns what lets go of the lock, and how many tries
// it took.
func (e *env) lockWhilePublishing(js jetstream.JetStream, db *sql.DB, name string) (unlock func(), tries int) {
	e.t.Helper()
	ctx := context.Background()
	for tries = 1; ; tries++ {
		e.waitInFlightOf(name, 1)
		conn, err := db.Conn(ctx)
		if err != nil {
			e.t.Fatal(err)
		}
		if _, err := conn.ExecContext(ctx, `BEGIN IMMEDIATE`); err != nil {
			e.t.Fatal(err)
		}
		unlock = func() {
			if _, err := conn.ExecContext(ctx, `ROLLBACK`); err != nil {
				e.t.Fatal(err)
			}
			conn.Close()
		}
		// Read once the lock is held: the relay cannot have settled a
		// row whose message is stored after this.
		seq := e.streamInfo(js).State.LastSeq
		for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			if e.streamInfo(js).State.LastSeq > seq {
				return unlock, tries
			}
		}
		unlock()
		if tries == 50 {
			e.t.Fatalf("relay %s stored nothing while the lock was held, 50 times", name)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitInFlightOf waits up to 3 s for relay name to hold at least n rows
// in flight.
func (e *env) waitInFlightOf(name string, n int) {
	e.t.Helper()
	for deadline := time.Now().Add(3 * time.Second); e.metric(name, "outbox_relay_in_flight_rows") < float64(n) && time.Now().Before(deadline); {
		time.Sleep(2 * time.Millisecond)
	}
}

// streamInfo reads the stream's configuration and state.
func (e *env) streamInfo(js jetstream.JetStream) *jetstream.StreamInfo {
	e.t.Helper()
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		e.t.Fatal(err)
	}
	return info
}

// quietSeq waits for the broker to store what a killed relay had sent it
// (its last sequence stops moving for half a second: no other client
// publishes) and returns the last sequence.
func (e *env) quietSeq(js jetstream.JetStream) uint64 {
	e.t.Helper()
	last := e.streamInfo(js).State.LastSeq
	for {
		time.Sleep(500 * time.Millisecond)
		now := e.streamInfo(js).State.LastSeq
		if now == last {
			return last
		}
		last = now
	}
}

// storedPending reads the whole stream and returns the rows of pending
// whose message it holds, with the message's sequence.
func (e *env) storedPending(pending []int64) map[int64]uint64 {
	e.t.Helper()
	ids := map[string]int64{}
	for _, id := range pending {
		ids[strconv.FormatInt(id, 10)] = id
	}
	stored := map[int64]uint64{}
	e.eachStored(1, func(seq uint64, h nats.Header) {
		if id, ok := ids[h.Get("Outbox-Row-Id")]; ok {
			stored[id] = seq
		}
	})
	return stored
}

// checkDoneAt fails the test unless each row of at is done with the
// stream sequence it maps to.
func (e *env) checkDoneAt(db *sql.DB, at map[int64]uint64) {
	e.t.Helper()
	bad := 0
	for id, seq := range at {
		var status string
		var got sql.NullInt64
		if err := db.QueryRow(`SELECT status, stream_seq FROM event_queue WHERE id = ?`, id).Scan(&status, &got); err != nil {
			e.t.Fatal(err)
		}
		if status != "done" || !got.Valid || uint64(got.Int64) != seq {
			if bad++; bad <= 5 {
				e.t.Errorf("row %d: %s at stream sequence %v, want done at %d, where its message is", id, status, got, seq)
			}
		}
	}
	if bad > 5 {
		e.t.Errorf("and %d more rows not done at their message's sequence", bad-5)
	}
}

// checkStreamSeqs fails the test unless each done row's stream_seq is the
// sequence of its own message: its event id and row id.
func (e *env) checkStreamSeqs(db *sql.DB) {
	e.t.Helper()
	type msg struct{ eventID, rowID string }
	at := map[uint64]msg{}
	e.eachStored(1, func(seq uint64, h nats.Header) {
		at[seq] = msg{h.Get("Nats-Msg-Id"), h.Get("Outbox-Row-Id")}
	})
	rows, err := db.Query(`SELECT id, event_id, stream_seq FROM event_queue WHERE status = 'done'`)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	bad, n := 0, 0
	for rows.Next() {
		var id int64
		var eventID string
		var seq sql.NullInt64
		if err := rows.Scan(&id, &eventID, &seq); err != nil {
			e.t.Fatal(err)
		}
		n++
		if m := at[uint64(seq.Int64)]; !seq.Valid || m.eventID != eventID || m.rowID != strconv.FormatInt(id, 10) {
			if bad++; bad <= 5 {
				e.t.Errorf("row %d (event %s) is done at stream sequence %v, which holds event %q of row %q", id, eventID, seq, m.eventID, m.rowID)
			}
		}
	}
	if err := rows.Err(); err != nil {
		e.t.Fatal(err)
	}
	if bad > 5 {
		e.t.Errorf("and %d more done rows whose stream_seq holds another message", bad-5)
	}
	e.t.Logf("each of %d done rows' stream_seq holds its own message", n-bad)
}

func ordinal(n int) string {
	switch n {
	case 1:
		return "first"
	case 2:
		return "second"
	case 3:
		return "third"
	}
	return strconv.Itoa(n) + "th"
}
