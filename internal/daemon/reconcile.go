package daemon

// Reconciling the outbox with the stream when the relay begins to lead:
// its log lines, metrics and what /readyz says meanwhile.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/internal/relay"
)

// reconcileLogEvery is how often a long reconciliation logs its progress.
const reconcileLogEvery = 5 * time.Second

// reconciliation is the progress of the running reconciliation, for
// /readyz.
type reconciliation struct {
	mu      sync.Mutex
	running bool
	p       reconcile.Progress
}

// reconcile is the relay's Options.Reconcile: it settles the rows whose
// messages the stream holds already, logging a line when it starts reading,
// its progress every reconcileLogEvery and a line when it ends.
func (a *App) reconcile(ctx context.Context) (relay.Reconciled, error) {
	log := a.log.Named("reconcile").With(zap.String("stream", a.cfg.Stream.Name))
	var said, lastLog time.Time
	var done reconcile.Progress // what earlier batches of this run counted
	progress := func(p reconcile.Progress) {
		a.recon.mu.Lock()
		a.recon.running, a.recon.p = true, p
		a.recon.mu.Unlock()
		a.remaining.Set(float64(p.Remaining()))
		a.metrics.Reconciled.Add(float64(p.Settled - done.Settled))
		a.metrics.ReconcileOrphans.Add(float64(p.Orphans - done.Orphans))
		a.metrics.ReusedEventIDs.Add(float64(p.Reused - done.Reused))
		a.metrics.DeadLettered.WithLabelValues(event.DeadLetterReusedID).Add(float64(p.Reused - done.Reused))
		done = p
		switch {
		case !p.Scans():
		case said.IsZero():
			said, lastLog = time.Now(), time.Now()
			log.Info("reconciling the outbox with the stream before publishing: reading the stream's messages that may be this outbox's, to settle the rows published already",
				zap.Uint64("from_seq", p.From), zap.Uint64("to_seq", p.To), zap.Uint64("sequences", p.Remaining()))
		case time.Since(lastLog) >= reconcileLogEvery:
			lastLog = time.Now()
			log.Info("reconciling", zap.Uint64("next_seq", p.Next), zap.Uint64("remaining", p.Remaining()),
				zap.Int("read", p.Read), zap.Int("settled", p.Settled))
		}
	}
	defer func() {
		a.recon.mu.Lock()
		a.recon.running = false
		a.recon.mu.Unlock()
		a.remaining.Set(0)
	}()
	p, err := reconcile.Run(ctx, reconcile.Options{
		DB: a.db, Store: a.store, JS: a.js.API(), Stream: a.cfg.Stream.Name,
		Subjects: a.readFilter, Origin: a.origin, Progress: progress,
	})
	var unreadable *reconcile.Unreadable
	if errors.As(err, &unreadable) {
		// Waiting will not make the server take the consumer: publish as
		// before, leaning on the duplicate window alone.
		if a.unreadableSaid.CompareAndSwap(false, true) {
			log.Warn("cannot reconcile the outbox with the stream: the server refuses the consumer that reads it (a work-queue stream, one at its max_consumers, say); "+
				"publishing without it, so JetStream drops a re-published event only within its duplicate window", zap.Error(err))
		}
		return relay.Reconciled{Last: p.To, RowsBefore: p.RowsBefore}, nil
	}
	if err != nil {
		if p.Scans() {
			log.Warn("reconciliation stopped; it goes on from where it stopped when it runs again", zap.Uint64("next_seq", p.Next), zap.Error(err))
		}
		return relay.Reconciled{}, err
	}
	if p.Orphans > 0 {
		log.Warn("messages of this outbox in the stream whose rows are not in the file: rows written after the point in time of a restored backup, say; not re-created",
			zap.Int("messages", p.Orphans), zap.String("first", p.Orphan))
	}
	// At info level after a scan, whose start was logged; at debug level
	// when there was nothing to read (a fleet leads many files).
	level := zapcore.DebugLevel
	if p.Scans() {
		level = zapcore.InfoLevel
	}
	log.Log(level, "reconciled the outbox with the stream; publishing", zap.Int("read", p.Read), zap.Int("settled", p.Settled),
		zap.Int("reused_event_ids", p.Reused), zap.Int("orphans", p.Orphans), zap.Duration("took", time.Since(p.Started).Round(time.Millisecond)))
	return relay.Reconciled{Last: p.To, RowsBefore: p.RowsBefore}, nil
}

// reconcileStatus is why /readyz is not ready while the relay reconciles,
// or nil.
func (a *App) reconcileStatus() error {
	busy, err := a.relay.Reconciling()
	if !busy {
		return nil
	}
	a.recon.mu.Lock()
	p, running := a.recon.p, a.recon.running
	a.recon.mu.Unlock()
	msg := "reconciling the outbox with the stream before publishing"
	if running && p.Scans() {
		msg = fmt.Sprintf("%s: %d of %d stream sequences left to read (from %d to %d), %d rows found published already",
			msg, p.Remaining(), p.To-p.From+1, p.From, p.To, p.Settled)
	}
	if err != nil {
		msg += ": " + err.Error()
	}
	return fmt.Errorf("%s", msg)
}
