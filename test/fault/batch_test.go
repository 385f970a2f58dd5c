//go:build fault

package fault

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// smallBatches is a broker configuration whose atomic batches hold at most
// 100 messages: fewer than the relay's own limit, so that each relay run
// has a batch refused for its size first and learns the server's limit
// from the refusal.
const smallBatches = `jetstream {
  limits {
    batch {
      max_msgs: 100
    }
  }
}
`

// batchCounts is what relay runs did with atomic batches: a run's, read
// before it ends (its metrics die with it), or the sum of a scenario's.
type batchCounts struct {
	sent, duplicates, limitLearned int
	reconciled                     int // rows found published already on taking the lead
}

// batchCounts reads the running relay's batch counters and its log.
func (e *env) batchCounts() batchCounts {
	e.t.Helper()
	return batchCounts{
		sent:         int(e.metric("relay", "outbox_relay_atomic_batches_total")),
		duplicates:   int(e.metric("relay", "outbox_relay_duplicates_total")),
		limitLearned: e.logCount("relay", "the server's atomic batches are smaller; keeping to its limit"),
		reconciled:   e.reconciledRows("relay"),
	}
}

func (b *batchCounts) add(o batchCounts) {
	b.sent += o.sent
	b.duplicates += o.duplicates
	b.limitLearned += o.limitLearned
	b.reconciled += o.reconciled
}

// TestBatchedKeys: three ordering keys carry 70% of 95,000 rows (75,000
// written at 1,500 a second, and twice 10,000 at once while the relay is
// down), and their rows wait by the hundred (in a backlog written before
// the relay starts, and one after each kill and the outage), so they go as
// atomic batches, against a server that takes batches of at most 100
// messages. The relay is killed (kill -9) six times while it publishes:
// once with the broker frozen, so that it dies holding many rows, and
// twice once it was stopped (SIGSTOP) holding batches the stream had
// stored but it had not settled (a crash between the PubAck and the
// settle): the next relay finds those rows' messages in the stream when
// it begins to lead and settles them without publishing them again. The
// broker is also stopped for 10 s. At the end every row is done once,
// each key is in row-id order, a good share of the stream's messages were
// stored in batches, and none of the batches is larger than the server's
// limit.
func TestBatchedKeys(t *testing.T) {
	const keys = 3
	e := newEnv(t, withNATSConfig(smallBatches))
	db := e.open()
	w := e.writer("-rows", "75000", "-rate", "1500", "-keys", strconv.Itoa(keys))
	time.Sleep(3 * time.Second)
	e.startRelay("relay")
	if _, err := e.relays["relay"].WaitFor("atomic batches on: an ordering key's due rows go as one batch, all or none", 30*time.Second); err != nil {
		t.Fatalf("relay %v", err)
	}
	rng := rand.New(rand.NewPCG(11, 11))
	var runs batchCounts
	var kills, stranded, written int
	var outage, maxRecovery time.Duration
	// kill kills the relay, whose batch counters were read last as run,
	// and returns the rows pending then: those it held in flight, and the
	// rest.
	kill := func(run batchCounts) []int64 {
		runs.add(run)
		e.killRelay("relay")
		kills++
		return pendingIDs(t, db)
	}
	// restart starts the next relay 1 to 2 s after a kill, so that it
	// starts on a backlog, and waits for the rows held at the kill. Those
	// are a backlog too (some 20,000 rows after the outage): how long they
	// take is mostly a drain, reported, and bounded only by the 30 s of
	// waitRowsSettled.
	restart := func(held []int64) {
		maxRecovery = max(maxRecovery, e.restartOn(db, held, kills, time.Duration(1000+rng.IntN(1000))*time.Millisecond, 30*time.Second))
	}
	outage = e.chaosSteps(rng, []string{"kill", "kill holding stored batches", "outage", "kill under a frozen broker", "kill holding stored batches"}, 10*time.Second,
		func() []int64 { return kill(e.batchCounts()) }, restart, func(string) {
			// A backlog of its own for the next relay, which sends it in
			// batches, whether the application still writes or not; stop
			// that relay (SIGSTOP) holding batches the stream has stored,
			// and kill it.
			e.waitInFlight(1)
			pending := kill(e.batchCounts())
			backlog := e.waitWriter(e.writer("-rows", "10000", "-rate", "20000", "-keys", strconv.Itoa(keys), "-seed", strconv.Itoa(100+kills)))
			written += backlog.Written
			t.Logf("kill %d: %d rows pending; restarted on them and %d more", kills, len(pending), backlog.Written)
			e.startRelay("relay")
			run, n := e.stopHoldingStoredBatches(db, keys)
			held := kill(run)
			t.Logf("kill %d: the stream held %d of the %d rows pending at the kill, stored in batches it had not settled", kills, n, len(held))
			stranded += n
			restart(held)
		})
	var sofar int
	db.QueryRow(`SELECT count(*) FROM event_queue`).Scan(&sofar)
	t.Logf("kills and outage over after %v, with %d rows written", time.Since(e.started).Round(time.Second), sofar)
	s := e.waitWriter(w)
	written += s.Written
	e.waitSettled(db, 60*time.Second)
	runs.add(e.batchCounts())
	e.stopRelay("relay")
	lost, dups, dead := e.verify(db, 0)

	// A message stored in a batch carries the batch's id and its place in
	// it.
	var msgs, batched, largest int
	batchIDs := map[string]bool{}
	e.eachMessage(1, func(h nats.Header) {
		msgs++
		id := h.Get("Nats-Batch-Id")
		if id == "" {
			return
		}
		batched++
		batchIDs[id] = true
		if h.Get("Outbox-Ordering-Key") == "" {
			t.Errorf("message %s has no ordering key but was stored in batch %s", h.Get("Nats-Msg-Id"), id)
		}
		n, _ := strconv.Atoi(h.Get("Nats-Batch-Sequence"))
		largest = max(largest, n)
	})
	t.Logf("%d of %d messages stored in %d atomic batches (the largest of %d), %d of them in batches their relay did not settle; the relays sent %d batches, reconciled %d rows, were acknowledged %d duplicates and met the server's limit %d times",
		batched, msgs, len(batchIDs), largest, stranded, runs.sent, runs.reconciled, runs.duplicates, runs.limitLearned)
	if runs.reconciled < stranded {
		t.Errorf("the stream held %d rows of batches their relay had not settled, and the next relays reconciled %d rows", stranded, runs.reconciled)
	}
	// About 70% of the rows have a key, and the backlogs (before the
	// start, after each kill and the outage) hold about half of them, less
	// those that go one at a time after a batch refused for its size: a
	// third of the stream shows that batches carried the keys through the
	// kills and the outage.
	if batched < msgs/3 {
		t.Errorf("only %d of %d messages were stored in atomic batches", batched, msgs)
	}
	if largest > 100 {
		t.Errorf("a batch of %d messages was stored; the server takes at most 100", largest)
	}
	if runs.limitLearned == 0 {
		t.Error("no relay met the server's limit of 100 messages a batch: the broker did not take its configuration")
	}
	summaries = append(summaries, summary{name: fmt.Sprintf("ordering keys in atomic batches (%d keys, %d of %d messages batched)", keys, batched, msgs),
		rows: written, kills: kills, outage: outage, lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: maxRecovery, elapsed: time.Since(e.started)})
}

// stopHoldingStoredBatches waits for the relay, started on a backlog, to
// send batches within the server's limit (each key may have had one
// refused for its size first), then stops it (SIGSTOP) right after it
// sent another, until the stream holds a batch whose rows it has not
// settled. It returns the relay's batch counters, read just before it
// stopped for good, and the rows of such batches.
func (e *env) stopHoldingStoredBatches(db *sql.DB, keys int) (batchCounts, int) {
	e.t.Helper()
	const batches = "outbox_relay_atomic_batches_total"
	e.waitMetric("relay", batches, keys+2)
	relay := e.relays["relay"]
	for try := 1; ; try++ {
		run := e.batchCounts()
		seq := e.lastSeq()
		e.waitMetric("relay", batches, run.sent+1)
		relay.Signal(syscall.SIGSTOP)
		if n := e.storedInBatches(seq, pendingIDs(e.t, db)); n > 0 {
			e.t.Logf("stopped the relay %d times before it held such a batch", try)
			return run, n
		}
		if try == 20 {
			e.t.Fatal("stopped 20 times, the relay never held a batch the stream had stored")
		}
		relay.Signal(syscall.SIGCONT)
	}
}

// waitInFlight waits up to 3 s for the relay to hold at least n rows in
// flight; a kill then strands them.
func (e *env) waitInFlight(n int) {
	e.t.Helper()
	for deadline := time.Now().Add(3 * time.Second); e.metric("relay", "outbox_relay_in_flight_rows") < float64(n) && time.Now().Before(deadline); {
		time.Sleep(2 * time.Millisecond)
	}
}

// waitMetric waits up to 30 s for a running relay's metric to reach n.
func (e *env) waitMetric(name, metric string, n int) {
	e.t.Helper()
	for deadline := time.Now().Add(30 * time.Second); e.metric(name, metric) < float64(n); {
		if time.Now().After(deadline) {
			e.t.Fatalf("relay %s: %s did not reach %d within 30 s", name, metric, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// lastSeq is the stream's last sequence.
func (e *env) lastSeq() uint64 {
	e.t.Helper()
	js := e.jetStream()
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil {
		e.t.Fatal(err)
	}
	return s.CachedInfo().State.LastSeq
}

// storedInBatches counts the rows of held that the stream holds in atomic
// batches after sequence since, once the broker has stored what the
// relay, stopped or killed, sent it: batches whose rows the relay did not
// settle.
func (e *env) storedInBatches(since uint64, held []int64) int {
	e.t.Helper()
	pending := map[string]bool{}
	for _, id := range held {
		pending[strconv.FormatInt(id, 10)] = true
	}
	// The broker reads what is left in the relay's socket within moments;
	// its last sequence stops moving then (no other client publishes).
	last := e.lastSeq()
	for {
		time.Sleep(200 * time.Millisecond)
		now := e.lastSeq()
		if now == last {
			break
		}
		last = now
	}
	n := 0
	e.eachMessage(since+1, func(h nats.Header) {
		if h.Get("Nats-Batch-Id") != "" && pending[h.Get("Outbox-Row-Id")] {
			n++
		}
	})
	return n
}
