package metrics

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"go.yaml.in/yaml/v3"
)

// specNames are the metric names the contract lists (docs/contract.md).
var specNames = []string{
	"published_total", "duplicates_total", "atomic_batches_total", "atomic_batch_limit", "atomic_batch_fallbacks_total", "deferred_total", "retries_total", "dead_lettered_total",
	"leases_reclaimed_total", "backlog_rows", "oldest_pending_age_seconds", "parked_keys", "broker_connected",
	"leader", "in_flight_rows", "publish_duration_seconds", "delivery_lag_seconds", "stream_config_patched_total",
	"stream_duplicate_window_seconds", "consumer_exhausted_total", "pruned_rows_total", "build_info",
}

// exported returns every series name the registry can expose, histogram
// suffixes included.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	m := New("v", "c")
	m.ServeFleet(true) // a fleet's metrics too
	// Touch the labelled families so they are gathered.
	m.Backlog.WithLabelValues("pending")
	m.StreamConfigPatched.WithLabelValues("duplicate_window")
	m.PrunedRows.WithLabelValues("outbox")
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, f := range fams {
		names[f.GetName()] = true
		if f.GetType() == dto.MetricType_HISTOGRAM {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				names[f.GetName()+s] = true
			}
		}
	}
	return names
}

func TestEverySpecMetricIsExported(t *testing.T) {
	names := exported(t)
	for _, n := range specNames {
		if !names[Namespace+"_"+n] {
			t.Errorf("%s_%s is not exported", Namespace, n)
		}
	}
	for _, n := range []string{"go_goroutines", "process_resident_memory_bytes"} {
		if !names[n] {
			t.Errorf("collector metric %s missing", n)
		}
	}
}

var relayMetric = regexp.MustCompile(`\boutbox_relay_[a-z_]+`)

// checkExprs fails for every outbox_relay_* name in exprs that the relay
// does not export.
func checkExprs(t *testing.T, where string, exprs []string) {
	t.Helper()
	names := exported(t)
	if len(exprs) == 0 {
		t.Fatalf("%s: no expressions found", where)
	}
	for _, e := range exprs {
		used := relayMetric.FindAllString(e, -1)
		if len(used) == 0 && !strings.Contains(e, `up{job="outbox-relay"}`) {
			t.Errorf("%s: expression %q uses no relay metric", where, e)
		}
		for _, n := range used {
			if !names[n] {
				t.Errorf("%s: %q uses %s, which the relay does not export", where, e, n)
			}
		}
	}
}

func TestAlertRulesUseExportedMetrics(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/prometheus/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(raw, &rules); err != nil {
		t.Fatal(err)
	}
	var exprs, alerts []string
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("rule %+v lacks a name, severity or summary", r)
			}
			exprs = append(exprs, r.Expr)
			alerts = append(alerts, r.Alert)
		}
	}
	checkExprs(t, "alerts.yml", exprs)
	sort.Strings(alerts)
	for _, want := range []string{"OutboxRelayBacklogTooOld", "OutboxRelayBrokerDisconnected", "OutboxRelayDeadLettersGrowing", "OutboxRelayDown", "OutboxRelayParkedKeys"} {
		if sort.SearchStrings(alerts, want) == len(alerts) || alerts[sort.SearchStrings(alerts, want)] != want {
			t.Errorf("alert %s missing", want)
		}
	}
	promtool(t, "check", "rules", "../../deploy/prometheus/alerts.yml")
}

// promtool runs Prometheus' own checker where it is installed (CI installs
// it: Debian's prometheus package).
func promtool(t *testing.T, args ...string) {
	t.Helper()
	bin, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("CI must install promtool (Debian package prometheus)")
		}
		t.Log("promtool not installed; skipping its check")
		return
	}
	out, err := exec.Command(bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func TestDashboardUsesExportedMetrics(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/grafana/outbox-relay.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		UID    string `json:"uid"`
		Title  string `json:"title"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	var exprs, titles []string
	for _, p := range dash.Panels {
		titles = append(titles, p.Title)
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			exprs = append(exprs, tg.Expr)
		}
	}
	checkExprs(t, "outbox-relay.json", exprs)
	all := strings.ToLower(strings.Join(titles, "|"))
	for _, want := range []string{"throughput", "backlog", "oldest pending", "lag", "broker", "dead letter", "parked", "lead", "in flight", "duplicate window"} {
		if !strings.Contains(all, want) {
			t.Errorf("no panel about %s (panels: %s)", want, all)
		}
	}
	if dash.UID == "" || dash.Title == "" {
		t.Error("dashboard needs a uid and a title")
	}
}

func TestHealthHandlers(t *testing.T) {
	m := New("v", "c")
	srv := httptest.NewServer(m.Handler(nil, func(ctx context.Context) error { return errors.New("broker: nats not connected\nsecond line") }, nil))
	defer srv.Close()
	get := func(path string) (int, string) {
		resp, err := srv.Client().Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/healthz"); code != 200 || body != "ok\n" {
		t.Fatalf("/healthz %d %q", code, body)
	}
	if code, body := get("/readyz"); code != 503 || body != "broker: nats not connected; second line\n" {
		t.Fatalf("/readyz %d %q", code, body)
	}
	if code, body := get("/metrics"); code != 200 || !strings.Contains(body, "outbox_relay_build_info{") {
		t.Fatalf("/metrics %d", code)
	}
}

// TestHistogramBuckets: the round trip is resolved from half a millisecond
// to seconds, the delivery lag from a millisecond (a relay keeping up) to
// hours (a backlog after an outage).
func TestHistogramBuckets(t *testing.T) {
	m := New("v", "c")
	m.PublishDuration.Observe(0.002)
	m.DeliveryLag.Observe(0.002)
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][2]float64{ // smallest and largest finite bound
		Namespace + "_publish_duration_seconds": {0.0005, 10},
		Namespace + "_delivery_lag_seconds":     {0.001, 4 * 3600},
	}
	for _, f := range fams {
		w, ok := want[f.GetName()]
		if !ok {
			continue
		}
		delete(want, f.GetName())
		b := f.GetMetric()[0].GetHistogram().GetBucket()
		if len(b) < 10 || b[0].GetUpperBound() != w[0] || b[len(b)-1].GetUpperBound() != w[1] {
			t.Errorf("%s: %d buckets from %v to %v, want %v to %v", f.GetName(), len(b), b[0].GetUpperBound(), b[len(b)-1].GetUpperBound(), w[0], w[1])
		}
	}
	if len(want) > 0 {
		t.Errorf("histograms not gathered: %v", want)
	}
}
