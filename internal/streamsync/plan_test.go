package streamsync

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestPlan(t *testing.T) {
	want := Want{Stream: "EVENTS", DuplicateWindow: time.Hour, Durable: "worker", MaxDeliver: 10, AckWait: 30 * time.Second}
	stream := func(dup, maxAge time.Duration) *jetstream.StreamConfig {
		return &jetstream.StreamConfig{Name: "EVENTS", Duplicates: dup, MaxAge: maxAge}
	}
	atomicStream := func(dup time.Duration, allow bool) *jetstream.StreamConfig {
		return &jetstream.StreamConfig{Name: "EVENTS", Duplicates: dup, AllowAtomicPublish: allow}
	}
	atomic := want
	atomic.AllowAtomic = true
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
		{name: "allow_atomic off is turned on", live: Live{Stream: atomicStream(time.Hour, false)}, want: atomic,
			plan: Changes{Stream: []Change{{"allow_atomic", "false", "true"}}}},
		{name: "allow_atomic already on", live: Live{Stream: atomicStream(time.Hour, true)}, want: atomic},
		{name: "an operator's allow_atomic is kept", live: Live{Stream: atomicStream(time.Hour, true)}, want: want},
		{name: "window and allow_atomic", live: Live{Stream: atomicStream(0, false)}, want: atomic,
			plan: Changes{Stream: []Change{{"duplicate_window", "2m", "1h"}, {"allow_atomic", "false", "true"}}}},
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
	want := Want{DuplicateWindow: time.Hour, AllowAtomic: true}
	got := patchStream(live, want, Plan(Live{Stream: &live}, want).Stream)
	live.Duplicates, live.AllowAtomicPublish = time.Hour, true
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
	got := patchStream(live, want, plan.Stream)
	if got.Replicas != 1 || got.Placement == nil || got.Placement.Cluster != "east" || got.Placement.Tags[0] != "ssd" {
		t.Fatalf("patched %+v", got)
	}
}

// TestPatchSetsOnlyTheChangesGiven: a sync sends allow_atomic in an update
// of its own, which must not carry a window the server refused, and the
// window in one that must not carry allow_atomic.
func TestPatchSetsOnlyTheChangesGiven(t *testing.T) {
	live := jetstream.StreamConfig{Name: "EVENTS", Duplicates: 2 * time.Minute}
	want := Want{DuplicateWindow: time.Hour, AllowAtomic: true}
	plan := Plan(Live{Stream: &live}, want).Stream
	atomic, rest := splitChanges(plan, FieldAllowAtomic)
	if len(atomic) != 1 || len(rest) != 1 || rest[0].Field != FieldDuplicateWindow {
		t.Fatalf("split %+v into %+v and %+v", plan, atomic, rest)
	}
	if got := patchStream(live, want, atomic); got.Duplicates != 2*time.Minute || !got.AllowAtomicPublish {
		t.Fatalf("allow_atomic alone patched %+v", got)
	}
	if got := patchStream(live, want, rest); got.Duplicates != time.Hour || got.AllowAtomicPublish {
		t.Fatalf("window alone patched %+v", got)
	}
}

// TestStreamEditCommand: natscli v0.5.0 spells allow_atomic --allow-batch
// (cli/stream_command.go: "Allow atomic batch publishing"); --allow-fast is
// allow_batched, another mode.
func TestStreamEditCommand(t *testing.T) {
	for _, tc := range []struct {
		changes []Change
		want    string
	}{
		{[]Change{{Field: FieldDuplicateWindow, New: "1h"}}, "nats stream edit EVENTS --dupe-window 1h -f"},
		{[]Change{{Field: FieldAllowAtomic, Old: "false", New: "true"}}, "nats stream edit EVENTS --allow-batch -f"},
		{[]Change{{Field: FieldDuplicateWindow, New: "1h"}, {Field: FieldAllowAtomic, New: "true"}}, "nats stream edit EVENTS --dupe-window 1h --allow-batch -f"},
	} {
		if got := StreamEditCommand("EVENTS", tc.changes); got != tc.want {
			t.Errorf("StreamEditCommand(%+v) = %q, want %q", tc.changes, got, tc.want)
		}
	}
}

// TestAtomicIgnored: a server older than 2.12 takes allow_atomic and reads
// it back false; only then, and only when the relay asked for it, is it
// ignored.
func TestAtomicIgnored(t *testing.T) {
	for _, tc := range []struct {
		wanted, returned, ignored bool
	}{{true, false, true}, {true, true, false}, {false, false, false}, {false, true, false}} {
		if got := atomicIgnored(Want{AllowAtomic: tc.wanted}, jetstream.StreamConfig{AllowAtomicPublish: tc.returned}); got != tc.ignored {
			t.Errorf("wanted %v, returned %v: ignored %v", tc.wanted, tc.returned, got)
		}
	}
}

// TestRefusesAtomic: nats-server refuses allow_atomic beside persist_mode
// async and on a mirror; the hint says so and how to stop asking.
func TestRefusesAtomic(t *testing.T) {
	if got := refusesAtomic(jetstream.StreamConfig{Name: "EVENTS"}); got != "" {
		t.Fatalf("plain stream: %q", got)
	}
	for _, cfg := range []jetstream.StreamConfig{
		{Name: "EVENTS", PersistMode: jetstream.AsyncPersistMode},
		{Name: "EVENTS", Mirror: &jetstream.StreamSource{Name: "ORIGIN"}},
	} {
		if got := refusesAtomic(cfg); got == "" || !strings.Contains(got, "set stream.allow_atomic to false") {
			t.Errorf("%+v: %q", cfg, got)
		}
	}
}
