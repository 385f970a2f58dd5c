package streamsync_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestEnsureCreatesMissingStream(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	want := streamsync.Want{Stream: "EVENTS", Subjects: []string{"events.>", "extra.>"}, DuplicateWindow: time.Hour, Replicas: 1, Create: true, SubjectPrefix: "events"}
	created, err := streamsync.Ensure(ctx, js, want)
	if err != nil || !created {
		t.Fatalf("Ensure = %v, %v", created, err)
	}
	s, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	if cfg.Duplicates != time.Hour || strings.Join(cfg.Subjects, ",") != "events.>,extra.>" || cfg.Storage != jetstream.FileStorage {
		t.Fatalf("created stream config %+v", cfg)
	}
	if err := streamsync.Check(ctx, js, want); err != nil {
		t.Fatal(err)
	}
	created, err = streamsync.Ensure(ctx, js, want)
	if err != nil || created {
		t.Fatalf("second Ensure = %v, %v", created, err)
	}
}

func TestEnsureWithoutCreate(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	want := streamsync.Want{Stream: "EVENTS", Subjects: []string{"events.>"}, DuplicateWindow: time.Hour, Replicas: 1, SubjectPrefix: "events"}
	_, err := streamsync.Ensure(ctx, js, want)
	if !errors.Is(err, streamsync.ErrNoStream) || !strings.Contains(err.Error(), "stream.create") {
		t.Fatalf("Ensure without create = %v", err)
	}
	if _, err := js.Stream(ctx, "EVENTS"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatal("stream created although stream.create is false")
	}
}

func TestCheckNamesUncapturedSubject(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	err := streamsync.Check(ctx, js, streamsync.Want{Stream: "EVENTS", SubjectPrefix: "events"})
	if !errors.Is(err, streamsync.ErrNotCaptured) || !strings.Contains(err.Error(), "events.>") || !strings.Contains(err.Error(), "nats stream edit EVENTS") {
		t.Fatalf("Check = %v", err)
	}
}
