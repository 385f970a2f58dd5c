package relay_test

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestRowHeadersReachTheConsumer: a row's headers column becomes headers
// on its message, a W3C trace context unchanged, as a consumer receives
// it; a row that names a reserved header, or whose headers are not a JSON
// object of strings, is dead-lettered at once with the reason, and the
// rows around it flow.
func TestRowHeadersReachTheConsumer(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const tracestate = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
	traced := testenv.NewEvent("Traced", []byte("t"))
	traced.Headers = `{"traceparent": "` + traceparent + `", "tracestate": "` + tracestate + `", "X-Tenant": ["acme", "beta"]}`
	reserved := testenv.NewEvent("Reserved", []byte("r"))
	reserved.Headers = `{"Nats-Expected-Stream": "OTHER"}`
	malformed := testenv.NewEvent("Malformed", []byte("m"))
	malformed.Headers = `{"traceparent": 42}`
	if err := testenv.Insert(app, testenv.NewEvent("Before", []byte("b")), traced, reserved, malformed, testenv.NewEvent("After", []byte("a"))); err != nil {
		t.Fatal(err)
	}
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, 5, 20*time.Second)
	for id, why := range map[string]string{*reserved.EventID: `header name "Nats-Expected-Stream" is reserved`, *malformed.EventID: "traceparent: the value must be a string"} {
		var status, lastError string
		app.QueryRow(`SELECT status, coalesce(last_error, '') FROM event_queue WHERE event_id = ?`, id).Scan(&status, &lastError)
		if status != "dead_lettered" || !strings.Contains(lastError, why) {
			t.Errorf("row %s: %s, last_error %q; want dead_lettered saying %q", id, status, lastError, why)
		}
	}
	if c := testenv.Counts(t, app); c["done"] != 3 {
		t.Fatalf("counts %v; want the 3 other rows done", c)
	}

	h := testenv.ConsumeOne(t, n.JetStream(t), "EVENTS", "events.Traced").Headers()
	if h.Get("traceparent") != traceparent || h.Get("tracestate") != tracestate || strings.Join(h.Values("X-Tenant"), ",") != "acme,beta" {
		t.Errorf("the consumer got headers %v", h)
	}
	if h.Get(jetstream.MsgIDHeader) != *traced.EventID {
		t.Errorf("Nats-Msg-Id %q, want the row's event id", h.Get(jetstream.MsgIDHeader))
	}
}
