package streamsync

import (
	"reflect"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestPlan(t *testing.T) {
	want := Want{Stream: "EVENTS", DuplicateWindow: time.Hour, Durable: "worker", MaxDeliver: 10, AckWait: 30 * time.Second}
	stream := func(dup, maxAge time.Duration) *jetstream.StreamConfig {
		return &jetstream.StreamConfig{Name: "EVENTS", Duplicates: dup, MaxAge: maxAge}
	}
	consumer := func(maxDeliver int, ackWait time.Duration, backoff ...time.Duration) *jetstream.ConsumerConfig {
		return &jetstream.ConsumerConfig{Durable: "worker", MaxDeliver: maxDeliver, AckWait: ackWait, BackOff: backoff}
	}
	for _, tc := range []struct {
		name string
		live Live
		want Want
		plan Changes
	}{
		{name: "nothing live", live: Live{}, want: want},
		{name: "in sync", live: Live{Stream: stream(time.Hour, 0), Consumer: consumer(10, 30*time.Second)}, want: want},
		{name: "server defaults read as set values", live: Live{Stream: stream(time.Hour, 0), Consumer: consumer(10, 0)}, want: want},
		{name: "unset window is the 2 min default", live: Live{Stream: stream(0, 0)}, want: want,
			plan: Changes{Stream: []Change{{"duplicate_window", "2m", "1h"}}}},
		{name: "unset window is max_age when shorter", live: Live{Stream: stream(0, 30*time.Second)}, want: want,
			plan: Changes{Stream: []Change{{"duplicate_window", "30s", "1h"}}}},
		{name: "explicit 2 min window", live: Live{Stream: stream(2*time.Minute, 72*time.Hour)}, want: want,
			plan: Changes{Stream: []Change{{"duplicate_window", "2m", "1h"}}}},
		{name: "unset max_deliver is unlimited (-1)", live: Live{Consumer: consumer(-1, 30*time.Second)}, want: want,
			plan: Changes{Consumer: []Change{{"max_deliver", "unlimited", "10"}}}},
		{name: "zero max_deliver is unlimited", live: Live{Consumer: consumer(0, 0)}, want: want,
			plan: Changes{Consumer: []Change{{"max_deliver", "unlimited", "10"}}}},
		{name: "both consumer fields", live: Live{Consumer: consumer(3, 90*time.Second)}, want: want,
			plan: Changes{Consumer: []Change{{"max_deliver", "3", "10"}, {"ack_wait", "1m30s", "30s"}}}},
		{name: "backoff owns the ack wait", live: Live{Consumer: consumer(10, 5*time.Second, 5*time.Second, 10*time.Second)}, want: want},
		{name: "no durable configured", live: Live{Consumer: consumer(3, 0)}, want: Want{DuplicateWindow: time.Hour}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Plan(tc.live, tc.want)
			if !reflect.DeepEqual(got.Stream, tc.plan.Stream) || !reflect.DeepEqual(got.Consumer, tc.plan.Consumer) {
				t.Fatalf("Plan = %+v, want %+v", got, tc.plan)
			}
			if got.Empty() != (len(tc.plan.Stream)+len(tc.plan.Consumer) == 0) {
				t.Fatal("Empty disagrees")
			}
		})
	}
}

func TestPatchKeepsEverythingElse(t *testing.T) {
	live := jetstream.StreamConfig{Name: "EVENTS", Description: "d", Subjects: []string{"a.>"}, MaxAge: time.Hour * 3, Duplicates: time.Minute, Metadata: map[string]string{"k": "v"}}
	got := patchStream(live, Want{DuplicateWindow: time.Hour})
	live.Duplicates = time.Hour
	if !reflect.DeepEqual(got, live) {
		t.Fatalf("patched %+v", got)
	}
	c := jetstream.ConsumerConfig{Durable: "w", Description: "d", MaxAckPending: 50, FilterSubject: "a.b", MaxDeliver: 3, AckWait: time.Second}
	gotC := patchConsumer(c, Want{MaxDeliver: 10, AckWait: 30 * time.Second})
	c.MaxDeliver, c.AckWait = 10, 30*time.Second
	if !reflect.DeepEqual(gotC, c) {
		t.Fatalf("patched %+v", gotC)
	}
}

func TestFmtDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{
		time.Hour: "1h", 2 * time.Minute: "2m", 30 * time.Second: "30s", 90 * time.Second: "1m30s",
		90 * time.Minute: "1h30m", 250 * time.Millisecond: "250ms", time.Hour + time.Second: "1h0m1s",
	} {
		if got := fmtDuration(d); got != want {
			t.Errorf("fmtDuration(%v) = %q, want %q", d, got, want)
		}
	}
}

// TestReplicasAndPlacementAreNeverPatched: stream.replicas applies only when
// the relay creates the stream; an existing stream keeps its replicas and
// placement whatever the relay is configured with.
func TestReplicasAndPlacementAreNeverPatched(t *testing.T) {
	live := jetstream.StreamConfig{Name: "EVENTS", Duplicates: time.Minute, Replicas: 1, Placement: &jetstream.Placement{Cluster: "east", Tags: []string{"ssd"}}}
	want := Want{Stream: "EVENTS", DuplicateWindow: time.Hour, Replicas: 3}
	plan := Plan(Live{Stream: &live}, want)
	if len(plan.Stream) != 1 || plan.Stream[0].Field != "duplicate_window" {
		t.Fatalf("plan %+v", plan)
	}
	got := patchStream(live, want)
	if got.Replicas != 1 || got.Placement == nil || got.Placement.Cluster != "east" || got.Placement.Tags[0] != "ssd" {
		t.Fatalf("patched %+v", got)
	}
}
