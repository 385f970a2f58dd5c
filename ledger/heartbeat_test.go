package ledger_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/ledger"
)

// TestHeartbeatKeepsALiveClaimAndAStoppedOneGoesStale: two processes'
// ledgers (a pool each) on one file, with the default lease. A claim
// whose holder heartbeats is busy to the other however long it is held;
// a claim its holder stopped heartbeating (its done mark failed, as when
// the process lost the database) is taken over once it is stale, long
// before its lease expires.
func TestHeartbeatKeepsALiveClaimAndAStoppedOneGoesStale(t *testing.T) {
	ctx := context.Background()
	path := testenv.NewDB(t)
	const staleAfter = 300 * time.Millisecond
	holder := ledger.New(testenv.AppDB(t, path), ledger.Options{StaleAfter: staleAfter})
	other := ledger.New(testenv.AppDB(t, path), ledger.Options{StaleAfter: staleAfter})
	db := testenv.AppDB(t, path)

	live, state, _, err := holder.Claim(ctx, "ev-live", "h")
	if err != nil || state != ledger.Claimed {
		t.Fatalf("claim: %v (%v)", state, err)
	}
	// Held for several times StaleAfter, heartbeating.
	testenv.Eventually(t, wait, "the claim heartbeated for 4 x StaleAfter", func() bool {
		r, _ := readRow(t, db, "ev-live", "h")
		return r.Processed.Int64 > live.Token+4*staleAfter.Milliseconds()
	})
	_, state, until, err := other.Claim(ctx, "ev-live", "h")
	if err != nil || state != ledger.Busy {
		t.Fatalf("a live claim held %v: %v (%v); want busy", time.Since(time.UnixMilli(live.Token)), state, err)
	}
	if lease := time.UnixMilli(live.Token).Add(ledger.DefaultLease); !until.Before(lease) {
		t.Errorf("busy until %v, the end of the lease; want when the heartbeat could go stale", until)
	}
	if err := live.Done(ctx); err != nil {
		t.Fatal(err)
	}

	abandoned, _, _, err := holder.Claim(ctx, "ev-stopped", "h")
	if err != nil {
		t.Fatal(err)
	}
	gone, cancel := context.WithCancel(ctx)
	cancel()
	if err := abandoned.Done(gone); err == nil {
		t.Fatal("a done mark on a cancelled context succeeded")
	}
	var taken *ledger.Claim
	testenv.Eventually(t, wait, "the stopped claim taken over", func() bool {
		c, state, _, err := other.Claim(ctx, "ev-stopped", "h")
		if err != nil {
			t.Fatal(err)
		}
		taken = c
		return state == ledger.Claimed
	})
	if taken.Token <= abandoned.Token || taken.Token >= abandoned.Token+ledger.DefaultLease.Milliseconds() {
		t.Fatalf("taken over with token %d; the stopped claim's is %d", taken.Token, abandoned.Token)
	}
	if err := abandoned.Release(ctx); err == nil {
		t.Fatal("the stopped holder released a claim taken over")
	}
	if err := taken.Done(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestWorkerLeavesALiveSlowHandlerItsClaim: two workers on one file, each
// on a consumer of its own, so that both are given the event; a handler
// runs far longer than ack_wait and StaleAfter. Its claim heartbeats, so
// every delivery to the other worker finds it busy and the handler runs
// once; when it returns, the event is done.
func TestWorkerLeavesALiveSlowHandlerItsClaim(t *testing.T) {
	_, js := stream(t)
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	effectsTable(t, db)
	other, err := js.CreateOrUpdateConsumer(context.Background(), "EVENTS", jetstream.ConsumerConfig{
		Durable: "others", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 300 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	conss := [2]jetstream.Consumer{durable(t, js, 300*time.Millisecond, -1), other}
	const staleAfter = 300 * time.Millisecond
	release := make(chan struct{})
	var runs atomic.Int64
	regs := [2]*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
	for i := range 2 {
		h := handlersWith(t, testenv.AppDB(t, path), ledger.Options{StaleAfter: staleAfter}, regs[i])
		h.Handle("Slow", "slow", func(context.Context, ledger.Event) error {
			runs.Add(1)
			<-release
			return nil
		})
		runWorker(t, conss[i], h, ledger.WorkerOptions{Concurrency: 2, Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	}
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the workers stop, which waits for the handler
	id := event.NewID()
	publish(t, js, id, "Slow")
	busy := func() float64 {
		return metricValue(t, regs[0], "outbox_ledger_handled_total", "handler", "slow", "outcome", "busy") +
			metricValue(t, regs[1], "outbox_ledger_handled_total", "handler", "slow", "outcome", "busy")
	}
	testenv.Eventually(t, 30*time.Second, "three deliveries that found the claim busy, 5 x StaleAfter after it began", func() bool {
		r, _ := readRow(t, db, id, "slow")
		return busy() >= 3 && r.StartedAt.Valid && time.Since(time.UnixMilli(r.StartedAt.Int64)) > 5*staleAfter
	})
	if n := runs.Load(); n != 1 {
		t.Fatalf("the slow handler ran %d times while it was running; want once", n)
	}
	free()
	testenv.Eventually(t, 30*time.Second, "the event done", func() bool {
		r, _ := readRow(t, db, id, "slow")
		return r.Status == "done"
	})
	if n := runs.Load(); n != 1 {
		t.Fatalf("the slow handler ran %d times; want once", n)
	}
}

// TestHeartbeatRenewsClaimsWhoseKeysAreNotUTF8: a Worker takes an event id
// as any publisher sent it, and a handler's name is the application's:
// bytes that are not UTF-8 (which JSON cannot carry as they are) are
// heartbeated too, so that a live claim on them is not taken over.
func TestHeartbeatRenewsClaimsWhoseKeysAreNotUTF8(t *testing.T) {
	ctx := context.Background()
	db := testenv.AppDB(t, testenv.NewDB(t))
	l := ledger.New(db, ledger.Options{StaleAfter: 200 * time.Millisecond})
	for _, key := range [][2]string{{"ev-\xff", "h"}, {"ev-plain", "h-\xfe"}, {"ev-ok", "h"}} {
		c, state, _, err := l.Claim(ctx, key[0], key[1])
		if err != nil || state != ledger.Claimed {
			t.Fatalf("claim %q: %v (%v)", key, state, err)
		}
		testenv.Eventually(t, wait, fmt.Sprintf("the claim on %q heartbeated", key), func() bool {
			r, _ := readRow(t, db, key[0], key[1])
			return r.Processed.Int64 > c.Token
		})
		if err := c.Done(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
