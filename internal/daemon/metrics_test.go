package daemon_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

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
