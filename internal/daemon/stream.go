package daemon

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// streamInterval is how often a running relay rereads the stream, so that
// the duplicate window it reports follows an operator's edit.
const streamInterval = time.Minute

// streamState is what the daemon learned of the stream between probes.
type streamState struct {
	mu sync.Mutex
	// configErr keeps the stream from being created (a subject overlap,
	// a configuration the server refuses): no retry heals it until an
	// operator changes a stream, the server or the configuration.
	configErr error
	window    *streamsync.Window // as last read
}

// Want is what the configuration asks of the stream and the consumer.
func Want(cfg config.Config) streamsync.Want {
	s, c := cfg.Stream, cfg.Consumer
	return streamsync.Want{
		Stream: s.Name, Subjects: s.Subjects, DuplicateWindow: s.DuplicateWindow,
		Replicas: s.Replicas, Create: s.Create, SubjectPrefix: s.SubjectPrefix, AllowAtomic: s.AllowAtomic,
		Durable: c.Durable, MaxDeliver: cfg.Relay.MaxAttempts, AckWait: c.AckWait, CreateConsumer: c.Create,
	}
}

func (a *App) want() streamsync.Want { return Want(a.cfg) }

// streamSync is whether the stream and consumer were reconciled in this
// process, and whether the stream allows atomic publish as that found. A
// fleet's files share one: the first file's relay to reach the broker
// reconciles them, a file opened later (woken from idle, say: a hundred
// at once after a quiet hour) only checks that the stream is there, and
// the next reconciliation is the one a relay makes when it finds the
// stream gone. A relay alone on its file has one of its own.
type streamSync struct {
	mu      sync.Mutex
	done    bool
	atomics bool
	// limit is the longest duplicate window the server allows, when the
	// reconciliation's refused update said so (0: not known): the
	// window's advice follows it (streamsync.Window.Limit).
	limit time.Duration
	// first is held by the relay making the first reconciliation: a
	// fleet's first files start together, and the others wait for it
	// rather than each reconciling (and each saying it created the
	// stream).
	first chan struct{}
}

func newStreamSync() *streamSync { return &streamSync{first: make(chan struct{}, 1)} }

// lockFirst waits until no other relay is making the first
// reconciliation, and holds off the others until unlockFirst; false if
// ctx ended first.
func (s *streamSync) lockFirst(ctx context.Context) bool {
	select {
	case s.first <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

// unlockFirst lets the next relay waiting in lockFirst go.
func (s *streamSync) unlockFirst() { <-s.first }

// get returns whether a reconciliation was made, and what it found of
// atomic publish.
func (s *streamSync) get() (done, atomics bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done, s.atomics
}

// set records a reconciliation and what it found of atomic publish.
func (s *streamSync) set(res streamsync.Result) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done, s.atomics, s.limit = true, res.Atomic, 0
	if res.Window != nil {
		s.limit = res.Window.Limit
	}
}

// windowLimit is the server's limit on duplicate windows, as the latest
// reconciliation learned it (0: not known).
func (s *streamSync) windowLimit() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limit
}

// brokerReady is the relay's outage probe: the broker is connected and, in
// JetStream mode, the stream exists and captures the relay's subjects. The
// first time the broker answers, the stream and consumer are reconciled,
// unless another file's relay in the fleet has done so (streamSync); one
// doing so is waited for.
func (a *App) brokerReady(ctx context.Context) error {
	if err := a.pub.Ready(ctx); err != nil {
		return err
	}
	if a.js == nil {
		return nil
	}
	err := streamsync.ErrNoStream
	shared, atomics := a.sync.get()
	if !a.synced.Load() && !shared {
		if !a.sync.lockFirst(ctx) {
			return fmt.Errorf("waiting for another file's relay to reconcile the stream: %w", ctx.Err())
		}
		defer a.sync.unlockFirst()
		shared, atomics = a.sync.get() // made while this relay waited?
	}
	if a.synced.Load() || shared {
		err = a.examineStream(ctx)
	}
	if err == nil && !a.synced.Swap(true) {
		// Reconciled by another file's relay, and there.
		a.noteAtomic(atomics)
	}
	if errors.Is(err, streamsync.ErrNoStream) {
		// First answer since start, or the stream was deleted meanwhile:
		// reconcile (and create it, if allowed).
		again := a.synced.Load()
		var res streamsync.Result
		res, err = streamsync.Sync(ctx, a.js.API(), a.want(), a.syncOptions())
		a.noteConfigError(err)
		if err != nil {
			return err
		}
		a.synced.Store(true)
		a.sync.set(res)
		if again {
			// The sequences the relay knew are the old stream's.
			a.relay.ReconcileAgain()
		}
		a.noteAtomic(res.Atomic)
		err = a.examineStream(ctx)
	}
	return err
}

func (a *App) syncOptions() streamsync.Options {
	return streamsync.Options{
		Log:     a.log.Named("streamsync"),
		Patched: func(field string) { a.metrics.StreamConfigPatched.WithLabelValues(field).Inc() },
	}
}

// noteConfigError keeps the configuration error a sync returned, logged
// once, or forgets it once a sync succeeds. Other errors (the broker
// went away) say nothing about it.
func (a *App) noteConfigError(err error) {
	a.stream.mu.Lock()
	defer a.stream.mu.Unlock()
	prev := a.stream.configErr
	switch {
	case errors.Is(err, streamsync.ErrSubjectOverlap), errors.Is(err, streamsync.ErrCreateRefused):
		if prev == nil || prev.Error() != err.Error() {
			a.log.Error("the stream cannot be created: a configuration error, fixed only by changing the configuration the error names; "+
				"the relay stays not ready until then", zap.String("stream", a.cfg.Stream.Name), zap.Error(err))
		}
		a.stream.configErr = err
	case err == nil && prev != nil:
		a.log.Info("the stream's configuration error is fixed", zap.String("stream", a.cfg.Stream.Name))
		a.stream.configErr = nil
	}
}

// streamConfigError is the configuration error that keeps the stream from
// being created, if any.
func (a *App) streamConfigError() error {
	a.stream.mu.Lock()
	defer a.stream.mu.Unlock()
	return a.stream.configErr
}

// examineStream is streamsync.Check that also records the stream's
// duplicate window.
func (a *App) examineStream(ctx context.Context) error {
	w, err := streamsync.Examine(ctx, a.js.API(), a.want())
	w.Limit = a.sync.windowLimit()
	if w.Stream != "" {
		a.noteWindow(w)
	}
	return err
}

// noteWindow records the stream's duplicate window on the gauge and for
// /readyz, and logs when it becomes shorter than the relay needs, or
// long enough again.
func (a *App) noteWindow(w streamsync.Window) {
	a.metrics.StreamDuplicateWindow.Set(w.Have.Seconds())
	a.stream.mu.Lock()
	prev := a.stream.window
	a.stream.window = &w
	a.stream.mu.Unlock()
	switch {
	case w.Short() && (prev == nil || !prev.Short() || prev.Have != w.Have):
		a.log.Warn("the stream's duplicate window is shorter than stream.duplicate_window; publishing with it",
			zap.String("stream", w.Stream), zap.Duration("duplicate_window", w.Have), zap.Duration("wanted", w.Want), zap.String("choice", w.Choice()))
	case !w.Short() && prev != nil && prev.Short():
		a.log.Info("the stream's duplicate window is what the relay needs again", zap.String("stream", w.Stream), zap.Duration("duplicate_window", w.Have))
	}
}

// windowWarning is what /readyz adds to its "ok" while the window is
// short.
func (a *App) windowWarning() string {
	a.stream.mu.Lock()
	defer a.stream.mu.Unlock()
	if a.stream.window == nil {
		return ""
	}
	return a.stream.window.Warning()
}

// role is what a passing /readyz says: the relay's role, and a warning
// while the duplicate window is short (ready, but JetStream drops a
// re-published event only within that window).
func (a *App) role() string {
	r := a.relay.Role()
	if w := a.windowWarning(); w != "" {
		r += "; warning: " + w
	}
	if a.js != nil {
		if err := a.js.BatchesOff(); err != nil {
			r += "; warning: " + err.Error()
		}
	}
	return r
}

// watchStream rereads the stream every streamInterval until ctx ends, so
// that the window reported follows an operator's edit.
func (a *App) watchStream(ctx context.Context) {
	t := time.NewTicker(streamInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		a.examineStream(rctx) // an error is the probe's and /readyz's to report
		cancel()
		// The stream's answers may have lowered the batch limit, or
		// turned batches off.
		a.metrics.AtomicBatchLimit.Set(float64(a.js.BatchLimit()))
	}
}

// noteAtomic turns the publisher's atomic batches on when the stream
// allows them after a sync and stream.allow_atomic asks for them, off
// otherwise, and says which at the first sync and at every change.
func (a *App) noteAtomic(allowed bool) {
	on := allowed && a.cfg.Stream.AllowAtomic
	if a.atomicSaid.Swap(true) && on == (a.js.BatchLimit() > 0) {
		return
	}
	log := a.log.With(zap.String("stream", a.cfg.Stream.Name))
	switch {
	case on:
		a.js.EnableBatches(a.cfg.Ordering.BatchMax)
		log.Info("atomic batches on: an ordering key's due rows go as one batch, all or none", zap.Int("limit", a.js.BatchLimit()))
	case !a.cfg.Stream.AllowAtomic:
		a.js.EnableBatches(0)
		log.Info("atomic batches off (stream.allow_atomic is false): an ordering key's rows go one at a time, and rows of atomic groups are held, pending")
	default:
		a.js.EnableBatches(0)
		log.Warn("atomic batches off: the stream does not allow atomic publish (nats-server older than 2.12, or a stream that refuses it); " +
			"an ordering key's rows go one at a time, and rows of atomic groups are held, pending")
	}
	a.metrics.AtomicBatchLimit.Set(float64(a.js.BatchLimit()))
}
