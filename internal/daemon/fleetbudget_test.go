package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// gatedAcks counts the messages all of a fleet's files have published and
// whose acknowledgements their relays have not seen yet, holding those
// acknowledgements back until open is closed.
type gatedAcks struct {
	open chan struct{}

	mu                sync.Mutex
	outstanding, most int
}

func (g *gatedAcks) wrap(p relay.Publisher) relay.Publisher { return gatedPublisher{p, g} }

func (g *gatedAcks) state() (outstanding, most int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.outstanding, g.most
}

type gatedPublisher struct {
	relay.Publisher
	g *gatedAcks
}

func (p gatedPublisher) Publish(ctx context.Context, msgs []publish.Message) []publish.Ack {
	acks := p.Publisher.Publish(ctx, msgs)
	p.g.mu.Lock()
	defer p.g.mu.Unlock()
	p.g.outstanding += len(acks)
	p.g.most = max(p.g.most, p.g.outstanding)
	for i, a := range acks {
		acks[i] = gatedAck{a, p.g}
	}
	return acks
}

type gatedAck struct {
	publish.Ack
	g *gatedAcks
}

func (a gatedAck) Wait(ctx context.Context) publish.Result {
	select {
	case <-a.g.open:
	case <-ctx.Done():
	}
	res := a.Ack.Wait(ctx)
	a.g.mu.Lock()
	a.g.outstanding--
	a.g.mu.Unlock()
	return res
}

// TestFleetFilesShareTheInFlightBudget: files with backlogs hold
// relay.max_in_flight rows in flight together, not each (and a few rows
// each past it, as a trickle may); a file with a commit of its own is
// published while they wait for room; every row is published once.
func TestFleetFilesShareTheInFlightBudget(t *testing.T) {
	const rows, inFlight, trickle = 600, 200, 16
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	tenants := []string{"acme", "globex", "initech", "umbrella"}
	dbs := map[string]*sql.DB{}
	want := map[string]int{}
	for _, name := range tenants {
		db := tenantFile(t, dir, name, 0)
		testenv.MustExec(t, db, fmt.Sprintf(`WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < %d)
			INSERT INTO event_queue (event_id, event_type, payload) SELECT ? || '-' || i, 'order.placed', CAST(? AS BLOB) FROM c`, rows), name, name)
		dbs[name], want[name] = db, rows
	}
	g := &gatedAcks{open: make(chan struct{})}
	h := startFleetWith(t, dir, n.URL(), time.Minute, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
		cfg.Relay.BatchSize, cfg.Relay.MaxInFlight = 50, inFlight
	}, func(th *daemon.TestHooks) { th.WrapPublisher = g.wrap })
	h.waitReadyz(t, ": 4 open (leading 4)")
	bound := inFlight + len(tenants)*trickle
	testenv.Eventually(t, 20*time.Second, "the budget taken", func() bool { out, _ := g.state(); return out >= inFlight*3/4 })
	time.Sleep(200 * time.Millisecond) // room for more claims, were the budget each file's
	if _, most := g.state(); most > bound {
		t.Fatalf("%d rows in flight at once across the files, want at most %d (each file's own bound: %d)", most, bound, len(tenants)*inFlight)
	}
	hooli := tenantFile(t, dir, "hooli", 1)
	dbs["hooli"], want["hooli"] = hooli, 1
	s, err := n.JetStream(t).Stream(context.Background(), "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, "hooli's row stored while the budget is spent", func() bool {
		_, err := s.GetLastMsgForSubject(context.Background(), "events.hooli.>")
		return err == nil
	})
	close(g.open)
	for name, db := range dbs {
		waitDone(t, db, want[name])
	}
	checkFleetStream(t, n, want)
}
