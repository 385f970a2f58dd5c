package daemon_test

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http/httptest"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
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
	busyTimeout   time.Duration
	natsCfg       config.NATS   // credentials and TLS
	ackTimeout    time.Duration // default 5 s
	replicas      int           // of the stream the relay creates
	wrapPublisher func(relay.Publisher) relay.Publisher
	wrapStore     func(relay.Store) relay.Store
	wrapLead      func(relay.Lead) relay.Lead
	mutateOpt     func(*relay.Options)
	mutateKeeper  func(*housekeeping.Options)
	clock         *event.Clock  // shared by the store and the loop, as the daemon does
	doneRows      string        // retention.done_rows; default keep
	window        time.Duration // stream.duplicate_window; default 1 h
}

var want = streamsync.Want{Stream: "EVENTS", Subjects: []string{"events.>"}, DuplicateWindow: time.Hour, Replicas: 1, Create: true, SubjectPrefix: "events"}

// relayConns returns the server's connections that the daemon made (it
// names them "outbox-relay").
func relayConns(t testing.TB, n *testenv.NATS) []*server.ConnInfo {
	t.Helper()
	conns, err := n.Srv.Connz(&server.ConnzOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []*server.ConnInfo
	for _, c := range conns.Conns {
		if c.Name == "outbox-relay" {
			out = append(out, c)
		}
	}
	return out
}

// harnessConfig is the configuration the harness gives the daemon.
func harnessConfig(dbPath, natsURL string, ho harnessOptions) config.Config {
	cfg := config.Default()
	cfg.Database.Path, cfg.Database.BusyTimeout = dbPath, cmp.Or(ho.busyTimeout, 5*time.Second)
	cfg.Schema.Mode = config.SchemaOff // the tests make the schema they want
	cfg.NATS = ho.natsCfg
	cfg.NATS.URL, cfg.NATS.Mode = natsURL, cmp.Or(ho.mode, config.ModeJetStream)
	cfg.Stream.Name, cfg.Stream.Subjects, cfg.Stream.SubjectPrefix = want.Stream, want.Subjects, want.SubjectPrefix
	cfg.Stream.DuplicateWindow, cfg.Stream.Replicas, cfg.Stream.Create = cmp.Or(ho.window, want.DuplicateWindow), cmp.Or(ho.replicas, 1), true
	cfg.Consumer.Durable = ""
	cfg.Relay.BatchSize, cfg.Relay.MaxInFlight = cmp.Or(ho.batch, 100), cmp.Or(ho.inFlight, 400)
	cfg.Relay.Lease, cfg.Relay.ShutdownTimeout = cmp.Or(ho.lease, time.Minute), cmp.Or(ho.shutdown, 5*time.Second)
	cfg.Relay.MaxAttempts, cfg.Relay.AckTimeout = cmp.Or(ho.maxTries, 10), cmp.Or(ho.ackTimeout, 5*time.Second)
	cfg.Relay.PollInterval = 200 * time.Millisecond
	cfg.Retention.DoneRows = cmp.Or(ho.doneRows, config.DoneRowsKeep)
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

// noLockErrors fails the test for every log line that mentions a lock error.
func (h *harness) noLockErrors() {
	h.t.Helper()
	for _, e := range h.logs.All() {
		text := e.Message + fmt.Sprint(e.ContextMap())
		if strings.Contains(text, "database is locked") || strings.Contains(strings.ToLower(text), "busy") {
			h.t.Errorf("log line mentions a lock error: %s %v", e.Message, e.ContextMap())
		}
	}
}

// waitAllSettled waits until total rows are done or dead-lettered and
// returns the rows by status.
func waitAllSettled(t *testing.T, db *sql.DB, total int, timeout time.Duration) map[string]int {
	t.Helper()
	var counts map[string]int
	testenv.Eventually(t, timeout, fmt.Sprintf("all %d rows settled", total), func() bool {
		counts = testenv.Counts(t, db)
		return counts["done"]+counts["dead_lettered"] == total
	})
	return counts
}

// logCount is how many lines h logged with the message msg.
func logCount(h *harness, msg string) int {
	return h.logs.FilterMessage(msg).Len()
}

// assertOncePerEvent checks the stream holds exactly one message per row.
func assertOncePerEvent(t *testing.T, n *testenv.NATS, db *sql.DB, rows int) {
	t.Helper()
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	seen := map[string]int{}
	for _, m := range msgs {
		seen[m.Header.Get(publish.HeaderMsgID)]++
	}
	var ids int
	if err := db.QueryRow(`SELECT count(DISTINCT event_id) FROM event_queue WHERE status = 'done'`).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	if len(msgs) != rows || len(seen) != rows || ids != rows {
		t.Fatalf("stream holds %d messages with %d ids; %d done rows; want %d each", len(msgs), len(seen), ids, rows)
	}
}

// scrape reads one sample from the relay's /metrics.
func scrape(t *testing.T, h *harness, sample string) float64 {
	t.Helper()
	srv := httptest.NewServer(h.metrics.Handler(nil, nil, nil))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return sampleOf(t, string(body), sample)
}

// sampleOf reads one sample from a /metrics body.
func sampleOf(t *testing.T, body, sample string) float64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(sample) + ` (\S+)$`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no sample %s in /metrics", sample)
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// metricsReach waits up to 10 s until each sample on h's /metrics reads
// its value, and fails naming those that do not. Counters move right after
// the commit that settles their rows, so a test that has seen the rows can
// be a moment early.
func metricsReach(t *testing.T, h *harness, want map[string]float64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var wrong []string
		for sample, v := range want {
			if got := scrape(t, h, sample); got != v {
				wrong = append(wrong, fmt.Sprintf("%s = %v, want %v", sample, got, v))
			}
		}
		if len(wrong) == 0 {
			return
		}
		if time.Now().After(deadline) {
			sort.Strings(wrong)
			t.Fatalf("after 10 s:\n%s", strings.Join(wrong, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
