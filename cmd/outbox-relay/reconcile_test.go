package main

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestKill9BeforeTheSettlePastTheWindow: the leader is killed -9 after
// JetStream acknowledged every row and before it could settle any (the
// application held the write lock), the stream's duplicate window is 1 s
// and the next leader starts well past it: a restarted relay, the standby
// taking over, or a leader that was stopped (SIGSTOP) while the killed one
// led in its place, resumed alone. Every row ends done at the sequence its
// message was stored at, and the stream holds each event once.
func TestKill9BeforeTheSettlePastTheWindow(t *testing.T) {
	for _, takeover := range []string{"restart", "standby", "paused leader", "paused leader resumed under the lock"} {
		t.Run(takeover, func(t *testing.T) {
			t.Parallel() // each its own server, file and processes; most of it is waiting
			const rows = 300
			n := testenv.StartNATS(t)
			js := n.JetStream(t)
			path := testenv.NewDB(t)
			app := testenv.AppDB(t, path)
			env := []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_STREAM_DUPLICATE_WINDOW=1s", "OUTBOX_RELAY_METRICS_LISTEN=",
				"OUTBOX_RELAY_RELAY_POLL_INTERVAL=200ms"}
			leader := startDaemon(t, env, "run", "--database-path", path)
			// Reconciled first: with an empty stream it still writes, and
			// would wait for the application's lock below.
			leader.waitFor("reconciled the outbox with the stream; publishing")
			var standby *process
			if takeover != "restart" {
				standby = startDaemon(t, env, "run", "--database-path", path)
				standby.waitFor("standing by: another relay of this outbox table leads")
			}
			paused := strings.HasPrefix(takeover, "paused leader")
			if paused {
				// The standby judges another dead only once it has beaten
				// on time for 6 s itself.
				time.Sleep(7 * time.Second)
				if err := leader.Signal(syscall.SIGSTOP); err != nil {
					t.Fatal(err)
				}
				standby.waitFor("leading: this relay claims and publishes the rows")
				leader, standby = standby, leader
			}
			// The rows come due in a few seconds; by then the application
			// holds the write lock, so the leader publishes (its reads take
			// no lock) and cannot settle.
			due := time.Now().Add(4 * time.Second).UnixMilli()
			for i := range rows {
				testenv.MustExec(t, app, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES (?, 'Thing', 'x', ?)`,
					fmt.Sprint("ev-", i), due)
			}
			ctx := context.Background()
			lock, err := app.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer lock.Close()
			if _, err := lock.ExecContext(ctx, `BEGIN IMMEDIATE`); err != nil {
				t.Fatal(err)
			}
			if time.Now().UnixMilli() >= due {
				t.Fatal("the lock was taken after the rows came due")
			}
			testenv.Eventually(t, 30*time.Second, "every row stored", func() bool { return len(testenv.StreamMessages(t, js, "EVENTS")) == rows })
			if err := leader.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			<-leader.Exited()
			time.Sleep(2500 * time.Millisecond) // past the window
			if c := testenv.Counts(t, app); c["pending"] != rows {
				t.Fatalf("after the kill: %v, want every row pending", c)
			}
			rollback := func() {
				t.Helper()
				if _, err := lock.ExecContext(ctx, `ROLLBACK`); err != nil {
					t.Fatal(err)
				}
			}
			underLock := takeover == "paused leader resumed under the lock"
			if !underLock {
				rollback()
			}
			next := standby
			if next == nil {
				next = startDaemon(t, env, "run", "--database-path", path)
			}
			const reconciled = "reconciled the outbox with the stream; publishing"
			before := len(next.Find(reconciled)) // the paused leader's own, at its start
			if paused {
				const refused = "database unavailable; retrying"
				refusedBefore := len(next.Find(refused))
				if err := next.Signal(syscall.SIGCONT); err != nil {
					t.Fatal(err)
				}
				if underLock {
					// Resumed with the lock held, until its heartbeat has
					// given up waiting for it once: it claims nothing.
					testenv.Eventually(t, 30*time.Second, "the resumed relay's heartbeat refused", func() bool { return len(next.Find(refused)) > refusedBefore })
					if got := len(testenv.StreamMessages(t, js, "EVENTS")); got != rows {
						t.Fatalf("the stream holds %d messages with the resumed relay under the lock, want %d", got, rows)
					}
					rollback()
				}
			}
			testenv.Eventually(t, 30*time.Second, "the next leader reconciled", func() bool { return len(next.Find(reconciled)) > before })
			end := next.Find(reconciled)[before]
			if end.Fields["settled"] != float64(rows) {
				t.Errorf("the next leader reconciled %v rows, want %d", end.Fields["settled"], rows)
			}
			testenv.Eventually(t, 30*time.Second, "every row done", func() bool { return testenv.Counts(t, app)["done"] == rows })
			msgs := testenv.StreamMessages(t, js, "EVENTS")
			if len(msgs) != rows {
				t.Fatalf("the stream holds %d messages, want %d", len(msgs), rows)
			}
			seqs := map[string]uint64{}
			for _, m := range msgs {
				seqs[m.Header.Get(publish.HeaderMsgID)] = m.Sequence
			}
			for i, r := range testenv.Strings(t, app, `SELECT event_id || ' ' || stream_seq FROM event_queue ORDER BY id`) {
				if want := fmt.Sprint("ev-", i, " ", seqs[fmt.Sprint("ev-", i)]); r != want {
					t.Fatalf("row %d: %s, want %s", i+1, r, want)
				}
			}
			next.stop()
		})
	}
}
