package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestRowHeadersNATSClientsWouldMisreadAreDeadLettered: a row whose
// headers nats.go would take for a protocol status (Status, any case, with
// an empty payload), or that JSON decoding would change (a BLOB's bytes, a
// lone surrogate, a name twice), is dead-lettered at once with the reason;
// an ordered consumer on nats.go gets every other row, in order, and does
// not stall.
func TestRowHeadersNATSClientsWouldMisreadAreDeadLettered(t *testing.T) {
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
