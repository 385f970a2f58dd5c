package ledger_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/ledger"
)

// TestWorkerRefusesAConsumerWithoutExplicitAcks: with ack_policy all, the
// Ack of a later event acknowledges an earlier one whose handler failed
// and was Nak'ed, and with none nothing comes back: a failed event would
// never be handled. NewWorker refuses such a consumer, naming its policy.
func TestWorkerRefusesAConsumerWithoutExplicitAcks(t *testing.T) {
	_, js := stream(t)
	h := handlersWith(t, appDB(t), ledger.Options{}, nil)
	for _, policy := range []jetstream.AckPolicy{jetstream.AckAllPolicy, jetstream.AckNonePolicy} {
		cfg := jetstream.ConsumerConfig{Durable: "workers_" + strings.ToLower(policy.String()), AckPolicy: policy, MaxDeliver: -1}
		if policy == jetstream.AckAllPolicy {
			cfg.AckWait = 2 * time.Second
		}
		cons, err := js.CreateOrUpdateConsumer(context.Background(), "EVENTS", cfg)
		if err != nil {
			t.Fatal(err)
		}
		_, err = ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events"})
		if err == nil || !strings.Contains(err.Error(), policy.String()) || !strings.Contains(err.Error(), "ack_policy explicit") {
			t.Errorf("NewWorker on a consumer with %s: %v; want a refusal naming the policy and ack_policy explicit", policy, err)
		}
	}
}
