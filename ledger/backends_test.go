package ledger_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/ledger"
)

// deliveries records when a handler ran, per event.
type deliveries struct {
	mu sync.Mutex
	at map[string][]time.Time
	n  map[string][]int
}

func (d *deliveries) add(ev ledger.Event) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.at[ev.ID] = append(d.at[ev.ID], time.Now())
	d.n[ev.ID] = append(d.n[ev.ID], ev.Delivery)
}

func (d *deliveries) runs(id string) ([]time.Time, []int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.at[id]), slices.Clone(d.n[id])
}

// TestBothBackendsAgree runs one handler set over the same events, once
// from JetStream and once from the outbox table: the effects are the
// same, and a handler that always fails is run the same number of times
// (max_deliver = MaxAttempts) on the same (scaled) schedule.
func TestBothBackendsAgree(t *testing.T) {
	const attempts = 3
	for n, want := range map[int]time.Duration{1: 5 * time.Second, 2: 10 * time.Second, 3: 20 * time.Second, 6: 160 * time.Second, 7: 300 * time.Second, 20: 300 * time.Second} {
		if got := ledger.Backoff(n); got != want {
			t.Fatalf("Backoff(%d) = %v, want %v (5 s doubling, at most 300 s)", n, got, want)
		}
	}
	jsSchedule, tableSchedule := &schedule{div: 50}, &schedule{div: 50} // 100, 200 ms
	scaled := func(n int) time.Duration { return ledger.Backoff(n) / 50 }
	var evs []testenv.Event
	for i := range 8 {
		typ := "OrderPlaced"
		if i%4 == 3 {
			typ = "OrderRefused"
		}
		evs = append(evs, testenv.NewEvent(typ, []byte(fmt.Sprint("order ", i))))
	}
	register := func(h *ledger.Handlers, failing *deliveries) {
		h.HandleTx("OrderPlaced", "record", recordTx("record"))
		h.HandleTx("OrderRefused", "record-refusal", recordTx("record-refusal"))
		h.Handle("OrderRefused", "refund", func(_ context.Context, ev ledger.Event) error {
			failing.add(ev)
			return errors.New("the bank refuses")
		})
	}
	newDeliveries := func() *deliveries { return &deliveries{at: map[string][]time.Time{}, n: map[string][]int{}} }
	refused := func() (ids []string) {
		for _, ev := range evs {
			if ev.EventType == "OrderRefused" {
				ids = append(ids, *ev.EventID)
			}
		}
		return ids
	}()
	// allRuns waits until the failing handler ran attempts times for every
	// refused event.
	allRuns := func(d *deliveries) func() bool {
		return func() bool {
			for _, id := range refused {
				if _, n := d.runs(id); len(n) < attempts {
					return false
				}
			}
			return true
		}
	}

	// From JetStream, the messages published as the relay publishes them.
	_, js := stream(t)
	jsDB := appDB(t)
	fromJS := newDeliveries()
	h := newHandlers(t, jsDB, nil, 0)
	register(h, fromJS)
	runWorker(t, durable(t, js, time.Minute, attempts), h, ledger.WorkerOptions{Backoff: jsSchedule.backoff})
	for _, ev := range evs {
		publishData(t, js, *ev.EventID, ev.EventType, ev.Payload)
	}
	testenv.Eventually(t, 30*time.Second, "the failing handler run max_deliver times from JetStream", allRuns(fromJS))

	// From the table, the same rows.
	tableDB := appDB(t)
	if err := testenv.Insert(tableDB, evs...); err != nil {
		t.Fatal(err)
	}
	fromTable := newDeliveries()
	h = newHandlers(t, tableDB, nil, 0)
	register(h, fromTable)
	start(t, tableDB, h, ledger.TableOptions{MaxAttempts: attempts, Backoff: tableSchedule.backoff, PollInterval: 20 * time.Millisecond})
	testenv.Eventually(t, 30*time.Second, "the table's rows settled", func() bool {
		return count(t, tableDB, `SELECT count(*) FROM event_queue WHERE status IN ('done', 'dead_lettered')`) == len(evs)
	})
	if dead := count(t, tableDB, `SELECT count(*) FROM event_queue WHERE status = 'dead_lettered' AND attempts = ?`, attempts); dead != len(refused) {
		t.Fatalf("%d rows dead-lettered after %d attempts; want the %d refused ones", dead, attempts, len(refused))
	}

	if a, b := effects(t, jsDB), effects(t, tableDB); !slices.Equal(a, b) || len(a) != len(evs) {
		t.Fatalf("effects from JetStream %v\nfrom the table %v\nwant the same, one per event", a, b)
	}
	for _, id := range refused {
		for name, d := range map[string]*deliveries{"JetStream": fromJS, "the table": fromTable} {
			at, n := d.runs(id)
			if !slices.Equal(n, []int{1, 2, 3}) {
				t.Errorf("from %s, the failing handler saw deliveries %v of %s; want [1 2 3]", name, n, id)
			}
			for i := 1; i < len(at); i++ {
				if gap := at[i].Sub(at[i-1]); gap < scaled(i) {
					t.Errorf("from %s, delivery %d of %s came %v after the one before; the schedule says %v", name, i+1, id, gap, scaled(i))
				}
			}
		}
	}
	// Each refused event waited Backoff(1), then Backoff(2), on both.
	for name, sch := range map[string]*schedule{"JetStream": jsSchedule, "the table": tableSchedule} {
		if got := sch.steps(); fmt.Sprint(got) != "[1 1 2 2]" {
			t.Errorf("from %s, the retry delays asked for were steps %v of the schedule; want 1 then 2 for each of the 2 refused events", name, got)
		}
	}
}

// schedule is the retry schedule divided by div, for tests that cannot
// wait seconds; it records the steps (deliveries or attempts) asked for.
type schedule struct {
	div   time.Duration
	mu    sync.Mutex
	asked []int
}

func (s *schedule) backoff(n int) time.Duration {
	s.mu.Lock()
	s.asked = append(s.asked, n)
	s.mu.Unlock()
	return ledger.Backoff(n) / s.div
}

// steps returns the steps asked for, sorted.
func (s *schedule) steps() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(slices.Values(s.asked))
}

// effects lists a database's effects as "event_id handler", sorted.
func effects(t *testing.T, db *sql.DB) []string {
	t.Helper()
	return testenv.Strings(t, db, `SELECT event_id || ' ' || handler FROM effects ORDER BY 1`)
}
