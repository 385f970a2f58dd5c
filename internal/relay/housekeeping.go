package relay

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// retentionPause separates pruning deletes so the application's writers
// get the lock between them.
const retentionPause = 20 * time.Millisecond

// statsLoop refreshes the backlog gauges from a cheap indexed query, so a
// scrape never scans the table. A failing read is logged at error level
// once, and its end once.
func (r *Relay) statsLoop(ctx context.Context) {
	every(ctx, r.o.StatsInterval, true, func() {
		if err := r.refreshBacklog(ctx); err == nil {
			r.readTrouble.ok()
		} else if ctx.Err() == nil {
			r.readTrouble.fail(err)
		}
	})
}

// refreshBacklog sets the backlog gauges from the table.
func (r *Relay) refreshBacklog(ctx context.Context) error {
	b, err := r.store.Backlog(ctx)
	if err != nil {
		return err
	}
	r.m.Backlog.WithLabelValues(string(event.StatusPending)).Set(float64(b.Pending))
	r.m.Backlog.WithLabelValues(string(event.StatusProcessing)).Set(float64(b.Processing))
	r.m.Backlog.WithLabelValues(string(event.StatusDeadLettered)).Set(float64(b.DeadLettered))
	age := 0.0
	if !b.OldestPending.IsZero() {
		age = max(0, time.Since(b.OldestPending).Seconds())
	}
	r.m.OldestPendingAge.Set(age)
	return nil
}

// retentionLoop deletes done rows and ledger rows past their retention.
func (r *Relay) retentionLoop(ctx context.Context) {
	every(ctx, r.o.RetentionInterval, true, func() {
		for _, p := range []struct {
			table string
			keep  time.Duration
		}{{event.PruneOutbox, r.o.RetainDone}, {event.PruneProcessedEvents, r.o.RetainProcessedEvents}} {
			if p.keep <= 0 {
				continue // 0 keeps rows forever
			}
			n, err := r.store.Prune(ctx, p.table, time.Now().Add(-p.keep), retentionPause)
			if n > 0 {
				r.m.PrunedRows.WithLabelValues(p.table).Add(float64(n))
				r.log.Info("pruned rows past retention", zap.String("table", p.table), zap.Int64("rows", n), zap.Duration("retention", p.keep))
			}
			if err != nil && ctx.Err() == nil {
				r.log.Warn("prune rows", zap.String("table", p.table), zap.Error(err))
			}
		}
	})
}

// checkpointLoop copies the WAL into the database beside the claim/settle
// path, so that their commits do not pay for it. Checkpoints are PASSIVE:
// they never wait for or block the application. They follow commits (the
// commit watch), at most one every CheckpointInterval: checkpointing about
// as often as the application commits keeps each checkpoint small, and the
// application's own automatic checkpoints (run inside its commits) then
// find little to copy, or this one running, and its commits stall less;
// the relay's lag and the application's lateness both drop
// (docs/performance.md). Without commits, nothing runs but a look every
// checkpointIdle, in case the watch missed one; without a watch, a look
// every checkpointPoll.
func (r *Relay) checkpointLoop(ctx context.Context) {
	look := time.NewTimer(checkpointIdle)
	defer look.Stop()
	gap := r.o.CheckpointInterval
	for {
		if r.watching.Load() {
			look.Reset(checkpointIdle)
		} else {
			look.Reset(checkpointPoll)
		}
		select {
		case <-ctx.Done():
			return
		case <-r.commits:
		case <-look.C:
		}
		start := time.Now()
		walPages, _, err := r.store.Checkpoint(ctx)
		if err != nil && ctx.Err() == nil && !r.stopIfReplaced(err) {
			r.log.Debug("checkpoint", zap.Error(err))
		}
		gap = checkpointGap(gap, walPages, r.o.CheckpointInterval)
		// Busy a third of the time at most: large checkpoints (a drain, a
		// slow disk) come less often.
		sleep(ctx, max(gap, 2*time.Since(start)))
	}
}

// checkpointGap returns the wait after a checkpoint that found walPages
// pages in the WAL, given the previous wait: it doubles, up to
// checkpointMaxGap, while checkpoints find less than checkpointSmall
// pages (a trickle, where every checkpoint's two fsyncs cost more than
// the copy), and halves back to least once they find more (a drain, where
// small, frequent checkpoints keep the application's commits short).
func checkpointGap(gap time.Duration, walPages int, least time.Duration) time.Duration {
	if walPages < checkpointSmall {
		return max(least, min(2*gap, checkpointMaxGap))
	}
	return max(least, gap/2)
}

// A checkpoint of fewer than checkpointSmall pages (400 KiB of 4 KiB
// pages) makes the next one wait longer, up to checkpointMaxGap: well
// below the 1000 pages at which the application's own connections
// checkpoint inside their commits.
const (
	checkpointSmall  = 100
	checkpointMaxGap = 200 * time.Millisecond
)

// How often checkpointLoop looks without a commit: while the commit watch
// runs, and while none does (it could not start, or stopped).
const (
	checkpointIdle = time.Second
	checkpointPoll = 200 * time.Millisecond
)

// every runs fn every d until ctx ends, and once at the start when now is
// set.
func every(ctx context.Context, d time.Duration, now bool, fn func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	if now {
		fn()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		fn()
	}
}
