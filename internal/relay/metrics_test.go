package relay_test

import (
	"database/sql"
	"fmt"
	"io"
	"net/http/httptest"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

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
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(sample) + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		t.Fatalf("no sample %s in /metrics", sample)
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
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

// TestMetricsTellTheStory runs a scenario with known counts: 200 rows
// published, 50 of them again (duplicates), one outage that defers 30
// rows, one dead letter. /metrics shows exactly those numbers, and the
// backlog gauges settle to the table's truth.
func TestMetricsTellTheStory(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	h := startRelay(t, path, n.URL(), harnessOptions{})
	testenv.InsertN(t, app, 200, "Story")
	waitAllSettled(t, app, 200, 20*time.Second)

	// 50 lost acks: republished, the stream answers duplicate.
	if _, err := app.Exec(`UPDATE event_queue SET status = 'pending', processed_at = NULL WHERE id <= 50`); err != nil {
		t.Fatal(err)
	}
	h.wake()
	waitAllSettled(t, app, 200, 20*time.Second)

	// One outage: the broker goes away, 30 rows arrive in one transaction,
	// the relay claims and fails them all, defers them, and waits.
	n.Stop()
	testenv.InsertN(t, app, 30, "DuringOutage")
	testenv.Eventually(t, 20*time.Second, "the outage", func() bool { return h.relay.Paused() != nil })
	testenv.Eventually(t, 20*time.Second, "30 deferred rows", func() bool {
		return scrape(t, h, `outbox_relay_deferred_total{reason="outage"}`) == 30
	})
	if got := scrape(t, h, "outbox_relay_broker_connected"); got != 0 {
		t.Errorf("broker_connected %v during the outage", got)
	}
	n.Restart()
	waitAllSettled(t, app, 230, 30*time.Second)

	// One dead letter.
	testenv.InsertN(t, app, 1, "bad type")
	waitAllSettled(t, app, 231, 20*time.Second)

	metricsReach(t, h, map[string]float64{
		"outbox_relay_published_total":                                                          280, // 200 + 50 again + 30 after the outage
		"outbox_relay_duplicates_total":                                                         50,
		`outbox_relay_dead_lettered_total{reason="invalid"}`:                                    1,
		"outbox_relay_retries_total":                                                            0,
		`outbox_relay_deferred_total{reason="outage"}`:                                          30,
		`outbox_relay_deferred_total{reason="shutdown"}`:                                        0,
		"outbox_relay_leases_reclaimed_total":                                                   0,
		"outbox_relay_broker_connected":                                                         1,
		"outbox_relay_delivery_lag_seconds_count":                                               280,
		"outbox_relay_publish_duration_seconds_count":                                           280,
		`outbox_relay_build_info{commit="test",goversion="` + goVersion() + `",version="test"}`: 1,
	})
	// The gauges follow the table within a stats interval.
	testenv.Eventually(t, 5*time.Second, "backlog gauges to settle", func() bool {
		return scrape(t, h, `outbox_relay_backlog_rows{status="pending"}`) == 0 &&
			scrape(t, h, `outbox_relay_backlog_rows{status="processing"}`) == 0 &&
			scrape(t, h, `outbox_relay_backlog_rows{status="dead_lettered"}`) == 1 &&
			scrape(t, h, "outbox_relay_oldest_pending_age_seconds") == 0
	})
	// And they show a backlog when there is one: stop the broker again.
	n.Stop()
	// A row the relay tries and defers shows it the outage; a row waiting
	// for an hour is then never claimed while the broker is down.
	if _, err := app.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES ('trigger', 'Late', 'x')`); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the relay to pause", func() bool { return h.relay.Paused() != nil })
	hourAgo := time.Now().Add(-time.Hour).UnixMilli()
	if _, err := app.Exec(`INSERT INTO event_queue (event_id, event_type, payload, created_at, available_at) VALUES ('old-one', 'Late', 'x', ?, ?)`, hourAgo, hourAgo); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "backlog gauges to show the waiting row", func() bool {
		return scrape(t, h, `outbox_relay_backlog_rows{status="pending"}`) == 2 &&
			scrape(t, h, "outbox_relay_oldest_pending_age_seconds") >= 3600
	})
}

func goVersion() string { return runtime.Version() }

// TestRetentionLoop: housekeeping prunes done rows past retention.done and
// counts them; younger rows and unfinished ones stay.
func TestRetentionLoop(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	insertOldRows(t, app)
	old := time.Now().Add(-2 * time.Hour).UnixMilli()
	if _, err := app.Exec(`INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at, last_error) VALUES ('dead', 'T', 'x', 'dead_lettered', ?1, ?1, 'kept')`, old); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{mutateKeeper: func(o *housekeeping.Options) {
		o.RetentionInterval, o.RetainDone, o.RetainProcessedEvents = 50*time.Millisecond, time.Hour, 0
	}})
	testenv.InsertN(t, app, 10, "Fresh")
	testenv.Eventually(t, 20*time.Second, "old rows pruned", func() bool {
		return scrape(t, h, `outbox_relay_pruned_rows_total{table="outbox"}`) == 1500
	})
	waitAllSettled(t, app, 11, 10*time.Second)
	if c := testenv.Counts(t, app); c["done"] != 10 || c["dead_lettered"] != 1 {
		t.Fatalf("after retention: %v", c)
	}
	var ledger int
	if err := app.QueryRow(`SELECT count(*) FROM processed_events`).Scan(&ledger); err != nil || ledger != 3 {
		t.Fatalf("retention.processed_events 0 must keep the ledger: %d rows (%v)", ledger, err)
	}
}

// TestRetentionKeepsWhatZeroKeeps: retention.done 0 keeps done rows
// forever while the ledger is pruned past its retention and counted.
func TestRetentionKeepsWhatZeroKeeps(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	old := insertOldRows(t, app)
	if _, err := app.Exec(`INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES ('new', 'h', 'done', ?1, ?1)`, time.Now().UnixMilli()); err != nil {
		t.Fatal(err)
	}
	h := startRelay(t, path, n.URL(), harnessOptions{mutateKeeper: func(o *housekeeping.Options) {
		o.RetentionInterval, o.RetainDone, o.RetainProcessedEvents = 50*time.Millisecond, 0, time.Hour
	}})
	testenv.Eventually(t, 20*time.Second, "old ledger rows pruned", func() bool {
		return scrape(t, h, `outbox_relay_pruned_rows_total{table="processed_events"}`) == 3
	})
	var ledger int
	if err := app.QueryRow(`SELECT count(*) FROM processed_events`).Scan(&ledger); err != nil || ledger != 1 {
		t.Fatalf("ledger after retention: %d rows (%v), want the new one", ledger, err)
	}
	if c := testenv.Counts(t, app); c["done"] != old {
		t.Fatalf("retention.done 0 pruned done rows: %v", c)
	}
	if v := scrape(t, h, `outbox_relay_pruned_rows_total{table="outbox"}`); v != 0 {
		t.Fatalf("outbox pruned %v rows with retention.done 0", v)
	}
}

// insertOldRows writes 1500 done rows and 3 ledger rows finished two hours
// ago, and returns how many done rows it wrote.
func insertOldRows(t *testing.T, app *sql.DB) int {
	t.Helper()
	old := time.Now().Add(-2 * time.Hour).UnixMilli()
	if _, err := app.Exec(`WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1500)
		INSERT INTO event_queue (event_id, event_type, payload, status, created_at, processed_at) SELECT 'old-' || i, 'T', 'x', 'done', ?1, ?1 FROM n`, old); err != nil {
		t.Fatal(err)
	}
	if _, err := app.Exec(`INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES ('a', 'h', 'done', ?1, ?1), ('b', 'h', 'done', ?1, ?1), ('c', 'h', 'failed', ?1, ?1)`, old); err != nil {
		t.Fatal(err)
	}
	return 1500
}
