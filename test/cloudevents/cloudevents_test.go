// Package cloudevents checks the relay's CloudEvents format with the
// CloudEvents SDK for Go, as a consumer would read the messages. It is a
// module of its own so that the SDK stays out of the relay's go.mod.
package cloudevents

import (
	"context"
	"strings"
	"testing"
	"time"

	cejs "github.com/cloudevents/sdk-go/protocol/nats_jetstream/v2"
	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestSDKReadsTheRelaysMessages: with message.format cloudevents, the SDK
// decodes a consumed message into an event with the row's event id, its
// event type, the configured source, created_at as its time, the content
// type, the row's own ce- headers as attributes and extensions, and the
// payload as its data.
func TestSDKReadsTheRelaysMessages(t *testing.T) {
	n := testenv.StartNATS(t)
	cfg := config.Default()
	cfg.Database.Path = testenv.NewDB(t)
	cfg.NATS.URL = n.URL()
	cfg.Metrics.Listen = ""
	cfg.Message.Format, cfg.Message.Source, cfg.Message.ContentType = config.FormatCloudEvents, "/reviews", "application/json"
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a, err := daemon.Open(ctx, cfg, zaptest.NewLogger(t), daemon.Options{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; a.Close() })

	app := testenv.AppDB(t, cfg.Database.Path)
	ev := testenv.NewEvent("ReviewLogged", []byte(`{"movie":"Heat","stars":5}`))
	ev.Headers = `{"ce-traceid": "abc", "ce-dataschema": "https://example.com/review.json"}`
	created := time.Date(2026, 11, 30, 12, 34, 56, 789e6, time.UTC)
	if err := testenv.Insert(app, ev); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, app, `UPDATE event_queue SET created_at = ?`, created.UnixMilli())
	// A row may not set the attributes the relay sets, nor ce- headers
	// the SDK would refuse to read or read at random: dead-lettered, why.
	refused := map[string]string{
		`{"ce-id": "not-the-event-id"}`:         `header name "ce-id" is reserved`,
		`{"ce-datacontenttype": "text/plain"}`:  `header name "ce-datacontenttype" is reserved`,
		`{"ce-trace-id": "abc"}`:                `header name "ce-trace-id" is not a CloudEvents attribute`,
		`{"ce-": "x"}`:                          `header name "ce-" is not a CloudEvents attribute`,
		`{"ce-dataschema": "::not a uri"}`:      `value "::not a uri" is not an absolute URI`,
		`{"ce-DataSchema": "schemas/relative"}`: `value "schemas/relative" is not an absolute URI`,
	}
	ids := map[string]string{}
	for headers := range refused {
		forged := testenv.NewEvent("ReviewLogged", []byte(`{}`))
		forged.Headers = headers
		if err := testenv.Insert(app, forged); err != nil {
			t.Fatal(err)
		}
		ids[headers] = *forged.EventID
	}
	testenv.Eventually(t, 30*time.Second, "one row done, the others dead-lettered", func() bool {
		c := testenv.Counts(t, app)
		return c["done"] == 1 && c["dead_lettered"] == len(refused)
	})
	for headers, why := range refused {
		var lastError string
		app.QueryRow(`SELECT last_error FROM event_queue WHERE event_id = ?`, ids[headers]).Scan(&lastError)
		if !strings.Contains(lastError, why) {
			t.Errorf("the row with headers %s: last_error %q, want it to say %q", headers, lastError, why)
		}
	}

	m := testenv.ConsumeOne(t, n.JetStream(t), "EVENTS", "")
	msg := &nats.Msg{Subject: m.Subject(), Data: m.Data(), Header: m.Headers()}
	e, err := binding.ToEvent(context.Background(), cejs.NewMessage(msg))
	if err != nil {
		t.Fatalf("the SDK cannot read the message: %v (headers %v)", err, m.Headers())
	}
	if e.ID() != *ev.EventID || e.Type() != "ReviewLogged" || e.Source() != "/reviews" || !e.Time().Equal(created) ||
		e.SpecVersion() != "1.0" || e.DataContentType() != "application/json" || string(e.Data()) != `{"movie":"Heat","stars":5}` {
		t.Fatalf("event %s", e)
	}
	if ext := e.Extensions()["traceid"]; ext != "abc" || e.DataSchema() != "https://example.com/review.json" {
		t.Fatalf("the row's ce- headers: extension traceid %v, dataschema %q", ext, e.DataSchema())
	}
	if err := e.Validate(); err != nil {
		t.Fatalf("not a valid CloudEvent: %v", err)
	}
}
