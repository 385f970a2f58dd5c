package relay

// The settle loop: wait for each batch's acknowledgements in order and
// write the outcomes.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// settleLoop waits for each batch's acknowledgements in order (until
// ackCtx ends) and settles them (retried until writeCtx ends): every batch
// resolved within SettleWindow after the first in one transaction, or a
// quarter of MaxInFlight rows as soon as they are resolved, or what is
// resolved at once while another relay sharing the Budget waits for room
// (with no window, each batch in its own). At a steady trickle of small batches
// that halves the relay's write transactions, so it takes the
// application's write lock half as often.
func (r *Relay) settleLoop(ctx, ackCtx, writeCtx context.Context) {
	// Acks are awaited apart from the window, so that a batch whose acks
	// are slow (up to relay.ack_timeout) does not hold back the settling
	// of the batches before it; and apart from the writes, so that a
	// settle transaction does not hold back the acks behind it, which give
	// back the payload budget (release).
	type resolvedBatch struct {
		outs  []event.Outcome
		floor uint64
	}
	resolved := newFIFO[resolvedBatch]()
	go func() {
		defer resolved.close()
		for b, ok := r.pipeline.next(); ok; b, ok = r.pipeline.next() {
			resolved.push(resolvedBatch{r.resolve(ctx, ackCtx, b), b.floor})
		}
	}()
	var outs []event.Outcome
	var floor uint64 // of the latest batch in outs
	var first time.Time
	window := time.NewTimer(time.Hour)
	defer window.Stop()
	flush := func(final bool) {
		// With nothing else in flight, every message sent is settled by
		// this transaction (a claim after the check is stored above m).
		if m := r.maxSeq.Load(); r.inflight.Load() == int64(len(outs)) {
			floor = m
		}
		r.settle(writeCtx, outs, r.scanFrom(floor, final))
		outs = nil
	}
	for {
		b, got, open := resolved.take()
		switch {
		case !got && !open:
			flush(true)
			return
		case !got:
			var wanted <-chan struct{}
			if len(outs) > 0 {
				wanted = r.o.Budget.Wanted()
			}
			select {
			case <-resolved.ready:
			case <-window.C:
				flush(false)
			case <-wanted:
				flush(false)
			}
			continue
		}
		if len(outs) == 0 {
			first = time.Now()
			window.Reset(r.o.SettleWindow)
		}
		if outs == nil {
			outs = b.outs // most often settled alone: not copied
		} else {
			outs = append(outs, b.outs...)
		}
		floor = b.floor
		// A quarter of MaxInFlight goes at once, and whatever is held
		// while another relay sharing the budget waits for room: during
		// a drain, rows waiting for the window would hold back claims.
		if time.Since(first) >= r.o.SettleWindow || len(outs) >= r.o.MaxInFlight/4 || isClosed(r.o.Budget.Wanted()) {
			flush(false)
		}
	}
}

// resolve turns a batch's acknowledgements into outcomes.
func (r *Relay) resolve(ctx, waitCtx context.Context, b *batch) []event.Outcome {
	outs := append(make([]event.Outcome, 0, len(b.outcomes)+len(b.acks)), b.outcomes...)
	for i := range outs {
		r.release(&outs[i].Row)
	}
	for i, ack := range b.acks {
		res := ack.Wait(waitCtx)
		if a, ok := ack.(*laneAck); ok {
			r.sendNext(ctx, a, res)
		}
		r.release(&b.msgs[i].Row)
		b.acks[i] = nil // its future holds the message, payload and all
		row := b.msgs[i].Row
		now := r.o.Clock.Now()
		switch res.Kind {
		case publish.Stored, publish.Duplicate:
			r.stored(res.Seq)
			r.held.stored(b.msgs[i].Subject, r.log)
			if res.Kind == publish.Duplicate {
				r.m.Duplicates.Inc()
				if o, reused := r.reused(row, res.Err); reused {
					outs = append(outs, o)
					continue
				}
			}
			r.m.PublishDuration.Observe(time.Since(b.published).Seconds())
			r.m.DeliveryLag.Observe(max(0, time.Since(row.Created()).Seconds()))
			r.outage.answered(b.published, r.log, r.m)
			outs = append(outs, event.Outcome{Row: row, Settlement: event.Done, StreamSeq: res.Seq})
		case publish.Rejected:
			// The broker answered about this message: it is up.
			r.outage.answered(b.published, r.log, r.m)
			o := event.Reject(row, res.Err.Error(), r.o.MaxAttempts, now)
			level := zap.WarnLevel
			if publish.PermissionDenied(res.Err) && o.Settlement == event.Retry {
				level = zap.DebugLevel // the connection logs a denied subject once, not once a row
			}
			r.log.Log(level, "broker rejected event", zap.Int64("row_id", row.ID), zap.String("event_id", row.EventID),
				zap.String("subject", b.msgs[i].Subject), zap.Int("attempts", o.Attempts), zap.Stringer("next", o.Settlement), zap.Error(res.Err))
			outs = append(outs, o)
		case publish.Transport:
			if ctx.Err() != nil || waitCtx.Err() != nil {
				r.pins.pin(row.ID, b.floor) // it may be stored
				// Shutting down: hand the row back at once, for whoever runs next.
				outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now, Reason: metrics.DeferShutdown})
				continue
			}
			if errors.Is(res.Err, publish.ErrSubjectFull) {
				// The stream answered (so it is up, and takes the other
				// subjects): not stored, and no outage.
				r.outage.answered(b.published, r.log, r.m)
				delay := r.held.hold(b.msgs[i].Subject, res.Err, r.log)
				outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now.Add(delay), Reason: metrics.DeferSubjectFull})
				continue
			}
			delay := r.outage.deferRow(res.Err, r.log, r.m)
			r.pins.pin(row.ID, b.floor) // it may be stored
			r.wakeClaimer()             // the claimer may be idle: let it see the outage now
			outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now.Add(delay), Reason: metrics.DeferOutage})
		case publish.Invalid:
			outs = append(outs, r.invalid(row, res.Err))
		case publish.Withheld:
			if errors.Is(res.Err, publish.ErrGroupsHeld) {
				// Looked at again now and then: the stream may take atomic
				// batches once the relay restarts (see groupsHeld).
				r.groupsHeld(res.Err)
				outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now.Add(groupsHeldFor), Reason: metrics.DeferGroupsHeld})
				continue
			}
			// It waits behind its key's row that was not stored; the claim
			// takes it again once that row is published (or skipped).
			r.log.Debug("row withheld", zap.Int64("row_id", row.ID), zap.Error(res.Err))
			outs = append(outs, event.Outcome{Row: row, Settlement: event.Release, AvailableAt: now, Reason: metrics.DeferOrdering})
		default:
			panic(fmt.Sprintf("unknown publish result %v", res.Kind))
		}
	}
	return outs
}

// reused returns the dead letter of a row whose event id the stream
// holds for another row (why, a *publish.ReusedID), and logs it: its
// own event is not in the stream. A message the stream no longer holds is
// taken for the row's own when this relay sent the row before without an
// answer, or the row was there when the relay began to lead (an earlier
// relay may have sent it).
func (r *Relay) reused(row event.Row, why error) (event.Outcome, bool) {
	var e *publish.ReusedID
	if !errors.As(why, &e) {
		return event.Outcome{}, false
	}
	if e.Gone && (r.pins.has(row.ID) || row.ID <= r.rowsBefore.Load()) {
		// This relay sent it before without an answer, or an earlier
		// relay may have: the stream removed it since (consumed from an
		// interest or work-queue stream, its limits, a purge).
		r.log.Warn("a row's event id is in the stream's duplicate window for a message the stream no longer holds; taken as the row's own, stored before and removed since",
			zap.Int64("row_id", row.ID), zap.String("event_id", row.EventID), zap.Uint64("stream_seq", e.Seq))
		return event.Outcome{}, false
	}
	r.log.Warn("dead-lettered a row whose event id the stream holds for another row: its own event is not in the stream",
		zap.Int64("row_id", row.ID), zap.String("event_id", row.EventID), zap.Error(why))
	return event.Outcome{Row: row, Settlement: event.DeadLetter, Attempts: row.Attempts, Error: why.Error(), Reason: event.DeadLetterReusedID}, true
}

// release gives back the budget of a row's payload once its publish is
// resolved, and drops the payload: the settlement needs none of it, and
// rows wait for their settle transaction (up to SettleWindow) without
// holding the budget that the next claims need.
func (r *Relay) release(row *event.Row) {
	if len(row.Payload) == 0 {
		return
	}
	left := r.inflightBytes.Add(-int64(len(row.Payload)))
	r.o.Budget.give(room{bytes: int64(len(row.Payload))})
	row.Payload = nil
	if left <= int64(r.o.MaxInFlightBytes)*3/4 {
		signal(r.room)
	}
}

// errLeadUnsure withholds a key's next rows from a relay that cannot tell
// that it still leads (see leadSure).
var errLeadUnsure = errors.New("this relay may have lost the lead: its heartbeat is late and its row is gone")

// sendNext sends the rows of a's key after it, if a was stored and they
// wait for it (see lanes): one row, or many as one atomic batch when the
// publisher takes them. After shutdown began nothing is sent.
func (r *Relay) sendNext(ctx context.Context, a *laneAck, res publish.Result) {
	limit := 0
	if r.batcher != nil {
		limit = r.batcher.BatchRoom()
	}
	var stop error
	switch {
	case ctx.Err() != nil:
		stop = fmt.Errorf("shutting down: %w", ctx.Err())
	case !r.leadSure(ctx):
		stop = errLeadUnsure
	}
	next := r.lanes.resolved(a, res, stop, limit)
	if len(next) == 0 {
		return
	}
	if next[0].group != nil {
		r.sendGroup(ctx, next)
		return
	}
	msgs := make([]publish.Message, len(next))
	for i, a := range next {
		msgs[i] = a.msg
	}
	var acks []publish.Ack
	if len(next) == 1 {
		acks = r.pub.Publish(ctx, msgs)
	} else {
		acks = r.batcher.PublishBatch(ctx, msgs)
		r.m.AtomicBatches.Inc()
	}
	for i, a := range next {
		r.lanes.sent(a, acks[i])
	}
}

// settle writes outcomes and scanFrom (see Store.Settle), retrying
// database errors until it succeeds or writeCtx ends (only after shutdown
// began).
func (r *Relay) settle(writeCtx context.Context, outs []event.Outcome, scanFrom uint64) {
	if len(outs) == 0 && scanFrom == 0 {
		return
	}
	retry := backoff{min: 50 * time.Millisecond, max: 2 * time.Second}
	for {
		stale, err := r.store.Settle(writeCtx, outs, scanFrom)
		if err == nil {
			r.settleTrouble.OK()
			r.pins.settled(outs)
			r.count(outs, stale)
			break
		}
		if writeCtx.Err() != nil || r.stopIfReplaced(err) {
			r.log.Error("could not settle rows before exiting; they stay pending, and the next leader publishes them again",
				zap.Int("rows", len(outs)), zap.Error(err))
			break
		}
		r.settleTrouble.Fail(err)
		sleep(writeCtx, retry.next())
	}
	r.lanes.settled(outs, r.claimSeq.Load())
	r.inFlightGauge.Set(float64(r.inflight.Add(-int64(len(outs)))))
	r.o.Budget.give(room{rows: int64(len(outs))})
	signal(r.settled)
}

// count updates the metrics for the outcomes that were written; stale ones
// changed nothing.
func (r *Relay) count(outs []event.Outcome, stale []int) {
	if len(stale) > 0 {
		r.log.Warn("rows not settled: this relay lost the lead, or the rows changed meanwhile; the leader publishes what is still pending", zap.Int("rows", len(stale)))
	}
	for i, o := range outs {
		if len(stale) > 0 && stale[0] == i {
			stale = stale[1:]
			continue
		}
		switch o.Settlement {
		case event.Done:
			r.m.Published.Inc()
		case event.Retry:
			r.m.Retries.Inc()
		case event.DeadLetter:
			r.m.DeadLettered.WithLabelValues(o.Reason).Inc()
			if o.Reason == event.DeadLetterReusedID {
				r.m.ReusedEventIDs.Inc()
			}
		case event.Release:
			r.m.Deferred.WithLabelValues(o.Reason).Inc()
		}
	}
}

// groupsHeldFor is how long the rows of an atomic group held while the
// stream takes no atomic batches wait before the relay looks again.
const groupsHeldFor = 30 * time.Second

// groupsHeld logs, once, that atomic groups are held (why).
func (r *Relay) groupsHeld(why error) {
	if r.heldSaid.CompareAndSwap(false, true) {
		r.log.Warn("rows with an atomic_group are held, not published in parts: no atomic batches (core NATS, or a stream without allow_atomic, nats-server 2.12 or later); they stay pending, no attempt spent",
			zap.Error(why))
	}
}
