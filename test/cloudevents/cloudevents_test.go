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
// type, and the payload as its data.
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
	created := time.Date(2026, 11, 30, 12, 34, 56, 789e6, time.UTC)
	if err := testenv.Insert(app, ev); err != nil {
		t.Fatal(err)
	}
	testenv.MustExec(t, app, `UPDATE event_queue SET created_at = ?`, created.UnixMilli())
	// A row may not set the attributes the relay sets.
	forged := testenv.NewEvent("ReviewLogged", []byte(`{}`))
	forged.Headers = `{"ce-id": "not-the-event-id"}`
	if err := testenv.Insert(app, forged); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "one row done, one dead-lettered", func() bool {
		c := testenv.Counts(t, app)
		return c["done"] == 1 && c["dead_lettered"] == 1
	})
	var lastError string
	app.QueryRow(`SELECT last_error FROM event_queue WHERE event_id = ?`, *forged.EventID).Scan(&lastError)
	if !strings.Contains(lastError, `header name "ce-id" is reserved`) {
		t.Fatalf("the forged row's last_error %q", lastError)
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
	if err := e.Validate(); err != nil {
		t.Fatalf("not a valid CloudEvent: %v", err)
	}
}
