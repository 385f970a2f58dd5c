package streamsync_test

import (
	"bytes"
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// atomicWant is want with allow_atomic asked for.
func atomicWant() streamsync.Want {
	w := want
	w.AllowAtomic = true
	return w
}

// printed is what the streamsync command prints for a result.
func printed(res streamsync.Result, dryRun bool) string {
	var b bytes.Buffer
	streamsync.Summary{Result: res, DryRun: dryRun}.Print(&b)
	return b.String()
}

// TestSyncTurnsOnAllowAtomic: an operator's stream without allow_atomic
// gets it beside the window, every other field kept; both are logged and
// counted, the result says the stream allows atomic publish, and a second
// sync sends nothing.
func TestSyncTurnsOnAllowAtomic(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, operatorStream()); err != nil {
		t.Fatal(err)
	}
	before := streamConfig(t, js, "EVENTS")
	if before.AllowAtomicPublish {
		t.Fatal("the operator's stream allows atomic publish already")
	}
	dry, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{DryRun: true})
	if err != nil || !dry.Atomic || !strings.Contains(printed(dry, true), "  allow_atomic       false -> true\n") {
		t.Fatalf("dry run = %+v, %v\n%s", dry, err, printed(dry, true))
	}
	log, logs := observed()
	var patched []string
	res, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{Log: log, Patched: func(f string) { patched = append(patched, f) }})
	if err != nil || !res.Applied || len(res.Rejected) != 0 || !res.Atomic || res.AtomicIgnored {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	after := streamConfig(t, js, "EVENTS")
	before.Duplicates, before.AllowAtomicPublish = time.Hour, true
	// The server records the API level the stream now needs (2: 2.12).
	before.Metadata["_nats.req.level"] = "2"
	if asJSON(t, before) != asJSON(t, after) {
		t.Fatalf("fields other than the window and allow_atomic changed:\nbefore %s\nafter  %s", asJSON(t, before), asJSON(t, after))
	}
	if strings.Join(patched, ",") != "duplicate_window,allow_atomic" {
		t.Fatalf("patched callback %v", patched)
	}
	lines := logs.FilterMessage("patched stream config").All()
	if len(lines) != 2 || lines[1].ContextMap()["field"] != "allow_atomic" || lines[1].ContextMap()["old"] != "false" || lines[1].ContextMap()["new"] != "true" {
		t.Fatalf("patch log lines: %v", logs.All())
	}
	counting := &countingJS{JetStream: js}
	res, err = streamsync.Sync(ctx, counting, atomicWant(), streamsync.Options{})
	if err != nil || !res.Changes.Empty() || !res.Atomic || counting.streamUpdates.Load() != 0 {
		t.Fatalf("second Sync = %+v, %v; %d updates", res, err, counting.streamUpdates.Load())
	}
}

// TestCreatedStreamAllowsAtomic: a stream the relay creates has
// allow_atomic when it is wanted, and not otherwise.
func TestCreatedStreamAllowsAtomic(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	testenv.BystanderStream(t, js) // the account keeps a stream while EVENTS is deleted and created again
	if res, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{DryRun: true}); err != nil || !res.StreamCreated || !res.Atomic {
		t.Fatalf("dry run = %+v, %v", res, err)
	}
	res, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{})
	if err != nil || !res.StreamCreated || !res.Atomic || !streamConfig(t, js, "EVENTS").AllowAtomicPublish {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	if err := js.DeleteStream(ctx, "EVENTS"); err != nil {
		t.Fatal(err)
	}
	res, err = streamsync.Sync(ctx, js, want, streamsync.Options{})
	if err != nil || !res.StreamCreated || res.Atomic || streamConfig(t, js, "EVENTS").AllowAtomicPublish {
		t.Fatalf("Sync without allow_atomic = %+v, %v", res, err)
	}
}

// TestAllowAtomicNotWantedLeavesTheStream: with stream.allow_atomic false
// the relay neither sets allow_atomic nor clears an operator's.
func TestAllowAtomicNotWantedLeavesTheStream(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	testenv.BystanderStream(t, js) // the account keeps a stream while EVENTS is deleted and created again
	for _, allow := range []bool{false, true} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour, AllowAtomicPublish: allow}); err != nil {
			t.Fatal(err)
		}
		counting := &countingJS{JetStream: js}
		res, err := streamsync.Sync(ctx, counting, want, streamsync.Options{})
		if err != nil || !res.Changes.Empty() || res.Atomic != allow || counting.streamUpdates.Load() != 0 {
			t.Fatalf("stream with allow_atomic %v: Sync = %+v, %v; %d updates", allow, res, err, counting.streamUpdates.Load())
		}
		if got := streamConfig(t, js, "EVENTS").AllowAtomicPublish; got != allow {
			t.Fatalf("allow_atomic %v became %v", allow, got)
		}
		if err := js.DeleteStream(ctx, "EVENTS"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRefusedAllowAtomicKeepsTheWindow: nats-server refuses allow_atomic on
// a stream with persist_mode async (err_code 10052). The window, sent in an
// update of its own, is still patched; the refusal is a rejection with the
// natscli command and a hint that says why the command will not help, and
// the result says the stream does not allow atomic publish.
func TestRefusedAllowAtomicKeepsTheWindow(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, PersistMode: jetstream.AsyncPersistMode}); err != nil {
		t.Fatal(err)
	}
	dry, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{DryRun: true})
	if err != nil || dry.Atomic || len(dry.Changes.Stream) != 2 {
		t.Fatalf("dry run = %+v, %v", dry, err)
	}
	log, logs := observed()
	var patched []string
	res, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{Log: log, Patched: func(f string) { patched = append(patched, f) }})
	if err != nil {
		t.Fatalf("Sync returned %v; a refused allow_atomic must not stop startup", err)
	}
	const command = "nats stream edit EVENTS --allow-batch -f"
	if res.Applied || res.Atomic || res.AtomicIgnored || len(res.Rejected) != 1 || res.Rejected[0].Part != "stream" || res.Rejected[0].Command != command ||
		!strings.Contains(res.Rejected[0].Error, "async persist mode is not supported with atomic batch publish") ||
		!strings.Contains(res.Rejected[0].Hint, "persist_mode async") || !strings.Contains(res.Rejected[0].Hint, "set stream.allow_atomic to false") {
		t.Fatalf("result %+v", res)
	}
	cfg := streamConfig(t, js, "EVENTS")
	if cfg.Duplicates != time.Hour || cfg.AllowAtomicPublish || cfg.PersistMode != jetstream.AsyncPersistMode {
		t.Fatalf("stream after sync: window %v, allow_atomic %v, persist mode %v", cfg.Duplicates, cfg.AllowAtomicPublish, cfg.PersistMode)
	}
	if res.Window == nil || res.Window.Have != time.Hour || res.Window.Short() {
		t.Fatalf("window in the result %+v", res.Window)
	}
	if strings.Join(patched, ",") != "duplicate_window" {
		t.Fatalf("patched callback %v", patched)
	}
	warns := logs.FilterLevelExact(zapcore.WarnLevel)
	refused := warns.FilterMessageSnippet("the server rejected the stream update").All()
	if warns.Len() != 2 || warns.FilterMessage("patched stream config").Len() != 1 || len(refused) != 1 ||
		refused[0].ContextMap()["command"] != command || refused[0].ContextMap()["wanted"] != "allow_atomic false -> true" {
		t.Fatalf("warnings %v", warns.All())
	}
	if out := printed(res, false); !strings.Contains(out, "fix it by hand: "+command+"\n") {
		t.Fatalf("printed:\n%s", out)
	}
}

// TestMirrorRefusesAllowAtomic: nats-server refuses allow_atomic on a
// mirror (err_code 10198); the refusal is reported, not returned.
func TestMirrorRefusesAllowAtomic(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORIGIN", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Mirror: &jetstream.StreamSource{Name: "ORIGIN"}, Duplicates: time.Hour}); err != nil {
		t.Fatal(err)
	}
	res, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{})
	if err != nil || res.Atomic || len(res.Rejected) != 1 || !strings.Contains(res.Rejected[0].Error, "10198") ||
		!strings.Contains(res.Rejected[0].Hint, "mirror") {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
}

// oldServerJS passes stream configurations on without allow_atomic, as a
// nats-server older than 2.12 reads them: it does not know the field, takes
// the request and returns the configuration without it.
type oldServerJS struct{ jetstream.JetStream }

func (o oldServerJS) CreateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	cfg.AllowAtomicPublish = false
	return o.JetStream.CreateStream(ctx, cfg)
}

func (o oldServerJS) UpdateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	cfg.AllowAtomicPublish = false
	return o.JetStream.UpdateStream(ctx, cfg)
}

// TestOldServerIgnoresAllowAtomic: a server that takes allow_atomic and
// reads it back false is no rejection; the result says the stream does not
// allow atomic publish, one warning says why, and nothing counts it as
// patched.
func TestOldServerIgnoresAllowAtomic(t *testing.T) {
	ctx := context.Background()
	js := oldServerJS{testenv.StartNATS(t).JetStream(t)}
	log, logs := observed()
	res, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{Log: log})
	if err != nil || !res.StreamCreated || res.Atomic || !res.AtomicIgnored {
		t.Fatalf("creating Sync = %+v, %v", res, err)
	}
	if n := logs.FilterMessageSnippet("the server ignored allow_atomic").Len(); n != 1 {
		t.Fatalf("%d ignored warnings: %v", n, logs.All())
	}
	log, logs = observed()
	var patched []string
	res, err = streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{Log: log, Patched: func(f string) { patched = append(patched, f) }})
	if err != nil || len(res.Rejected) != 0 || res.Atomic || !res.AtomicIgnored || len(patched) != 0 {
		t.Fatalf("updating Sync = %+v, %v; patched %v", res, err, patched)
	}
	warns := logs.FilterLevelExact(zapcore.WarnLevel).All()
	if len(warns) != 1 || !strings.Contains(warns[0].Message, "nats-server older than 2.12") || !strings.Contains(warns[0].Message, "one row at a time") {
		t.Fatalf("warnings %v", warns)
	}
	if out := printed(res, false); !strings.Contains(out, "warning: the server ignored allow_atomic (nats-server older than 2.12)") {
		t.Fatalf("printed:\n%s", out)
	}
}

// TestRefusedWindowKeepsAllowAtomic: the other way round, a window the
// server refuses (longer than max_age) does not cost allow_atomic.
func TestRefusedWindowKeepsAllowAtomic(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, MaxAge: 30 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	res, err := streamsync.Sync(ctx, js, atomicWant(), streamsync.Options{})
	if err != nil || !res.Atomic || len(res.Rejected) != 1 || res.Rejected[0].Command != "nats stream edit EVENTS --max-age 1h --dupe-window 1h -f" {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	if cfg := streamConfig(t, js, "EVENTS"); cfg.Duplicates != 2*time.Minute || !cfg.AllowAtomicPublish {
		t.Fatalf("stream after sync: window %v, allow_atomic %v", cfg.Duplicates, cfg.AllowAtomicPublish)
	}
}

// lateJS answers the first stream lookup with "not found", as a relay sees
// it when another relay creates the stream just after the lookup.
type lateJS struct {
	jetstream.JetStream
	looked atomic.Bool
}

func (l *lateJS) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	if !l.looked.Swap(true) {
		return nil, jetstream.ErrStreamNotFound
	}
	return l.JetStream.Stream(ctx, name)
}

// TestStreamCreatedFirstByAnotherRelay: a stream another relay created
// first without allow_atomic (one configured with stream.allow_atomic
// false, or older) is reconciled like any existing stream, not taken for a
// server that ignored the field.
func TestStreamCreatedFirstByAnotherRelay(t *testing.T) {
	ctx := context.Background()
	js := testenv.StartNATS(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Storage: jetstream.FileStorage, Duplicates: time.Hour}); err != nil {
		t.Fatal(err)
	}
	log, logs := observed()
	res, err := streamsync.Sync(ctx, &lateJS{JetStream: js}, atomicWant(), streamsync.Options{Log: log})
	if err != nil || res.StreamCreated || !res.Applied || !res.Atomic || res.AtomicIgnored || len(res.Changes.Stream) != 1 {
		t.Fatalf("Sync = %+v, %v", res, err)
	}
	if n := logs.FilterMessageSnippet("ignored allow_atomic").Len(); n != 0 || !streamConfig(t, js, "EVENTS").AllowAtomicPublish {
		t.Fatalf("%d ignored warnings; log %v", n, logs.All())
	}
}

// TestCreationIsAChange: a stream the sync creates, or would create, is
// a change in what the command prints, never "in sync".
func TestCreationIsAChange(t *testing.T) {
	js := testenv.StartNATS(t).JetStream(t)
	ctx := context.Background()
	for _, dryRun := range []bool{true, false} {
		res, err := streamsync.Sync(ctx, js, want, streamsync.Options{DryRun: dryRun})
		if err != nil {
			t.Fatal(err)
		}
		wantLines := []string{"stream EVENTS: missing; would be created\n", "dry run: 1 change(s) planned"}
		if !dryRun {
			wantLines = []string{"stream EVENTS: created\n", "applied 1 change(s)"}
		}
		out := printed(res, dryRun)
		for _, l := range wantLines {
			if !strings.Contains(out, l) {
				t.Errorf("dry run %v printed %q, want %q in it", dryRun, out, l)
			}
		}
	}
}
