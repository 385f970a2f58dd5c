// Package streamsync makes the JetStream stream (and consumer) what the
// relay needs: it creates a missing stream and reconciles an existing one.
package streamsync

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Want is what the relay needs of the stream.
type Want struct {
	Stream          string
	Subjects        []string
	DuplicateWindow time.Duration
	Replicas        int
	Create          bool
	SubjectPrefix   string // the relay publishes on SubjectPrefix.<event_type>
}

// ErrNoStream is returned by Ensure when the stream is missing and may not
// be created.
var ErrNoStream = errors.New("stream does not exist")

// Ensure creates the stream when it is missing and want.Create is set. It
// reports whether it created it.
func Ensure(ctx context.Context, js jetstream.JetStream, want Want) (created bool, err error) {
	_, err = js.Stream(ctx, want.Stream)
	if err == nil {
		return false, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, fmt.Errorf("look up stream %s: %w", want.Stream, err)
	}
	if !want.Create {
		return false, fmt.Errorf("%w: %s (stream.create is false; create it or set stream.create)", ErrNoStream, want.Stream)
	}
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name:       want.Stream,
		Subjects:   want.Subjects,
		Storage:    jetstream.FileStorage,
		Duplicates: want.DuplicateWindow,
		Replicas:   want.Replicas,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return false, nil // another relay created it first
	}
	if err != nil {
		return false, fmt.Errorf("create stream %s: %w", want.Stream, err)
	}
	return true, nil
}

// Check reports why the stream cannot take the relay's messages, or nil:
// it must exist and capture every subject under the relay's prefix, or the
// relay would take every "no response" for an outage.
func Check(ctx context.Context, js jetstream.JetStream, want Want) error {
	s, err := js.Stream(ctx, want.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("%w: %s", ErrNoStream, want.Stream)
	}
	if err != nil {
		return fmt.Errorf("look up stream %s: %w", want.Stream, err)
	}
	subjects := s.CachedInfo().Config.Subjects
	if !event.Covers(subjects, want.SubjectPrefix) {
		return fmt.Errorf("%w: stream %s (subjects %q) does not capture %s.>; add it: nats stream edit %s --subjects %s -f",
			ErrNotCaptured, want.Stream, subjects, want.SubjectPrefix, want.Stream, strings.Join(append(subjects, want.SubjectPrefix+".>"), ","))
	}
	return nil
}

// ErrNotCaptured is returned by Check when the stream does not capture the
// relay's subjects.
var ErrNotCaptured = errors.New("relay subjects not captured")
