//go:build fault

package fault

import (
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestAtomicGroups: every transaction of the application writes its rows
// as one atomic group of 2 to 20 rows, 70% of them on 2 or 3 of 3
// ordering keys drawn for the group and the rest unkeyed (15,000 rows at
// 500 a second, and 1,500 at once while the relay is down). Groups that
// share a key go one at a time, each a batch the broker stages and syncs
// on its own, so the relay drains them far more slowly than rows of no
// group, the more so when the disk is busy: how long it takes to catch up
// after each kill is reported, and bounded only by a minute. The relay is
// killed (kill -9) four times while it publishes: once with the broker
// frozen, so that it dies holding groups sent and not stored, and once
// stopped (SIGSTOP) holding groups the stream had stored but it had not
// settled (a crash between the PubAck and the settle), whose rows the
// next relay finds in the stream when it begins to lead and settles at
// the sequences they were stored at, without publishing them again. The
// broker is also stopped for 5 s. At the end every row is done once, each
// key is in row-id order, and every group is whole in the stream: its
// rows in id order, in consecutive sequences, sharing one Nats-Batch-Id
// that no other message carries.
func TestAtomicGroups(t *testing.T) {
	const keys, groupMax = "3", "20"
	e := newEnv(t)
	db := e.open()
	w := e.writer("-rows", "15000", "-rate", "500", "-keys", keys, "-group-max", groupMax)
	time.Sleep(2 * time.Second) // a backlog for the first relay
	e.startRelay("relay")
	if _, err := e.relays["relay"].WaitFor("atomic batches on: an ordering key's due rows go as one batch, all or none", 30*time.Second); err != nil {
		t.Fatalf("relay %v", err)
	}
	rng := rand.New(rand.NewPCG(13, 13))
	var runs groupCounts
	var kills, stranded, written, groupsWritten int
	var outage, maxRecovery time.Duration
	// kill kills the relay, whose counters were read last as run, and
	// returns the rows pending then: those it held in flight, and the
	// rest.
	kill := func(run groupCounts) []int64 {
		e.killRelay("relay")
		run.rejected = e.logCount("relay", "broker rejected event") // its log outlives it
		run.reconciled = e.reconciledRows("relay")
		runs.add(run)
		kills++
		return pendingIDs(t, db)
	}
	restart := func(held []int64) {
		maxRecovery = max(maxRecovery, e.restartOn(db, held, kills, time.Duration(500+rng.IntN(1000))*time.Millisecond, time.Minute))
	}
	outage = e.chaosSteps(rng, []string{"kill", "kill holding stored groups", "outage", "kill under a frozen broker"}, 5*time.Second,
		func() []int64 { return kill(e.groupCounts()) }, restart, func(string) {
			// A backlog of groups for the next relay, which it stops
			// (SIGSTOP) holding groups the stream has stored, and kills.
			e.waitInFlight(1)
			pending := kill(e.groupCounts())
			backlog := e.waitWriter(e.writer("-rows", "1500", "-rate", "20000", "-keys", keys, "-group-max", groupMax, "-seed", strconv.Itoa(100+kills)))
			written, groupsWritten = written+backlog.Written, groupsWritten+backlog.Groups
			t.Logf("kill %d: %d rows pending; restarted on them and %d more, in %d groups", kills, len(pending), backlog.Written, backlog.Groups)
			e.startRelay("relay")
			run, n := e.stopHoldingStoredGroups(db)
			held := kill(run)
			t.Logf("kill %d: the stream held %d of the %d rows pending at the kill, stored in groups it had not settled", kills, n, len(held))
			stranded += n
			restart(held)
		})
	s := e.waitWriter(w)
	written, groupsWritten = written+s.Written, groupsWritten+s.Groups
	e.waitSettled(db, 60*time.Second)
	last := e.groupCounts()
	e.stopRelay("relay")
	last.rejected = e.logCount("relay", "broker rejected event")
	last.reconciled = e.reconciledRows("relay")
	runs.add(last)
	lost, dups, dead := e.verify(db, 0)
	msgs, groups := e.checkGroupsWhole(db)
	var attempts int
	db.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue`).Scan(&attempts)
	t.Logf("%d messages, %d groups each whole in the stream (%d rows in groups the relay had not settled at a kill); the relays reconciled %d rows, were acknowledged %d duplicates, published %d groups again one row at a time, and logged %d rejected rows (%d attempts spent in all)",
		msgs, groups, stranded, runs.reconciled, runs.duplicates, runs.dupGroups, runs.rejected, attempts)
	if groups != groupsWritten {
		t.Errorf("the stream holds %d atomic groups; the application wrote %d", groups, groupsWritten)
	}
	if runs.reconciled < stranded {
		t.Errorf("the stream held %d rows of groups their relay had not settled, and the next relays reconciled %d rows", stranded, runs.reconciled)
	}
	summaries = append(summaries, summary{name: fmt.Sprintf("atomic groups of 2 to %s rows over %s keys (%d groups)", groupMax, keys, groups),
		rows: written, kills: kills, outage: outage, lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: maxRecovery, elapsed: time.Since(e.started)})
}

// groupCounts is what relay runs did with atomic groups: a run's, read
// before it ends (its metrics die with it), or the sum of a scenario's.
type groupCounts struct {
	duplicates int // rows acknowledged as duplicates
	dupGroups  int // groups refused as duplicates, published again one row at a time
	rejected   int // rows the broker rejected, from the run's log
	reconciled int // rows found published already on taking the lead, from the run's log
}

// groupCounts reads the running relay's counters.
func (e *env) groupCounts() groupCounts {
	e.t.Helper()
	return groupCounts{
		duplicates: int(e.metric("relay", "outbox_relay_duplicates_total")),
		dupGroups:  int(e.metric("relay", `outbox_relay_atomic_batch_fallbacks_total{reason="duplicate"}`)),
	}
}

func (c *groupCounts) add(o groupCounts) {
	c.duplicates += o.duplicates
	c.dupGroups += o.dupGroups
	c.rejected += o.rejected
	c.reconciled += o.reconciled
}

// stopHoldingStoredGroups waits for the relay, started on a backlog of
// groups, to lead and publish, then stops it (SIGSTOP) as soon as the
// stream grows, until the stream holds a group whose rows it has not
// settled. It returns the relay's counters, read just before it stopped
// for good, and the rows of such groups.
func (e *env) stopHoldingStoredGroups(db *sql.DB) (groupCounts, int) {
	e.t.Helper()
	relay := e.relays["relay"]
	js := e.jetStream()
	lastSeq := func() uint64 {
		s, err := js.Stream(e.t.Context(), "EVENTS")
		if err != nil {
			e.t.Fatal(err)
		}
		return s.CachedInfo().State.LastSeq
	}
	wait := 30 * time.Second // the first time, it has to lead first
	for try := 1; ; try++ {
		run := e.groupCounts()
		seq := lastSeq()
		for deadline := time.Now().Add(wait); lastSeq() == seq; {
			if time.Now().After(deadline) {
				e.t.Fatalf("the relay stored nothing within %v", wait)
			}
			time.Sleep(time.Millisecond)
		}
		wait = 10 * time.Second
		relay.Signal(syscall.SIGSTOP)
		if n := e.storedInBatches(seq, pendingIDs(e.t, db)); n > 0 {
			e.t.Logf("stopped the relay %d times before it held such a group", try)
			return run, n
		}
		if try == 20 {
			e.t.Fatal("stopped 20 times, the relay never held a group the stream had stored")
		}
		relay.Signal(syscall.SIGCONT)
	}
}

// checkGroupsWhole reads the stream, which holds every done row once
// (see verify) and was never purged (a message's place in it is its
// sequence), and fails the test unless each atomic group of the table is
// whole in it: its rows in id order, in consecutive sequences, sharing
// one Nats-Batch-Id that no other message carries (a group of one row is
// published as any row, and may have none). It returns how many messages
// and groups it read.
func (e *env) checkGroupsWhole(db *sql.DB) (msgs, groups int) {
	e.t.Helper()
	rows, err := db.Query(`SELECT id, atomic_group FROM event_queue WHERE atomic_group IS NOT NULL`)
	if err != nil {
		e.t.Fatal(err)
	}
	groupOf := map[int64]string{}
	size := map[string]int{}
	for rows.Next() {
		var id int64
		var g string
		if err := rows.Scan(&id, &g); err != nil {
			e.t.Fatal(err)
		}
		groupOf[id] = g
		size[g]++
	}
	rows.Close()
	type stored struct {
		batch     string
		rows      int
		lastRow   int64
		first, at int
	}
	got := map[string]*stored{}
	// The group each batch id was first seen with ("": none): a batch
	// holds whole groups (several may share one) or rows of no group.
	batchGroup := map[string]string{}
	var problems int
	fail := func(format string, args ...any) {
		if problems++; problems <= 10 {
			e.t.Errorf(format, args...)
		}
	}
	e.eachMessage(1, func(h nats.Header) {
		msgs++
		seq := msgs
		row, _ := strconv.ParseInt(h.Get("Outbox-Row-Id"), 10, 64)
		g, batch := groupOf[row], h.Get("Nats-Batch-Id")
		if batch != "" {
			if other, ok := batchGroup[batch]; ok && (other == "") != (g == "") {
				fail("message %d (row %d, atomic group %q) is in batch %s with a message of atomic group %q", seq, row, g, batch, other)
			}
			batchGroup[batch] = g
		}
		if g == "" {
			return
		}
		st := got[g]
		if st == nil {
			if batch == "" && size[g] > 1 {
				fail("message %d (row %d, the first of atomic group %q, of %d rows) was not stored in an atomic batch", seq, row, g, size[g])
			}
			got[g] = &stored{batch: batch, rows: 1, lastRow: row, first: seq, at: seq}
			return
		}
		switch {
		case batch != st.batch:
			fail("atomic group %q in two batches: row %d at message %d has batch %q, row %d at message %d had %q", g, row, seq, batch, st.lastRow, st.at, st.batch)
		case seq != st.at+1:
			fail("atomic group %q not in consecutive sequences: row %d at message %d, its row %d before at message %d", g, row, seq, st.lastRow, st.at)
		case row < st.lastRow:
			fail("atomic group %q out of row id order: row %d at message %d, after row %d", g, row, seq, st.lastRow)
		}
		st.rows, st.lastRow, st.at = st.rows+1, row, seq
	})
	for g, n := range size {
		if st := got[g]; st == nil || st.rows != n {
			have := 0
			if st != nil {
				have = st.rows
			}
			fail("atomic group %q has %d of its %d rows in the stream", g, have, n)
		}
	}
	if problems > 10 {
		e.t.Errorf("and %d more problems with atomic groups", problems-10)
	}
	return msgs, len(got)
}
