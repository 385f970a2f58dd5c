// Package streamsync makes the JetStream stream and the optional durable
// consumer what the relay needs. Existing deployments keep their stream:
// the live configuration is cloned and only the managed fields are patched
// (stream: duplicate_window, allow_atomic; consumer: max_deliver,
// ack_wait); a rejected update is reported with the natscli command that
// would make it, and the relay keeps starting. A duplicate window shorter
// than the relay needs (the stream's max_age caps it) is reported with the
// choice it leaves, and the result says whether the stream allows atomic
// batch publish once the sync is done.
// The streamsync command prints a sync's result as a Summary.
package streamsync

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/natsname"
)

// Want is what the relay needs of the stream and consumer.
type Want struct {
	Stream          string
	Subjects        []string // when creating the stream
	DuplicateWindow time.Duration
	Replicas        int  // when creating the stream
	Create          bool // create the stream when missing
	SubjectPrefix   string
	// AllowAtomic: turn on the stream's allow_atomic (atomic batch
	// publish, nats-server 2.12+) when it is off. The relay never turns it
	// off, so false leaves the stream's value alone.
	AllowAtomic bool

	Durable        string // consumer name; empty: no consumer is managed
	MaxDeliver     int
	AckWait        time.Duration
	CreateConsumer bool
}

// Errors callers branch on.
var (
	// ErrNoStream: the stream is missing and may not be created.
	ErrNoStream = errors.New("stream does not exist")
	// ErrNotCaptured: the stream does not capture the relay's subjects.
	ErrNotCaptured = errors.New("relay subjects not captured")
	// ErrNoAck: the stream acknowledges no publish (no_ack), so no row
	// could be known stored.
	ErrNoAck = errors.New("the stream acknowledges no publish")
)

// Rejection is an update the server refused.
type Rejection struct {
	Part    string `json:"part"` // stream or consumer
	Error   string `json:"error"`
	Command string `json:"command"`        // what an operator would run instead
	Hint    string `json:"hint,omitempty"` // the choice besides the command
}

// Result reports what a sync found and did.
type Result struct {
	Stream          string      `json:"stream"`
	StreamCreated   bool        `json:"stream_created,omitempty"`   // (dry run: would be)
	Consumer        string      `json:"consumer,omitempty"`         //
	ConsumerMissing bool        `json:"consumer_missing,omitempty"` // absent and not created
	ConsumerCreated bool        `json:"consumer_created,omitempty"` // (dry run: would be)
	Changes         Changes     `json:"changes"`                    // the plan
	Applied         bool        `json:"applied"`                    // changes were written
	Rejected        []Rejection `json:"rejected,omitempty"`
	NotCaptured     string      `json:"not_captured,omitempty"` // why the relay's subjects are not captured
	// Window is the stream's duplicate window once the sync is done (dry
	// run: as it would be); nil when the stream is not there.
	Window *Window `json:"duplicate_window,omitempty"`
	// Atomic is whether the stream allows atomic batch publish once the
	// sync is done, as the server returned its configuration (dry run: as
	// it would be). The relay publishes in atomic batches only when it
	// does.
	Atomic bool `json:"allow_atomic"`
	// AtomicIgnored: allow_atomic was wanted and the server took the
	// stream's creation or update without keeping it, as a nats-server
	// older than 2.12, which does not know the field, does.
	AtomicIgnored bool `json:"allow_atomic_ignored,omitempty"`
}

// Options say how to sync.
type Options struct {
	DryRun  bool               // plan only: change nothing on the server
	Log     *zap.Logger        // changes are logged at warn level
	Patched func(field string) // called for every field changed (metrics)
}

// Sync creates a missing stream (if allowed) and consumer (if asked),
// patches the managed fields of existing ones, and checks that the stream
// captures the relay's subjects. A server that rejects an update is logged
// and reported in the result, not returned: the relay keeps starting. An
// error means the server could not be asked, or the stream is missing and
// may not be created (ErrNoStream) or cannot be, because another stream
// takes some of its subjects (ErrSubjectOverlap, naming that stream and
// what to change; a dry run finds it too).
func Sync(ctx context.Context, js jetstream.JetStream, want Want, o Options) (Result, error) {
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	if o.Patched == nil {
		o.Patched = func(string) {}
	}
	res := Result{Stream: want.Stream, Consumer: want.Durable}
	log := o.Log.With(zap.String("stream", want.Stream))

	var live Live
	stream, err := findStream(ctx, js, want, o.DryRun, log, &res)
	if err != nil {
		return res, err
	}
	if stream != nil && !res.StreamCreated {
		cfg := stream.CachedInfo().Config
		live.Stream = &cfg
		res.Atomic = cfg.AllowAtomicPublish
	}

	var consumer jetstream.Consumer
	if want.Durable != "" && stream != nil {
		consumer, err = stream.Consumer(ctx, want.Durable)
		switch {
		case errors.Is(err, jetstream.ErrConsumerNotFound):
		case err != nil:
			return res, fmt.Errorf("look up consumer %s/%s: %w", want.Stream, want.Durable, err)
		default:
			cfg := consumer.CachedInfo().Config
			live.Consumer = &cfg
		}
	}
	res.Changes = Plan(live, want)

	subjects := want.Subjects
	if live.Stream != nil {
		subjects = live.Stream.Subjects
	}
	if live.Stream != nil && !natsname.Covers(subjects, want.SubjectPrefix) {
		fix := captureFix(ctx, js, want, *live.Stream)
		res.NotCaptured = notCaptured(want, *live.Stream, fix).Error()
		log.Error("stream does not capture the relay's subjects; the relay stays not ready until it does",
			zap.Strings("subjects", subjects), zap.String("needs", want.SubjectPrefix+".>"), zap.String("fix", fix))
	}

	if want.Durable != "" && live.Consumer == nil {
		switch {
		case !want.CreateConsumer:
			res.ConsumerMissing = true
			log.Info("consumer not found; not managing it (set consumer.create to create it)", zap.String("consumer", want.Durable))
		case o.DryRun || stream == nil:
			res.ConsumerCreated = true
		default:
			_, err := stream.CreateConsumer(ctx, newConsumer(want, subjects))
			var apiErr *jetstream.APIError
			switch {
			case err == nil:
				res.ConsumerCreated = true
				log.Info("created consumer", zap.String("consumer", want.Durable), zap.Int("max_deliver", want.MaxDeliver), zap.Duration("ack_wait", want.AckWait))
			case errors.As(err, &apiErr):
				// Publishing does not need the consumer: say so and go on.
				command := ConsumerAddCommand(want, subjects)
				res.Rejected = append(res.Rejected, Rejection{Part: "consumer", Error: apiErr.Error(), Command: command})
				log.Warn("the server refused to create the consumer; starting anyway. Create it by hand with the command",
					zap.String("consumer", want.Durable), zap.String("reason", apiErr.Description), zap.Int("err_code", int(apiErr.ErrorCode)),
					zap.String("command", command))
			default:
				return res, fmt.Errorf("create consumer %s/%s: %w", want.Stream, want.Durable, err)
			}
		}
	}
	if stream != nil {
		// Created, in sync, or (dry run) as it would be once patched,
		// unless the server would refuse the patch.
		w := Window{Stream: want.Stream, Have: want.DuplicateWindow, Want: want.DuplicateWindow}
		if o.DryRun && live.Stream != nil {
			if lw := NewWindow(*live.Stream, want.DuplicateWindow); lw.capped() {
				w = lw
			}
			res.Atomic = res.Atomic || (want.AllowAtomic && refusesAtomic(*live.Stream) == "")
		}
		res.Window = &w
	}
	if o.DryRun || res.Changes.Empty() {
		return res, nil
	}
	return res, update(ctx, js, live, want, o, log, &res)
}

// findStream looks the stream up and creates it when it is missing (if
// allowed). It returns nil for a stream a dry run would create. A stream
// another relay created first is returned as found (res.StreamCreated
// false), to be reconciled like any other: that relay may want less.
func findStream(ctx context.Context, js jetstream.JetStream, want Want, dryRun bool, log *zap.Logger, res *Result) (jetstream.Stream, error) {
	stream, err := js.Stream(ctx, want.Stream)
	switch {
	case err == nil:
		return stream, nil
	case !errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, fmt.Errorf("look up stream %s: %w", want.Stream, err)
	case !want.Create:
		return nil, fmt.Errorf("%w: %s (stream.create is false; create it or set stream.create)", ErrNoStream, want.Stream)
	}
	res.StreamCreated = true
	if dryRun {
		if found, err := overlapping(ctx, js, want); err == nil && len(found) > 0 {
			return nil, overlapError(want, found, nil, nil)
		}
		res.Atomic = want.AllowAtomic
		return nil, nil
	}
	stream, created, err := create(ctx, js, want)
	if err != nil {
		return nil, err
	}
	if !created {
		res.StreamCreated = false
		return stream, nil
	}
	cfg := stream.CachedInfo().Config
	log.Info("created stream", zap.Strings("subjects", want.Subjects), zap.Duration("duplicate_window", want.DuplicateWindow),
		zap.Int("replicas", want.Replicas), zap.Bool("allow_atomic", cfg.AllowAtomicPublish))
	noteAtomic(cfg, want, log, res)
	return stream, nil
}

// update patches the stream and the consumer as res.Changes says.
func update(ctx context.Context, js jetstream.JetStream, live Live, want Want, o Options, log *zap.Logger, res *Result) error {
	if len(res.Changes.Stream) > 0 {
		if err := updateStream(ctx, js, *live.Stream, want, o, log, res); err != nil {
			return err
		}
	}
	if len(res.Changes.Consumer) > 0 {
		_, err := js.UpdateConsumer(ctx, want.Stream, patchConsumer(*live.Consumer, want))
		clog := log.With(zap.String("consumer", want.Durable))
		if done, err := report(err, clog, "consumer", res.Changes.Consumer, ConsumerEditCommand(want.Stream, want.Durable, res.Changes.Consumer), "", o.Patched, res); !done {
			return err
		}
	}
	res.Applied = len(res.Rejected) == 0
	return nil
}

// updateStream patches the stream in up to two updates: the duplicate
// window, then allow_atomic on top of what the first left. The server
// refuses an update whole, and it refuses allow_atomic on some streams
// (persist_mode async, mirrors): sent together, a refused allow_atomic
// would also cost the window that exactly-once depends on. Apart, each
// refusal is reported with its own field's command.
func updateStream(ctx context.Context, js jetstream.JetStream, live jetstream.StreamConfig, want Want, o Options, log *zap.Logger, res *Result) error {
	atomic, rest := splitChanges(res.Changes.Stream, FieldAllowAtomic)
	cfg := live
	if len(rest) > 0 {
		s, updateErr := js.UpdateStream(ctx, patchStream(live, want, rest))
		w, hint := NewWindow(live, want.DuplicateWindow), ""
		w.Limit = serverLimit(updateErr)
		if w.Short() {
			hint = w.Choice()
		}
		if done, err := report(updateErr, log, "stream", rest, w.Command(), hint, o.Patched, res); !done {
			return err
		}
		if updateErr != nil {
			res.Window = &w // refused: the stream keeps its window
		} else {
			cfg = s.CachedInfo().Config
		}
	}
	if len(atomic) > 0 {
		return updateAtomic(ctx, js, cfg, want, atomic, o, log, res)
	}
	return nil
}

// splitChanges separates the changes of field from the others.
func splitChanges(changes []Change, field string) (of, others []Change) {
	for _, c := range changes {
		if c.Field == field {
			of = append(of, c)
		} else {
			others = append(others, c)
		}
	}
	return of, others
}

// report logs the outcome of one update. It returns done=false with the
// error when the server could not be asked (the caller retries later).
// hint is what an operator can do besides the command.
func report(err error, log *zap.Logger, part string, changes []Change, command, hint string, patched func(string), res *Result) (done bool, _ error) {
	var apiErr *jetstream.APIError
	switch {
	case err == nil:
		for _, c := range changes {
			log.Warn("patched "+part+" config", zap.String("field", c.Field), zap.String("old", c.Old), zap.String("new", c.New))
			patched(c.Field)
		}
		return true, nil
	case errors.As(err, &apiErr):
		res.Rejected = append(res.Rejected, Rejection{Part: part, Error: apiErr.Error(), Command: command, Hint: hint})
		fields := make([]string, len(changes))
		for i, c := range changes {
			fields[i] = fmt.Sprintf("%s %s -> %s", c.Field, c.Old, c.New)
		}
		fieldsLog := []zap.Field{zap.String("wanted", strings.Join(fields, ", ")), zap.String("reason", apiErr.Description),
			zap.Int("err_code", int(apiErr.ErrorCode)), zap.String("command", command)}
		if hint != "" {
			fieldsLog = append(fieldsLog, zap.String("hint", hint))
		}
		log.Warn("the server rejected the "+part+" update the relay needs; starting anyway. Fix it by hand with the command", fieldsLog...)
		return true, nil
	}
	return false, fmt.Errorf("update %s: %w", part, err)
}

// create creates the stream the relay needs. created is false when
// another relay created it first; the stream returned is then that one.
func create(ctx context.Context, js jetstream.JetStream, want Want) (_ jetstream.Stream, created bool, _ error) {
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:               want.Stream,
		Subjects:           want.Subjects,
		Storage:            jetstream.FileStorage,
		Duplicates:         want.DuplicateWindow,
		Replicas:           want.Replicas,
		AllowAtomicPublish: want.AllowAtomic,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		s, err := js.Stream(ctx, want.Stream)
		return s, false, err
	}
	if apiErr := (*jetstream.APIError)(nil); errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeSubjectOverlap {
		found, listErr := overlapping(ctx, js, want)
		return nil, false, overlapError(want, found, listErr, apiErr)
	} else if apiErr != nil && apiErr.ErrorCode == errCodeInvalidConfig {
		return nil, false, createRefused(want, apiErr)
	}
	if err != nil {
		return nil, false, fmt.Errorf("create stream %s: %w", want.Stream, err)
	}
	return s, true, nil
}

// newConsumer is the durable pull consumer the relay creates when asked.
func newConsumer(want Want, subjects []string) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:        want.Durable,
		AckPolicy:      jetstream.AckExplicitPolicy,
		FilterSubjects: subjects,
		MaxDeliver:     want.MaxDeliver,
		AckWait:        want.AckWait,
	}
}

// Check reports why the stream cannot take the relay's messages, or nil:
// it must exist and capture every subject under the relay's prefix, or the
// relay would take every "no response" for an outage, and it must
// acknowledge publishes.
func Check(ctx context.Context, js jetstream.JetStream, want Want) error {
	_, err := Examine(ctx, js, want)
	return err
}

// Examine is Check that also returns the stream's duplicate window
// (when the stream could be read).
func Examine(ctx context.Context, js jetstream.JetStream, want Want) (Window, error) {
	s, err := js.Stream(ctx, want.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return Window{}, fmt.Errorf("%w: %s", ErrNoStream, want.Stream)
	}
	if err != nil {
		return Window{}, fmt.Errorf("look up stream %s: %w", want.Stream, err)
	}
	cfg := s.CachedInfo().Config
	w := NewWindow(cfg, want.DuplicateWindow)
	if !natsname.Covers(cfg.Subjects, want.SubjectPrefix) {
		return w, notCaptured(want, cfg, captureFix(ctx, js, want, cfg))
	}
	if cfg.NoAck {
		return w, fmt.Errorf("%w: stream %s has no_ack set, so the relay cannot know that a row is stored and publishes nothing; turn it off: nats stream edit %s --ack -f",
			ErrNoAck, want.Stream, shellQuote(want.Stream))
	}
	return w, nil
}

func notCaptured(want Want, cfg jetstream.StreamConfig, fix string) error {
	return fmt.Errorf("%w: stream %s (subjects %q) does not capture %s.>; %s",
		ErrNotCaptured, want.Stream, cfg.Subjects, want.SubjectPrefix, fix)
}

// captureFix says what makes stream cfg capture the relay's subjects:
// adding them, unless the stream is a mirror (which takes no subjects) or
// another stream takes them (a subject belongs to one stream only).
func captureFix(ctx context.Context, js jetstream.JetStream, want Want, cfg jetstream.StreamConfig) string {
	point := "point stream.name at a stream that captures " + want.SubjectPrefix + ".>"
	if cfg.Mirror != nil {
		return fmt.Sprintf("it mirrors %s and can take no subjects of its own: %s", cfg.Mirror.Name, point)
	}
	mine := want
	mine.Subjects = []string{want.SubjectPrefix + ".>"}
	if found, _ := overlapping(ctx, js, mine); len(found) > 0 {
		var parts []string
		for _, o := range found {
			parts = append(parts, fmt.Sprintf("stream %s takes %s", o.stream, strings.Join(o.taken, ",")))
		}
		return fmt.Sprintf("%s, and a subject belongs to one stream only: %s, or remove them from there and add them here (%s)",
			strings.Join(parts, "; "), point, captureCommand(want.Stream, cfg.Subjects, want.SubjectPrefix))
	}
	return "add it: " + captureCommand(want.Stream, cfg.Subjects, want.SubjectPrefix)
}

// captureCommand is the natscli command that adds the relay's subjects.
func captureCommand(stream string, subjects []string, prefix string) string {
	all := append(append([]string(nil), subjects...), prefix+".>")
	return fmt.Sprintf("nats stream edit %s --subjects %s -f", shellQuote(stream), shellQuote(strings.Join(all, ",")))
}
