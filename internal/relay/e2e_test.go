package relay_test

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// harness is a relay wired by the daemon, as outbox-relay run wires it,
// on real parts.
type harness struct {
	t       testing.TB
	app     *daemon.App
	relay   *relay.Relay
	metrics *metrics.Metrics
	logs    *observer.ObservedLogs
	cancel  context.CancelFunc
	done    chan error
	// claimer is the channel the relay gives its commit watch for other
	// connections' commits: a signal on it makes the claimer look for due
	// rows now (see wake).
	claimer atomic.Pointer[chan<- struct{}]
}

type harnessOptions struct {
	mode          string
	batch         int
	inFlight      int
	lease         time.Duration
	shutdown      time.Duration
	maxTries      int
	noWatch       bool
	busyTimeout   time.Duration
	natsCfg       config.NATS   // credentials and TLS
	ackTimeout    time.Duration // default 5 s
	replicas      int           // of the stream the relay creates
	wrapPublisher func(relay.Publisher) relay.Publisher
	wrapStore     func(relay.Store) relay.Store
	wrapLead      func(relay.Lead) relay.Lead
	mutateOpt     func(*relay.Options)
	mutateKeeper  func(*housekeeping.Options)
	clock         *event.Clock // shared by the store and the loop, as the daemon does
}

var want = streamsync.Want{Stream: "EVENTS", Subjects: []string{"events.>"}, DuplicateWindow: time.Hour, Replicas: 1, Create: true, SubjectPrefix: "events"}

// harnessConfig is the configuration the harness gives the daemon.
func harnessConfig(dbPath, natsURL string, ho harnessOptions) config.Config {
	cfg := config.Default()
	cfg.Database.Path, cfg.Database.BusyTimeout = dbPath, cmp.Or(ho.busyTimeout, 5*time.Second)
	cfg.Schema.Mode = config.SchemaOff // the tests make the schema they want
	cfg.NATS = ho.natsCfg
	cfg.NATS.URL, cfg.NATS.Mode = natsURL, cmp.Or(ho.mode, config.ModeJetStream)
	cfg.Stream.Name, cfg.Stream.Subjects, cfg.Stream.SubjectPrefix = want.Stream, want.Subjects, want.SubjectPrefix
	cfg.Stream.DuplicateWindow, cfg.Stream.Replicas, cfg.Stream.Create = want.DuplicateWindow, cmp.Or(ho.replicas, 1), true
	cfg.Consumer.Durable = ""
	cfg.Relay.BatchSize, cfg.Relay.MaxInFlight = cmp.Or(ho.batch, 100), cmp.Or(ho.inFlight, 400)
	cfg.Relay.Lease, cfg.Relay.ShutdownTimeout = cmp.Or(ho.lease, time.Minute), cmp.Or(ho.shutdown, 5*time.Second)
	cfg.Relay.MaxAttempts, cfg.Relay.AckTimeout = cmp.Or(ho.maxTries, 10), cmp.Or(ho.ackTimeout, 5*time.Second)
	cfg.Relay.PollInterval = 200 * time.Millisecond
	cfg.Metrics.Listen = ""
	return cfg
}

func startRelay(t testing.TB, dbPath, natsURL string, ho harnessOptions) *harness {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	h := &harness{t: t, metrics: metrics.New("test", "test"), logs: logs, done: make(chan error, 1)}
	app, err := daemon.Open(context.Background(), harnessConfig(dbPath, natsURL, ho), zap.New(core), daemon.Options{
		Version: "test",
		Commit:  "test",
		Metrics: h.metrics,
		Test: &daemon.TestHooks{
			Relay: func(r *relay.Relay) { h.relay = r },
			Clock: ho.clock,
			Tune: func(o *relay.Options, k *housekeeping.Options) {
				// Seconds in production; tests of failover and recovery
				// would wait that long.
				o.HeartbeatInterval, o.StaleAfter = 100*time.Millisecond, 2*time.Second
				k.StatsInterval, k.CheckpointInterval = 50*time.Millisecond, 200*time.Millisecond
				if ho.noWatch {
					o.WatchInterval = 0
				}
				if watch := o.Watch; watch != nil {
					o.Watch = func(ctx context.Context, interval time.Duration, foreign chan<- struct{}, any ...chan<- struct{}) error {
						h.claimer.Store(&foreign)
						return watch(ctx, interval, foreign, any...)
					}
				}
				if ho.mutateOpt != nil {
					ho.mutateOpt(o)
				}
				if ho.mutateKeeper != nil {
					ho.mutateKeeper(k)
				}
			},
			WrapStore:     ho.wrapStore,
			WrapLead:      ho.wrapLead,
			WrapPublisher: ho.wrapPublisher,
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	h.app = app
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- app.Run(ctx) }()
	t.Cleanup(func() { h.stop() })
	return h
}

// stop shuts the relay down gracefully and returns Run's error.
func (h *harness) stop() error {
	if h.cancel == nil {
		return nil
	}
	h.cancel()
	h.cancel = nil
	select {
	case err := <-h.done:
		return err
	case <-time.After(30 * time.Second):
		h.t.Fatal("relay did not stop")
		return nil
	}
}

// wake makes the claimer look for due rows now, as a commit of the
// application would, for tests that change rows under the relay's feet.
func (h *harness) wake() {
	h.t.Helper()
	testenv.Eventually(h.t, 10*time.Second, "the commit watch to start", func() bool { return h.claimer.Load() != nil })
	select {
	case *h.claimer.Load() <- struct{}{}:
	default: // a wake-up is already due
	}
}

func (h *harness) noLockErrors() {
	h.t.Helper()
	for _, e := range h.logs.All() {
		text := e.Message + fmt.Sprint(e.ContextMap())
		if strings.Contains(text, "database is locked") || strings.Contains(strings.ToLower(text), "busy") {
			h.t.Errorf("log line mentions a lock error: %s %v", e.Message, e.ContextMap())
		}
	}
}

func waitAllSettled(t *testing.T, db *sql.DB, total int, timeout time.Duration) map[string]int {
	t.Helper()
	var counts map[string]int
	testenv.Eventually(t, timeout, fmt.Sprintf("all %d rows settled", total), func() bool {
		counts = testenv.Counts(t, db)
		return counts["done"]+counts["dead_lettered"] == total
	})
	return counts
}

var eventTypes = []string{"ReviewLogged", "ReviewDeleted", "MovieDeleted", "watchlist.item.added", "WrapUpCompleted"}

// TestEndToEnd: an application inserts 5,000 rows on its own connection
// while the relay runs; every row is published once, byte for byte, with
// its headers, and marked done.
func TestEndToEnd(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{})

	const total = 5000
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(1, 2))
		for written := 0; written < total; {
			k := min(1+rng.IntN(20), total-written)
			evs := make([]testenv.Event, k)
			for i := range evs {
				payload := make([]byte, rng.IntN(300))
				for j := range payload {
					payload[j] = byte(rng.IntN(256)) // binary, zero bytes included
				}
				evs[i] = testenv.NewEvent(eventTypes[rng.IntN(len(eventTypes))], payload)
				if rng.IntN(10) == 0 {
					evs[i].EventID = nil // a foreign writer's row: the relay assigns the id
				}
			}
			if err := testenv.Insert(app, evs...); err != nil {
				t.Error(err)
				return
			}
			written += k
			if rng.IntN(4) == 0 {
				time.Sleep(time.Millisecond)
			}
		}
	}()
	wg.Wait()
	counts := waitAllSettled(t, app, total, 60*time.Second)
	if counts["done"] != total {
		t.Fatalf("counts %v, want %d done", counts, total)
	}

	type rowData struct {
		id                  int64
		eventID, eventType  string
		payload             []byte
		createdAt           int64
		processedAt         sql.NullInt64
		claimedAt, claimedB sql.NullString
	}
	rows, err := app.Query(`SELECT id, event_id, event_type, payload, created_at, processed_at, claimed_at, claimed_by FROM event_queue`)
	if err != nil {
		t.Fatal(err)
	}
	byEventID := map[string]rowData{}
	for rows.Next() {
		var r rowData
		if err := rows.Scan(&r.id, &r.eventID, &r.eventType, &r.payload, &r.createdAt, &r.processedAt, &r.claimedAt, &r.claimedB); err != nil {
			t.Fatal(err)
		}
		if r.eventID == "" || !r.processedAt.Valid || r.claimedAt.Valid || r.claimedB.Valid {
			t.Fatalf("row %d after done: %+v", r.id, r)
		}
		byEventID[r.eventID] = r
	}
	rows.Close()
	if len(byEventID) != total {
		t.Fatalf("%d distinct event ids, want %d", len(byEventID), total)
	}

	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	if len(msgs) != total {
		t.Fatalf("stream holds %d messages, want %d", len(msgs), total)
	}
	seen := map[string]bool{}
	for _, m := range msgs {
		id := m.Header.Get(publish.HeaderMsgID)
		r, ok := byEventID[id]
		if !ok {
			t.Fatalf("message %d has Nats-Msg-Id %q matching no row", m.Sequence, id)
		}
		if seen[id] {
			t.Fatalf("event %s stored twice", id)
		}
		seen[id] = true
		if m.Subject != "events."+r.eventType {
			t.Errorf("row %d: subject %q, want events.%s", r.id, m.Subject, r.eventType)
		}
		if !bytes.Equal(m.Data, r.payload) {
			t.Errorf("row %d: body differs from payload", r.id)
		}
		if got := m.Header.Get(publish.HeaderEventType); got != r.eventType {
			t.Errorf("row %d: %s %q", r.id, publish.HeaderEventType, got)
		}
		if got := m.Header.Get(publish.HeaderRowID); got != strconv.FormatInt(r.id, 10) {
			t.Errorf("row %d: %s %q", r.id, publish.HeaderRowID, got)
		}
		created, err := time.Parse(time.RFC3339Nano, m.Header.Get(publish.HeaderCreatedAt))
		if err != nil || created.UnixMilli() != r.createdAt || !strings.HasSuffix(m.Header.Get(publish.HeaderCreatedAt), "Z") {
			t.Errorf("row %d: %s %q (%v), want %d in UTC", r.id, publish.HeaderCreatedAt, m.Header.Get(publish.HeaderCreatedAt), err, r.createdAt)
		}
	}
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	// Counters move after the commit that settles their rows: read them
	// once the relay has stopped.
	if got := metrics.Value(h.metrics.Published); got != total {
		t.Errorf("published_total %v, want %d", got, total)
	}
	h.noLockErrors()
}

// TestRedeliveryIsHarmless: rows whose ack was lost (reset to pending) are
// published again; JetStream answers duplicate and stores nothing new.
func TestRedeliveryIsHarmless(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	var evs []testenv.Event
	for i := 0; i < 1000; i++ {
		evs = append(evs, testenv.NewEvent("ReviewLogged", []byte(fmt.Sprint(i))))
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 1000, 30*time.Second)
	if err := h.stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := app.Exec(`UPDATE event_queue SET status = 'pending', processed_at = NULL WHERE id % 3 = 0`); err != nil {
		t.Fatal(err)
	}
	h2 := startRelay(t, path, n.URL(), harnessOptions{})
	counts := waitAllSettled(t, app, 1000, 30*time.Second)
	if counts["done"] != 1000 {
		t.Fatalf("counts %v", counts)
	}
	if msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS"); len(msgs) != 1000 {
		t.Fatalf("stream holds %d messages after redelivery, want 1000", len(msgs))
	}
	if err := h2.stop(); err != nil {
		t.Fatal(err)
	}
	if got := metrics.Value(h2.metrics.Duplicates); got != 333 {
		t.Fatalf("duplicates_total %v, want 333", got)
	}
	if got := metrics.Value(h2.metrics.Published); got != 333 {
		t.Fatalf("published_total %v, want 333", got)
	}
}

// TestLegacyTableUpgradedAndPublished: a pre-0101 table with rows gets
// event ids, and the relay then publishes every row under its id.
func TestLegacyTableUpgradedAndPublished(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	path := dir + "/legacy.db"
	legacy, err := sql.Open("sqlite3", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	defer legacy.Close()
	for _, q := range []string{
		`CREATE TABLE event_queue (id INTEGER PRIMARY KEY, event_type TEXT NOT NULL, payload BLOB NOT NULL,
			status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
			available_at INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL DEFAULT 0,
			processed_at INTEGER, last_error TEXT)`,
		`WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 300)
			INSERT INTO event_queue (event_type, payload) SELECT 'LegacyThing', 'legacy ' || i FROM n`,
	} {
		if _, err := legacy.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := schema.Migrate(context.Background(), testenv.OpenDB(t, path)); err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	rows, err := legacy.Query(`SELECT event_id FROM event_queue`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		rows.Scan(&id)
		ids[id] = true
	}
	rows.Close()
	if len(ids) != 300 {
		t.Fatalf("%d distinct ids after upgrade, want 300", len(ids))
	}
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, legacy, 300, 30*time.Second)
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	if len(msgs) != 300 {
		t.Fatalf("stream holds %d, want 300", len(msgs))
	}
	for _, m := range msgs {
		if !ids[m.Header.Get(publish.HeaderMsgID)] {
			t.Fatalf("message with id %q not from the backfill", m.Header.Get(publish.HeaderMsgID))
		}
	}
}

// TestCoreMode publishes to a plain subscriber and settles the rows.
func TestCoreMode(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	sub, err := n.Conn(t).SubscribeSync("events.>")
	if err != nil {
		t.Fatal(err)
	}
	var evs []testenv.Event
	for i := 0; i < 200; i++ {
		evs = append(evs, testenv.NewEvent("CoreThing", []byte(fmt.Sprint("core ", i))))
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	startRelay(t, path, n.URL(), harnessOptions{mode: config.ModeCore})
	counts := waitAllSettled(t, app, 200, 30*time.Second)
	if counts["done"] != 200 {
		t.Fatalf("counts %v", counts)
	}
	got := map[string]bool{}
	for i := 0; i < 200; i++ {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("subscriber got %d of 200: %v", i, err)
		}
		if m.Subject != "events.CoreThing" || m.Header.Get(publish.HeaderMsgID) == "" {
			t.Fatalf("message %q %v", m.Subject, m.Header)
		}
		got[string(m.Data)] = true
	}
	if len(got) != 200 {
		t.Fatalf("%d distinct bodies", len(got))
	}
}

// TestInvalidEventTypesDeadLettered: rows whose type cannot form a subject
// are dead-lettered at once with the reason; the rows around them flow.
func TestInvalidEventTypesDeadLettered(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	bad := []string{"", "has space", "wild.*", "wild>", "double..dot", ".leading", "trailing.", strings.Repeat("long", 1250)}
	var evs []testenv.Event
	for i, b := range bad {
		evs = append(evs, testenv.NewEvent("Good", []byte(fmt.Sprint("before ", i))), testenv.NewEvent(b, []byte("bad")))
	}
	empty := ""
	evs = append(evs, testenv.Event{EventID: &empty, EventType: "EmptyID", Payload: []byte("no id")})
	evs = append(evs, testenv.NewEvent("Good", []byte("last")))
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{})
	counts := waitAllSettled(t, app, len(evs), 30*time.Second)
	if counts["done"] != len(bad)+1 || counts["dead_lettered"] != len(bad)+1 {
		t.Fatalf("counts %v", counts)
	}
	rows, err := app.Query(`SELECT event_type, last_error, attempts, processed_at IS NOT NULL FROM event_queue WHERE status = 'dead_lettered'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var typ, reason string
		var attempts int
		var processed bool
		rows.Scan(&typ, &reason, &attempts, &processed)
		if typ == "EmptyID" {
			if !strings.Contains(reason, "event_id is empty") {
				t.Errorf("empty event_id dead-lettered with %q", reason)
			}
			continue
		}
		if !strings.Contains(reason, "cannot form a subject") || !strings.Contains(reason, fmt.Sprintf("%.40q", typ)) || !processed {
			t.Errorf("dead letter %q: last_error %q processed %v", typ, reason, processed)
		}
	}
	metricsReach(t, h, map[string]float64{`outbox_relay_dead_lettered_total{reason="invalid"}`: float64(len(bad) + 1)})
	if msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS"); len(msgs) != len(bad)+1 {
		t.Fatalf("stream holds %d, want %d", len(msgs), len(bad)+1)
	}
}
