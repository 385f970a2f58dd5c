package streamsync_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

var want = streamsync.Want{
	Stream: "EVENTS", Subjects: []string{"events.>"}, DuplicateWindow: time.Hour, Replicas: 1, Create: true,
	SubjectPrefix: "events", MaxDeliver: 10, AckWait: 30 * time.Second,
}

// countingJS counts the update calls that reach the server.
type countingJS struct {
	jetstream.JetStream
	streamUpdates, consumerUpdates atomic.Int32
}

func (c *countingJS) UpdateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	c.streamUpdates.Add(1)
	return c.JetStream.UpdateStream(ctx, cfg)
}

func (c *countingJS) UpdateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	c.consumerUpdates.Add(1)
	return c.JetStream.UpdateConsumer(ctx, stream, cfg)
}

func observed() (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.DebugLevel)
	return zap.New(core), logs
}

func streamConfig(t *testing.T, js jetstream.JetStream, name string) jetstream.StreamConfig {
	t.Helper()
	s, err := js.Stream(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return s.CachedInfo().Config
}

func asJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestSyncCreatesMissingStream(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	w := want
	w.Subjects = []string{"events.>", "extra.>"}
	res, err := streamsync.Sync(ctx, js, w, streamsync.Options{})
	if err != nil || !res.StreamCreated {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	cfg := streamConfig(t, js, "EVENTS")
	if cfg.Duplicates != time.Hour || strings.Join(cfg.Subjects, ",") != "events.>,extra.>" || cfg.Storage != jetstream.FileStorage || cfg.Replicas != 1 {
		t.Fatalf("created stream config %+v", cfg)
	}
	if err := streamsync.Check(ctx, js, w); err != nil {
		t.Fatal(err)
	}
	res, err = streamsync.Sync(ctx, js, w, streamsync.Options{})
	if err != nil || res.StreamCreated || !res.Changes.Empty() {
		t.Fatalf("second Sync = %+v, %v", res, err)
	}
}

func TestSyncWithoutCreate(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	w := want
	w.Create = false
	_, err := streamsync.Sync(ctx, js, w, streamsync.Options{})
	if !errors.Is(err, streamsync.ErrNoStream) || !strings.Contains(err.Error(), "stream.create") {
		t.Fatalf("Sync without create = %v", err)
	}
	if _, err := js.Stream(ctx, "EVENTS"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatal("stream created although stream.create is false")
	}
}

// operatorStream is a stream an operator configured by hand, with the
// server's 2 min default dedup window.
func operatorStream() jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:              "EVENTS",
		Description:       "the operator's events",
		Subjects:          []string{"events.>", "audit.>"},
		Retention:         jetstream.LimitsPolicy,
		MaxConsumers:      20,
		MaxMsgs:           5_000_000,
		MaxBytes:          2 << 30,
		Discard:           jetstream.DiscardOld,
		MaxAge:            72 * time.Hour,
		MaxMsgsPerSubject: 1_000_000,
		MaxMsgSize:        512 << 10,
		Storage:           jetstream.FileStorage,
		Replicas:          1,
		NoAck:             false,
		AllowRollup:       true,
		DenyDelete:        true,
		AllowDirect:       true,
		Compression:       jetstream.S2Compression,
		Metadata:          map[string]string{"owner": "team-reviews", "tier": "gold"},
	}
}

// TestSyncPatchesOnlyDuplicateWindow: a stream created beforehand with a
// dozen operator-set fields keeps every one of them; only the window moves.
func TestSyncPatchesOnlyDuplicateWindow(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, operatorStream()); err != nil {
		t.Fatal(err)
	}
	before := streamConfig(t, js, "EVENTS")
	if before.Duplicates != 2*time.Minute {
		t.Fatalf("server default window %v", before.Duplicates)
	}
	log, logs := observed()
	var patched []string
	res, err := streamsync.Sync(ctx, js, want, streamsync.Options{Log: log, Patched: func(f string) { patched = append(patched, f) }})
	if err != nil || !res.Applied || len(res.Rejected) != 0 {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	after := streamConfig(t, js, "EVENTS")
	if after.Duplicates != time.Hour {
		t.Fatalf("window after sync %v", after.Duplicates)
	}
	before.Duplicates = time.Hour
	if asJSON(t, before) != asJSON(t, after) {
		t.Fatalf("fields other than the window changed:\nbefore %s\nafter  %s", asJSON(t, before), asJSON(t, after))
	}
	warns := logs.FilterMessage("patched stream config").All()
	if len(warns) != 1 || warns[0].Level != zapcore.WarnLevel {
		t.Fatalf("patch log lines: %v", logs.All())
	}
	if f := warns[0].ContextMap(); f["field"] != "duplicate_window" || f["old"] != "2m" || f["new"] != "1h" {
		t.Fatalf("patch log fields %v", f)
	}
	if strings.Join(patched, ",") != "duplicate_window" {
		t.Fatalf("patched callback %v", patched)
	}
}

// TestSyncPatchesConsumer: a consumer created beforehand keeps its
// description, max_ack_pending and filter; max_deliver and ack_wait follow
// the relay.
func TestSyncPatchesConsumer(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "worker", Description: "the application's worker", MaxDeliver: 3, MaxAckPending: 50,
		FilterSubject: "events.review.>", AckPolicy: jetstream.AckExplicitPolicy, Metadata: map[string]string{"team": "reviews"},
	})
	if err != nil {
		t.Fatal(err)
	}
	before := c.CachedInfo().Config
	if before.AckWait != 30*time.Second || before.MaxDeliver != 3 {
		t.Fatalf("server defaults: %+v", before)
	}
	w := want
	w.Durable, w.AckWait = "worker", 45*time.Second
	log, logs := observed()
	res, err := streamsync.Sync(ctx, js, w, streamsync.Options{Log: log})
	if err != nil || !res.Applied || len(res.Changes.Consumer) != 2 || len(res.Changes.Stream) != 0 {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	c, err = s.Consumer(ctx, "worker")
	if err != nil {
		t.Fatal(err)
	}
	after := c.CachedInfo().Config
	if after.MaxDeliver != 10 || after.AckWait != 45*time.Second {
		t.Fatalf("consumer after sync: max_deliver %d ack_wait %v", after.MaxDeliver, after.AckWait)
	}
	before.MaxDeliver, before.AckWait = 10, 45*time.Second
	if asJSON(t, before) != asJSON(t, after) {
		t.Fatalf("other consumer fields changed:\nbefore %s\nafter  %s", asJSON(t, before), asJSON(t, after))
	}
	if n := logs.FilterMessage("patched consumer config").Len(); n != 2 {
		t.Fatalf("%d consumer patch lines", n)
	}
}

// TestSecondSyncIsQuiet: once in sync, a restart plans nothing, logs no
// warning and sends no update.
func TestSecondSyncIsQuiet(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, operatorStream()); err != nil {
		t.Fatal(err)
	}
	s, _ := js.Stream(ctx, "EVENTS")
	if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "worker", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	w := want
	w.Durable = "worker"
	if res, err := streamsync.Sync(ctx, js, w, streamsync.Options{}); err != nil || !res.Applied {
		t.Fatalf("first Sync = %+v, %v", res, err)
	}
	counting := &countingJS{JetStream: js}
	log, logs := observed()
	res, err := streamsync.Sync(ctx, counting, w, streamsync.Options{Log: log})
	if err != nil || !res.Changes.Empty() {
		t.Fatalf("second Sync = %+v, %v", res, err)
	}
	if n := counting.streamUpdates.Load() + counting.consumerUpdates.Load(); n != 0 {
		t.Fatalf("second sync sent %d updates", n)
	}
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 0 {
		t.Fatalf("second sync logged %d warnings: %v", n, logs.All())
	}
}

// TestRejectedUpdateKeepsStarting: a 1 h window is refused on a stream whose
// max_age is 30 min; the warning carries the natscli command that the server
// accepts (max_age raised with the window) and the other choice (a window
// of at most max_age, and what it costs), the result and Examine report the
// 2 min window the stream keeps, and Sync still succeeds.
func TestRejectedUpdateKeepsStarting(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, MaxAge: 30 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	log, logs := observed()
	res, err := streamsync.Sync(ctx, js, want, streamsync.Options{Log: log})
	if err != nil {
		t.Fatalf("Sync returned %v; a rejected update must not stop startup", err)
	}
	const command = "nats stream edit EVENTS --max-age 1h --dupe-window 1h -f"
	if res.Applied || len(res.Rejected) != 1 || res.Rejected[0].Command != command ||
		!strings.Contains(res.Rejected[0].Hint, "set stream.duplicate_window to at most 30m; JetStream then drops a re-published event only within that window") {
		t.Fatalf("result %+v", res)
	}
	if w := res.Window; w == nil || w.Have != 2*time.Minute || !w.Short() || !strings.Contains(w.Warning(), "stream EVENTS dedups within 2m, not the 1h") {
		t.Fatalf("window in the result: %+v", res.Window)
	}
	lines := logs.FilterMessageSnippet("the server rejected the stream update").All()
	if len(lines) != 1 || lines[0].ContextMap()["command"] != command ||
		!strings.Contains(lines[0].ContextMap()["reason"].(string), "duplicates window") ||
		!strings.Contains(fmt.Sprint(lines[0].ContextMap()["hint"]), "raise max_age to at least 1h") {
		t.Fatalf("warning lines %v", logs.All())
	}
	if got := streamConfig(t, js, "EVENTS").Duplicates; got != 2*time.Minute {
		t.Fatalf("window changed to %v", got)
	}
	w, err := streamsync.Examine(ctx, js, want)
	if err != nil || w.Have != 2*time.Minute || w.Want != time.Hour || !w.Short() {
		t.Fatalf("Examine = %+v, %v", w, err)
	}
	// The command given is one the server takes: after it, the relay's
	// window is in place and a sync has nothing left to do.
	s, _ := js.Stream(ctx, "EVENTS")
	cfg := s.CachedInfo().Config
	cfg.MaxAge, cfg.Duplicates = time.Hour, time.Hour
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatalf("what the command does is refused: %v", err)
	}
	if w, err := streamsync.Examine(ctx, js, want); err != nil || w.Short() || w.Warning() != "" {
		t.Fatalf("Examine after the fix = %+v, %v", w, err)
	}
}

// TestWindowRefusedUnderTheServersLimit: a server that allows no window
// longer than 30 min refuses 1 h on a stream of the default 2 min: the
// command given is the longest window the server takes, and the choice
// names the server's limit.
func TestWindowRefusedUnderTheServersLimit(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t, func(o *server.Options) { o.JetStreamLimits.Duplicates = 30 * time.Minute }).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	res, err := streamsync.Sync(ctx, js, want, streamsync.Options{})
	if err != nil || len(res.Rejected) != 1 {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	const command = "nats stream edit EVENTS --dupe-window 30m -f"
	if r := res.Rejected[0]; r.Command != command || !strings.Contains(r.Hint, "the server allows no window longer than 30m") ||
		!strings.Contains(r.Hint, "set stream.duplicate_window to at most 30m;") {
		t.Fatalf("rejection %+v", r)
	}
	s, _ := js.Stream(ctx, "EVENTS")
	cfg := s.CachedInfo().Config
	cfg.Duplicates = 30 * time.Minute
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatalf("what the command does is refused: %v", err)
	}
}

// TestShortWindowAccepted: stream.duplicate_window at most max_age is
// applied, and the window is not short then.
func TestShortWindowAccepted(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, MaxAge: 30 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	w := want
	w.DuplicateWindow = 30 * time.Minute
	res, err := streamsync.Sync(ctx, js, w, streamsync.Options{})
	if err != nil || !res.Applied || res.Window == nil || res.Window.Short() {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	if got := streamConfig(t, js, "EVENTS").Duplicates; got != 30*time.Minute {
		t.Fatalf("window %v, want 30m", got)
	}
}

// TestSubjectOverlapNamesTheStream: a stream that cannot be created because
// another stream takes some of its subjects (err_code 10065) is a
// configuration error naming that stream, its subjects and what to
// change; the dry run says the same.
func TestSubjectOverlapNamesTheStream(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	for _, c := range []jetstream.StreamConfig{
		{Name: "ORDERS", Subjects: []string{"orders.>", "events.orders.*"}},
		{Name: "AUDIT", Subjects: []string{"audit.>"}},
	} {
		if _, err := js.CreateStream(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	for _, dry := range []bool{false, true} {
		_, err := streamsync.Sync(ctx, js, want, streamsync.Options{DryRun: dry})
		if !errors.Is(err, streamsync.ErrSubjectOverlap) || !strings.Contains(err.Error(), "stream ORDERS takes events.orders.*") ||
			!strings.Contains(err.Error(), "nats stream edit ORDERS --subjects 'orders.>' -f") || strings.Contains(err.Error(), "AUDIT") ||
			!strings.Contains(err.Error(), "stream.subject_prefix") {
			t.Fatalf("Sync (dry run %v) = %v", dry, err)
		}
		if !dry && !strings.Contains(err.Error(), "10065") {
			t.Fatalf("Sync = %v; want the server's err_code", err)
		}
	}
	if _, err := js.Stream(ctx, "EVENTS"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("EVENTS exists: %v", err)
	}
	// A stream that already captures the relay's prefix may be the one
	// its events belong in.
	if err := js.DeleteStream(ctx, "ORDERS"); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ALL", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	_, err := streamsync.Sync(ctx, js, want, streamsync.Options{})
	if !errors.Is(err, streamsync.ErrSubjectOverlap) || !strings.Contains(err.Error(), "set stream.name: ALL") || strings.Contains(err.Error(), "nats stream edit ALL") {
		t.Fatalf("Sync beside a stream on events.> = %v", err)
	}
}

// TestRejectedConsumerUpdateCommand: the consumer command names both flags.
func TestRejectedConsumerUpdateCommand(t *testing.T) {
	got := streamsync.ConsumerEditCommand("EVENTS", "worker", []streamsync.Change{{Field: "max_deliver", New: "10"}, {Field: "ack_wait", New: "30s"}})
	if got != "nats consumer edit EVENTS worker --max-deliver 10 --wait 30s -f" {
		t.Fatal(got)
	}
}

// TestDryRunChangesNothing: the plan of a drifted stream lists the fields
// and the server keeps its config.
func TestDryRunChangesNothing(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, operatorStream()); err != nil {
		t.Fatal(err)
	}
	s, _ := js.Stream(ctx, "EVENTS")
	if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "worker", MaxDeliver: 3, AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	before := asJSON(t, streamConfig(t, js, "EVENTS"))
	counting := &countingJS{JetStream: js}
	w := want
	w.Durable = "worker"
	res, err := streamsync.Sync(ctx, counting, w, streamsync.Options{DryRun: true})
	if err != nil || res.Applied {
		t.Fatalf("dry run = %+v, %v", res, err)
	}
	if got := res.Changes.String(); got != "stream duplicate_window: 2m -> 1h\nconsumer max_deliver: 3 -> 10" {
		t.Fatalf("plan text %q", got)
	}
	if counting.streamUpdates.Load()+counting.consumerUpdates.Load() != 0 || asJSON(t, streamConfig(t, js, "EVENTS")) != before {
		t.Fatal("dry run changed the server")
	}
}

func TestConsumerAbsent(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	w := want
	w.Durable = "worker"
	res, err := streamsync.Sync(ctx, js, w, streamsync.Options{})
	if err != nil || !res.ConsumerMissing || res.ConsumerCreated {
		t.Fatalf("Sync without consumer.create = %+v, %v", res, err)
	}
	if _, err := js.Consumer(ctx, "EVENTS", "worker"); !errors.Is(err, jetstream.ErrConsumerNotFound) {
		t.Fatalf("consumer created without consumer.create: %v", err)
	}
	w.CreateConsumer = true
	res, err = streamsync.Sync(ctx, js, w, streamsync.Options{})
	if err != nil || !res.ConsumerCreated {
		t.Fatalf("Sync with consumer.create = %+v, %v", res, err)
	}
	c, err := js.Consumer(ctx, "EVENTS", "worker")
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.CachedInfo().Config
	if cfg.Durable != "worker" || cfg.AckPolicy != jetstream.AckExplicitPolicy || cfg.MaxDeliver != 10 || cfg.AckWait != 30*time.Second ||
		strings.Join(append(cfg.FilterSubjects, cfg.FilterSubject), ",") != "events.>," {
		t.Fatalf("created consumer %+v", cfg)
	}
}

// TestRefusedConsumerCreationKeepsStarting: publishing does not need the
// consumer, so a server that refuses to create it (here: the stream allows
// one consumer and has one) is a warning with the command, not a stop.
func TestRefusedConsumerCreationKeepsStarting(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour, MaxConsumers: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "other", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	w := want
	w.Durable, w.CreateConsumer = "worker", true
	log, logs := observed()
	res, err := streamsync.Sync(ctx, js, w, streamsync.Options{Log: log})
	if err != nil {
		t.Fatalf("Sync = %v; a refused consumer must not stop startup", err)
	}
	if len(res.Rejected) != 1 || res.Rejected[0].Command != "nats consumer add EVENTS worker --pull --ack explicit --deliver all --max-deliver 10 --wait 30s --filter 'events.>' --defaults" {
		t.Fatalf("result %+v", res)
	}
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
		t.Fatalf("%d warnings: %v", n, logs.All())
	}
}

func TestCheckNamesUncapturedSubject(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	err := streamsync.Check(ctx, js, want)
	if !errors.Is(err, streamsync.ErrNotCaptured) || !strings.Contains(err.Error(), "events.>") ||
		!strings.Contains(err.Error(), "nats stream edit EVENTS --subjects 'orders.>,events.>' -f") {
		t.Fatalf("Check = %v", err)
	}
	log, logs := observed()
	res, err := streamsync.Sync(ctx, js, want, streamsync.Options{Log: log})
	if err != nil || res.NotCaptured == "" {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	if l := logs.FilterLevelExact(zapcore.ErrorLevel).All(); len(l) != 1 || l[0].ContextMap()["needs"] != "events.>" {
		t.Fatalf("error lines %v", logs.All())
	}
}

// TestUncapturedSubjectsThatCannotBeAdded: a stream that cannot take the
// relay's subjects, because another stream has them or because it is a
// mirror, is not told to add them (the server would refuse): Check and
// Sync say which stream has them, or that it is a mirror, and to point
// stream.name at a stream that captures them.
func TestUncapturedSubjectsThatCannotBeAdded(t *testing.T) {
	for _, tc := range []struct {
		name   string
		events jetstream.StreamConfig
		says   string
	}{
		{"another stream has them", jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"foo.>"}}, "stream SRC takes events.>, and a subject belongs to one stream only: point stream.name at a stream that captures events.>"},
		{"a mirror", jetstream.StreamConfig{Name: "EVENTS", Mirror: &jetstream.StreamSource{Name: "SRC"}}, "it mirrors SRC and can take no subjects of its own: point stream.name at a stream that captures events.>"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			js := testenv.StartNATS(t).JetStream(t)
			for _, c := range []jetstream.StreamConfig{{Name: "SRC", Subjects: []string{"events.>"}}, tc.events} {
				if _, err := js.CreateStream(ctx, c); err != nil {
					t.Fatal(err)
				}
			}
			if err := streamsync.Check(ctx, js, want); !errors.Is(err, streamsync.ErrNotCaptured) || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("Check = %v, want it to say %q", err, tc.says)
			}
			if res, err := streamsync.Sync(ctx, js, want, streamsync.Options{DryRun: true}); err != nil || !strings.Contains(res.NotCaptured, tc.says) {
				t.Fatalf("Sync = %+v, %v", res, err)
			}
		})
	}
}
