package daemon_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// streamLeader returns the name of the server leading the stream.
func streamLeader(t *testing.T, js jetstream.JetStream) string {
	t.Helper()
	var leader string
	testenv.Eventually(t, 30*time.Second, "a stream leader", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		s, err := js.Stream(ctx, "EVENTS")
		if err != nil {
			return false
		}
		info, err := s.Info(ctx)
		if err != nil || info.Cluster == nil {
			return false
		}
		leader = info.Cluster.Leader
		return leader != ""
	})
	return leader
}

// TestLeaderFailover: with an R3 stream on a 3-node cluster, the node that
// leads the stream is shut down while 20,000 rows flow. Nothing is lost,
// nothing is stored twice (read from a surviving node), no attempt is spent.
func TestLeaderFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("a 3-node cluster")
	}
	c := testenv.StartCluster(t, 3)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, c.URLs(), harnessOptions{replicas: 3, ackTimeout: 2 * time.Second})

	const total = 20000
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < total/50; i++ {
			evs := make([]testenv.Event, 50)
			for j := range evs {
				evs[j] = testenv.NewEvent("Failover", []byte(fmt.Sprint(i, "-", j)))
			}
			if err := testenv.Insert(app, evs...); err != nil {
				t.Error(err)
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	testenv.Eventually(t, 60*time.Second, "a quarter of the rows done", func() bool { return testenv.Counts(t, app)["done"] >= total/4 })
	nc, err := nats.Connect(c.URLs())
	if err != nil {
		t.Fatal(err)
	}
	js, _ := jetstream.New(nc)
	leader := streamLeader(t, js)
	if s, err := js.Stream(context.Background(), "EVENTS"); err != nil || s.CachedInfo().Config.Replicas != 3 {
		t.Fatalf("the relay did not create an R3 stream: %v", err)
	}
	nc.Close()
	doneBefore := testenv.Counts(t, app)["done"]
	c.Stop(c.Index(leader))
	t.Logf("stopped the stream leader %s with %d of %d rows done", leader, doneBefore, total)
	if doneBefore >= total-1000 {
		t.Fatalf("%d rows were done before the leader stopped: the failover came too late to test anything", doneBefore)
	}
	wg.Wait()
	counts := waitAllSettled(t, app, total, 180*time.Second)
	if counts["done"] != total {
		t.Fatalf("counts %v", counts)
	}
	var attempts int
	app.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue`).Scan(&attempts)
	if attempts != 0 {
		t.Errorf("the failover spent %d attempts", attempts)
	}
	// Read the stream back from a surviving node.
	survivor := (c.Index(leader) + 1) % 3
	snc, err := nats.Connect(c.URL(survivor))
	if err != nil {
		t.Fatal(err)
	}
	defer snc.Close()
	sjs, _ := jetstream.New(snc)
	streamLeader(t, sjs) // a new leader answers
	msgs := testenv.StreamMessages(t, sjs, "EVENTS")
	seen := map[string]int{}
	for _, m := range msgs {
		seen[m.Header.Get(publish.HeaderMsgID)]++
	}
	var ids int
	app.QueryRow(`SELECT count(DISTINCT event_id) FROM event_queue WHERE status = 'done'`).Scan(&ids)
	if len(msgs) != total || len(seen) != total || ids != total {
		t.Fatalf("stream holds %d messages with %d ids for %d rows; want %d each", len(msgs), len(seen), ids, total)
	}
	t.Logf("outages logged: %d, duplicate acks: %v", logCount(h, "broker unavailable; pausing without spending attempts"),
		metrics.Value(h.metrics.Duplicates))
}
