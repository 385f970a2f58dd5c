package daemon

import (
	"context"
	"database/sql"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// readyz asks a's /readyz as a probe would and returns the status and body.
func readyz(t *testing.T, a *App) (int, string) {
	t.Helper()
	srv := httptest.NewServer(a.metrics.Handler(a.Live, a.Ready, a.role))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestShortDuplicateWindowIsAWarning: on a stream whose max_age (30 min)
// keeps the server from taking the 1 h window, the relay publishes with
// the stream's 2 min window, ready, and /readyz, the log and
// stream_duplicate_window_seconds say so, with both choices; once an
// operator raises max_age and the window, the warning goes.
func TestShortDuplicateWindowIsAWarning(t *testing.T) {
	n := testenv.StartNATS(t)
	ctx := context.Background()
	js := n.JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, MaxAge: 30 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	a, cfg := openTestLog(t, n, zap.New(core), nil)
	app := testenv.AppDB(t, cfg.Database.Path)
	testenv.InsertN(t, app, 2, "ShortWindow")
	testenv.Eventually(t, 30*time.Second, "the rows published", func() bool { return testenv.Counts(t, app)["done"] == 2 })
	code, body := readyz(t, a)
	if code != 200 || !strings.HasPrefix(body, "ok: leading") ||
		!strings.Contains(body, "; warning: stream EVENTS dedups within 2m, not the 1h of stream.duplicate_window") ||
		!strings.Contains(body, "raise max_age to at least 1h (nats stream edit EVENTS --max-age 1h --dupe-window 1h -f)") ||
		!strings.Contains(body, "set stream.duplicate_window to at most 30m; JetStream then drops a re-published event only within that window") {
		t.Fatalf("/readyz %d %q", code, body)
	}
	if got := metrics.Value(a.metrics.StreamDuplicateWindow); got != 120 {
		t.Fatalf("stream_duplicate_window_seconds %v, want 120", got)
	}
	if l := logs.FilterMessageSnippet("duplicate window is shorter").All(); len(l) != 1 || l[0].Level != zapcore.WarnLevel {
		t.Fatalf("short window log lines: %v", logs.All())
	}

	s, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	fixed := s.CachedInfo().Config
	fixed.MaxAge, fixed.Duplicates = time.Hour, time.Hour
	if _, err := js.UpdateStream(ctx, fixed); err != nil {
		t.Fatal(err)
	}
	if code, body := readyz(t, a); code != 200 || strings.Contains(body, "warning") {
		t.Fatalf("/readyz after the fix: %d %q", code, body)
	}
	if got := metrics.Value(a.metrics.StreamDuplicateWindow); got != 3600 {
		t.Fatalf("stream_duplicate_window_seconds %v after the fix, want 3600", got)
	}
}

// notCreated runs a relay on a fresh file of rows rows against n, whose
// stream cannot be created, until /readyz answers 503 with a body that
// begins with prefix and holds says; it returns the relay, the file and
// the log.
func notCreated(t *testing.T, n *testenv.NATS, rows int, prefix string, says ...string) (*App, *sql.DB, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	a, cfg := openTestLog(t, n, zap.New(core), nil)
	app := testenv.AppDB(t, cfg.Database.Path)
	testenv.InsertN(t, app, rows, "NotCreated")
	testenv.Eventually(t, 20*time.Second, "not ready, saying "+prefix, func() bool {
		code, body := readyz(t, a)
		if code != 503 || !strings.HasPrefix(body, prefix) {
			return false
		}
		for _, s := range says {
			if !strings.Contains(body, s) {
				return false
			}
		}
		return true
	})
	return a, app, logs
}

// TestSubjectOverlapIsAConfigurationError: a stream that cannot be created
// because another takes some of its subjects keeps the relay not ready with
// the reason (which stream, what to change) under "stream: ", logged once
// at error level, and publishes nothing; once the other stream lets go of
// the subjects, the stream is created and the rows go out.
func TestSubjectOverlapIsAConfigurationError(t *testing.T) {
	n := testenv.StartNATS(t)
	ctx := context.Background()
	js := n.JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>", "events.Order.*"}}); err != nil {
		t.Fatal(err)
	}
	a, app, logs := notCreated(t, n, 3, "stream: subjects overlap another stream: ",
		"stream ORDERS takes events.Order.*", "nats stream edit ORDERS --subjects 'orders.>' -f")
	// Three refused creations (probes) later, still logged once.
	refused := func() uint64 {
		info, err := js.AccountInfo(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.API.Errors
	}
	before := refused()
	testenv.Eventually(t, 30*time.Second, "three more probes", func() bool { return refused() >= before+3 })
	if c := testenv.Counts(t, app); c["done"] != 0 {
		t.Fatalf("rows published without the stream: %v", c)
	}
	if l := logs.FilterMessageSnippet("the stream cannot be created").All(); len(l) != 1 || l[0].Level != zapcore.ErrorLevel ||
		!strings.Contains(l[0].ContextMap()["error"].(string), "ORDERS") {
		t.Fatalf("configuration error log lines: %v", logs.All())
	}

	s, err := js.Stream(ctx, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	orders := s.CachedInfo().Config
	orders.Subjects = []string{"orders.>"}
	if _, err := js.UpdateStream(ctx, orders); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the rows published", func() bool { return testenv.Counts(t, app)["done"] == 3 })
	testenv.Eventually(t, 20*time.Second, "ready", func() bool { code, _ := readyz(t, a); return code == 200 })
	if logs.FilterMessage("the stream's configuration error is fixed").Len() != 1 {
		t.Fatalf("no line saying the error is fixed: %v", logs.All())
	}
}

// TestStreamRefusedByTheServerIsAConfigurationError: a server that limits
// duplicate windows below stream.duplicate_window refuses to create the
// stream: the relay is not ready, naming the setting and the limit under
// "stream: ", logs it once at error level, spends nothing and publishes
// nothing, rather than waiting on it as on an outage.
func TestStreamRefusedByTheServerIsAConfigurationError(t *testing.T) {
	n := testenv.StartNATS(t, func(o *server.Options) { o.JetStreamLimits.Duplicates = 30 * time.Minute })
	_, app, logs := notCreated(t, n, 2, "stream: the server refuses the stream's configuration: stream EVENTS cannot be created: ",
		"set stream.duplicate_window (1h0m0s now) to at most the server's limit")
	if l := logs.FilterMessageSnippet("the stream cannot be created").All(); len(l) != 1 || l[0].Level != zapcore.ErrorLevel {
		t.Fatalf("configuration error log lines: %v", logs.All())
	}
	if c := testenv.Counts(t, app); c["pending"] != 2 {
		t.Fatalf("rows %v, want both pending", c)
	}
	var attempts int
	if err := app.QueryRow(`SELECT sum(attempts) FROM event_queue`).Scan(&attempts); err != nil || attempts != 0 {
		t.Fatalf("%d attempts spent (%v)", attempts, err)
	}
}

// TestWindowUnderTheServersLimitIsAdvisedAsTheServerAllows: an existing
// stream of the default 2 min window, on a server that allows no window
// over 30 min: the relay publishes with a warning in /readyz whose
// command is one the server takes (30m), naming the server's limit.
func TestWindowUnderTheServersLimitIsAdvisedAsTheServerAllows(t *testing.T) {
	n := testenv.StartNATS(t, func(o *server.Options) { o.JetStreamLimits.Duplicates = 30 * time.Minute })
	if _, err := n.JetStream(t).CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	a, cfg := openTest(t, n, nil)
	testenv.InsertN(t, testenv.AppDB(t, cfg.Database.Path), 1, "Limited")
	testenv.Eventually(t, 20*time.Second, "ready with the warning", func() bool {
		code, body := readyz(t, a)
		return code == 200 && strings.Contains(body, "the server allows no window longer than 30m") &&
			strings.Contains(body, "nats stream edit EVENTS --dupe-window 30m -f")
	})
}

// TestPatchCounterSeriesStartAtZero: every field reconciliation may patch
// has its stream_config_patched_total series from the start, so rate()
// and increase() see the first patch.
func TestPatchCounterSeriesStartAtZero(t *testing.T) {
	a, _ := openTest(t, testenv.StartNATS(t), nil)
	fams, err := a.metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	fields := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != metrics.Namespace+"_stream_config_patched_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			fields[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	for _, want := range []string{"duplicate_window", "max_deliver", "ack_wait"} {
		if v, ok := fields[want]; !ok || v != 0 {
			t.Errorf("stream_config_patched_total{field=%q}: %v (present %v), want 0", want, v, ok)
		}
	}
}

// TestFirstProbeCreatesTheStreamAndPasses: the probe that reconciles the
// stream on the broker's first answer passes once it has created it, so
// that the relay does not begin with an outage of its own making.
func TestFirstProbeCreatesTheStreamAndPasses(t *testing.T) {
	n := testenv.StartNATS(t)
	cfg := config.Default()
	cfg.Database.Path, cfg.NATS.URL, cfg.Metrics.Listen = testenv.NewDB(t), n.URL(), ""
	a, err := Open(context.Background(), cfg, zap.NewNop(), Options{Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.brokerReady(context.Background()); err != nil {
		t.Fatalf("first probe: %v", err)
	}
	if _, err := n.JetStream(t).Stream(context.Background(), cfg.Stream.Name); err != nil {
		t.Fatalf("the stream after the first probe: %v", err)
	}
}

// TestNoAckStreamIsNamed: a stream with no_ack answers no publish. The
// relay publishes nothing, spends nothing, and /readyz names the setting
// and the command that turns it off, instead of a broker that times out.
func TestNoAckStreamIsNamed(t *testing.T) {
	n := testenv.StartNATS(t)
	if _, err := n.JetStream(t).CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, NoAck: true}); err != nil {
		t.Fatal(err)
	}
	a, cfg := openTest(t, n, nil)
	app := testenv.AppDB(t, cfg.Database.Path)
	testenv.InsertN(t, app, 2, "Unanswered")
	testenv.Eventually(t, 20*time.Second, "not ready, naming no_ack", func() bool {
		code, body := readyz(t, a)
		return code == 503 && strings.Contains(body, "stream EVENTS has no_ack set") && strings.Contains(body, "nats stream edit EVENTS --ack -f")
	})
	var attempts, pending int
	if err := app.QueryRow(`SELECT sum(attempts), count(*) FILTER (WHERE status = 'pending') FROM event_queue`).Scan(&attempts, &pending); err != nil || attempts != 0 || pending != 2 {
		t.Fatalf("attempts %d, pending %d (%v); want 0 and 2", attempts, pending, err)
	}
}
