package daemon_test

import (
	"context"
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
	t.Parallel()
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

// TestRowHeadersNATSClientsWouldMisreadAreDeadLettered: a row whose
// headers nats.go would take for a protocol status (Status, any case, with
// an empty payload), or that JSON decoding would change (a BLOB's bytes, a
// lone surrogate, a name twice), is dead-lettered at once with the reason;
// an ordered consumer on nats.go gets every other row, in order, and does
// not stall.
func TestRowHeadersNATSClientsWouldMisreadAreDeadLettered(t *testing.T) {
	t.Parallel()
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	bad := map[string]struct{ headers, why string }{
		"Status":    {`{"Status": "408"}`, `header name "Status" is reserved: nats.go takes a message with a Status header for a protocol status message`},
		"status":    {`{"status": "503"}`, `header name "status" is reserved`},
		"Surrogate": {`{"tenant": "a\ud800"}`, `headers: tenant: the value holds \ud800`},
		"Twice":     {`{"Trace": "a", "trace": "b"}`, `header names "Trace" and "trace" differ only in case`},
		"Blob":      {"", `headers: tenant: the value is not valid UTF-8 text (a BLOB?)`},
	}
	evs := []testenv.Event{testenv.NewEvent("Before", []byte("b"))}
	ids := map[string]string{}
	for name, b := range bad {
		e := testenv.NewEvent("Bad", []byte{}) // an empty payload, as a status message has
		e.Headers = b.headers
		ids[name] = *e.EventID
		evs = append(evs, e)
	}
	evs = append(evs, testenv.NewEvent("After", []byte("a")))
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, app, `UPDATE event_queue SET headers = ? WHERE event_id = ?`, []byte("{\"tenant\": \"ac\xffme\"}"), ids["Blob"])
	startRelay(t, path, n.URL(), harnessOptions{})
	waitAllSettled(t, app, len(evs), 20*time.Second)
	for name, b := range bad {
		var status, lastError string
		app.QueryRow(`SELECT status, coalesce(last_error, '') FROM event_queue WHERE event_id = ?`, ids[name]).Scan(&status, &lastError)
		if status != "dead_lettered" || !strings.Contains(lastError, b.why) {
			t.Errorf("row %s: %s, last_error %q; want dead_lettered saying %q", name, status, lastError, b.why)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	oc, err := n.JetStream(t).OrderedConsumer(ctx, "EVENTS", jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for len(got) < 2 {
		m, err := oc.Next(jetstream.FetchMaxWait(10 * time.Second))
		if err != nil {
			t.Fatalf("ordered consumer after %v: %v", got, err)
		}
		got = append(got, m.Subject())
	}
	if strings.Join(got, " ") != "events.Before events.After" {
		t.Fatalf("an ordered consumer got %v; want the two good rows in order", got)
	}
}
