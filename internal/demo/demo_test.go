package demo

import (
	"bytes"
	"context"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestWriteEventsIsTransactional: every event the demo application writes
// comes with its own row of data, in one transaction, and some events have
// no event_id, as a foreign writer's might.
func TestWriteEventsIsTransactional(t *testing.T) {
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int64, 1)
	go func() {
		n, err := WriteEvents(ctx, path, "event_queue", 1000, func(err error) { t.Error(err) })
		if err != nil {
			t.Error(err)
		}
		done <- n
	}()
	testenv.Eventually(t, 30*time.Second, "200 events written", func() bool {
		var n int
		return db.QueryRow(`SELECT count(*) FROM event_queue`).Scan(&n) == nil && n >= 200
	})
	cancel()
	written := <-done
	var events, reviews, noID int64
	db.QueryRow(`SELECT count(*), count(*) - count(event_id) FROM event_queue`).Scan(&events, &noID)
	db.QueryRow(`SELECT count(*) FROM reviews`).Scan(&reviews)
	if events != written || reviews != written {
		t.Fatalf("written %d, events %d, reviews %d: want the same", written, events, reviews)
	}
	if noID == 0 || noID == events {
		t.Fatalf("%d of %d events without an event_id, want some", noID, events)
	}
}

// runDemo runs the demo on dir for d at rate, and returns its progress
// lines and its summary.
func runDemo(t *testing.T, dir string, rate int, d time.Duration, m *metrics.Metrics) (lines []string, summary string) {
	t.Helper()
	cfg := config.Default()
	cfg.Database.Path = filepath.Join(dir, "app.db")
	cfg.NATS.URL = config.EmbeddedURL
	cfg.NATS.Embedded.StoreDir = filepath.Join(dir, "nats")
	cfg.Metrics.Listen = "127.0.0.1:0"
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var out bytes.Buffer
	if err := Run(ctx, cfg, Options{Rate: rate, Dir: dir, Out: &out, Log: zap.NewNop(), Metrics: m}); err != nil {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	for _, l := range strings.Split(out.String(), "\n") {
		switch {
		case strings.HasPrefix(l, "published "):
			lines = append(lines, l)
		case strings.HasPrefix(l, "demo stopped"):
			summary = l
		}
	}
	if len(lines) == 0 || summary == "" {
		t.Fatalf("no progress line or summary:\n%s", out.String())
	}
	return lines, summary
}

var progressLine = regexp.MustCompile(`^published +(\d+) +\( *(\d+)/s\) +backlog +\d+ +avg lag +(\S+) `)

// TestDemoRestartsOnItsDirectory: run again on the same --dir, the demo's
// first line counts this run's rows a second, not the rows published by
// the run before.
func TestDemoRestartsOnItsDirectory(t *testing.T) {
	dir := t.TempDir()
	runDemo(t, dir, 500, 2500*time.Millisecond, nil)
	lines, _ := runDemo(t, dir, 20, 1500*time.Millisecond, nil)
	f := progressLine.FindStringSubmatch(lines[0])
	if f == nil {
		t.Fatalf("progress line %q", lines[0])
	}
	total, rate := atoi(t, f[1]), atoi(t, f[2])
	if total == 0 || rate >= total {
		t.Fatalf("first line after a restart %q: %d/s of %d published; the rows of the run before are no rate", lines[0], rate, total)
	}
}

// TestDemoShowsTheDeliveryLagMetric: the lag the demo shows is the relay's
// outbox_relay_delivery_lag_seconds, from created_at to the broker's ack:
// over the run, its summary gives the histogram's mean.
func TestDemoShowsTheDeliveryLagMetric(t *testing.T) {
	m := metrics.New("test", "")
	lines, summary := runDemo(t, t.TempDir(), 200, 2500*time.Millisecond, m)
	var d dto.Metric
	if err := m.DeliveryLag.Write(&d); err != nil {
		t.Fatal(err)
	}
	h := d.GetHistogram()
	if h.GetSampleCount() == 0 {
		t.Fatalf("the relay recorded no delivery lag; lines %q", lines)
	}
	mean := time.Duration(h.GetSampleSum() / float64(h.GetSampleCount()) * float64(time.Second)).Round(100 * time.Microsecond)
	if want := "(avg lag " + mean.String() + ")"; !strings.Contains(summary, want) {
		t.Fatalf("summary %q; want it to give the metric's mean, %s", summary, want)
	}
	for _, l := range lines {
		if f := progressLine.FindStringSubmatch(l); f == nil || f[2] != "0" && f[3] == "-" {
			t.Errorf("progress line %q: rows published and no lag", l)
		}
	}
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestBannerNamesTheSubjects: the banner gives the subjects the demo's
// file publishes on, as its template makes them.
func TestBannerNamesTheSubjects(t *testing.T) {
	for template, want := range map[string]string{
		"{event_type}":          "subjects events.<event_type>)",
		"{tenant}.{event_type}": "subjects events.app.<event_type>)",
	} {
		cfg := config.Default()
		cfg.Database.Path = filepath.Join(t.TempDir(), "app.db")
		cfg.Stream.SubjectTemplate = template
		var out bytes.Buffer
		banner(&out, cfg, nil, 10)
		if !strings.Contains(out.String(), want) {
			t.Errorf("template %s: the banner says\n%s\nwant %q in it", template, out.String(), want)
		}
	}
}
