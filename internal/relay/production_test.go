package relay_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// allowedOnly lets the relay's user ("relay", "pw") publish on
// events.allowed.> and the JetStream API only.
func allowedOnly(o *server.Options) {
	o.Users = []*server.User{{
		Username: "relay", Password: "pw",
		Permissions: &server.Permissions{Publish: &server.SubjectPermission{
			Allow: []string{"events.allowed.>", "$JS.API.>", "_INBOX.>"},
		}},
	}}
}

// TestPermissionDeniedDeadLetters: the server lets the relay's user publish
// on events.allowed.> only. Rows of other types are rejected with the
// permission reason (not taken for an outage) and dead-lettered after their
// attempts; allowed rows flow; the denial is logged once per subject.
func TestPermissionDeniedDeadLetters(t *testing.T) {
	n := testenv.StartNATS(t, allowedOnly)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	for i := 0; i < 5; i++ {
		testenv.InsertN(t, app, 1, "allowed.thing")
		testenv.InsertN(t, app, 2, "denied.thing")
	}
	h := startRelay(t, path, n.URL(), harnessOptions{maxTries: 2, ackTimeout: 500 * time.Millisecond,
		natsCfg: config.NATS{User: "relay", Password: "pw"}})
	counts := waitAllSettled(t, app, 15, 40*time.Second)
	if counts["done"] != 5 || counts["dead_lettered"] != 10 {
		t.Fatalf("counts %v", counts)
	}
	rows, err := app.Query(`SELECT attempts, last_error FROM event_queue WHERE status = 'dead_lettered'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var attempts int
		var reason string
		rows.Scan(&attempts, &reason)
		if attempts != 2 || !strings.Contains(reason, "permission denied on subject events.denied.thing") {
			t.Errorf("dead letter: attempts %d, last_error %q", attempts, reason)
		}
	}
	denials := h.logs.FilterMessageSnippet("nats permission denied").All()
	if len(denials) != 1 || denials[0].Level != zapcore.ErrorLevel || denials[0].ContextMap()["subject"] != "events.denied.thing" {
		t.Fatalf("permission log lines: %v", denials)
	}
	if got := logCount(h, "broker unavailable; pausing without spending attempts"); got != 0 {
		t.Fatalf("a permission problem was taken for an outage %d times", got)
	}
}

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

// TestPermissionGrantedTakesEffectAtOnce: rows on a subject the server
// denies spend attempts on the server's refusals; once the operator grants
// the subject (a configuration reload), every row on it is sent and
// stored: those written after the grant spend nothing, and a row put back
// by hand (what dead-letters retry does) goes out on its next try.
func TestPermissionGrantedTakesEffectAtOnce(t *testing.T) {
	n := testenv.StartNATS(t, allowedOnly)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 3, "denied.thing")
	h := startRelay(t, path, n.URL(), harnessOptions{maxTries: 10, ackTimeout: 500 * time.Millisecond,
		natsCfg: config.NATS{User: "relay", Password: "pw"}})
	testenv.Eventually(t, 20*time.Second, "the denied rows refused once", func() bool {
		var refused int
		app.QueryRow(`SELECT count(*) FROM event_queue WHERE attempts = 1 AND last_error LIKE '%permission denied%'`).Scan(&refused)
		return refused == 3
	})
	n.Reload(func(o *server.Options) {
		o.Users[0].Permissions.Publish.Allow = append(o.Users[0].Permissions.Publish.Allow, "events.denied.>")
	})
	testenv.InsertN(t, app, 5, "denied.thing")
	// The refused rows put back for now, as dead-letters retry does.
	exec(t, app, `UPDATE event_queue SET available_at = 0 WHERE attempts = 1`)
	waitAllSettled(t, app, 8, 20*time.Second)
	var attempts []string
	for _, s := range testenv.Strings(t, app, `SELECT status || ':' || attempts FROM event_queue ORDER BY id`) {
		attempts = append(attempts, s)
	}
	if got, want := strings.Join(attempts, ","), "done:1,done:1,done:1,done:0,done:0,done:0,done:0,done:0"; got != want {
		t.Errorf("rows after the grant: %s, want %s", got, want)
	}
	nc, err := nats.Connect(n.URL(), nats.UserInfo("relay", "pw"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if got := len(testenv.StreamMessages(t, js, "EVENTS")); got != 8 {
		t.Errorf("stream holds %d messages, want 8", got)
	}
	if got := logCount(h, "nats permission granted: rows on this subject are published again"); got != 1 {
		t.Errorf("the grant was logged %d times, want once", got)
	}
}
