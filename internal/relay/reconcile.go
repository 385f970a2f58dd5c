package relay

// Reconciling on taking the lead, and keeping the stream position that
// the next reconciliation starts from (see package reconcile).

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// Reconciled is what a reconciliation tells the relay.
type Reconciled struct {
	// Last is the stream's last sequence when it began: every message
	// published after it is stored above.
	Last uint64
	// RowsBefore is the highest row id when it began: rows above it were
	// not published by an earlier relay.
	RowsBefore int64
}

// mustReconcile reports whether a reconciliation was asked for since the
// latest one.
func (r *Relay) mustReconcile() bool {
	return r.o.Reconcile != nil && r.reconcileDone.Load() != r.reconcileAsked.Load()
}

// reconcile runs Options.Reconcile once nothing is in flight. It counts
// only if nothing asked for another meanwhile (the lead was lost and
// taken again, say). A failure is an outage when the broker does not
// answer (no attempt is spent, the claimer waits for it), else logged and
// retried with a growing pause.
func (r *Relay) reconcile(ctx context.Context, retry *backoff) (fatal error) {
	if r.inflight.Load() > 0 {
		wait(ctx, r.settled, nil) // what the last lead left in flight settles first
		return nil
	}
	asked := r.reconcileAsked.Load()
	res, err := r.o.Reconcile(ctx)
	if err == nil {
		r.reconcileTrouble.OK()
		retry.reset()
		r.maxSeq.Store(res.Last)
		r.rowsBefore.Store(res.RowsBefore)
		r.pins.clear()
		r.reconcileDone.Store(asked)
		return nil
	}
	if ctx.Err() != nil {
		return nil
	}
	if perr := r.probe(ctx); perr != nil {
		if errors.Is(perr, publish.ErrClosed) {
			return perr
		}
		r.outage.begin(err, r.log, r.m)
		return nil
	}
	r.reconcileTrouble.Fail(err)
	sleep(ctx, retry.next())
	return nil
}

// Reconciling reports why this relay leads without publishing yet: its
// reconciliation failed (the error), or has not finished (nil, and true).
func (r *Relay) Reconciling() (bool, error) {
	if !r.mustReconcile() {
		return false, nil
	}
	return r.leading.Load() || r.o.HeartbeatInterval == 0, r.reconcileTrouble.Err()
}

// ReconcileAgain makes the relay reconcile before it claims again (the
// stream was created anew: the sequences it knew are another stream's).
func (r *Relay) ReconcileAgain() {
	r.reconcileAsked.Add(1)
	r.wakeClaimer()
}

// stored notes the sequence of a message found stored.
func (r *Relay) stored(seq uint64) {
	for {
		old := r.maxSeq.Load()
		if seq <= old || r.maxSeq.CompareAndSwap(old, seq) {
			return
		}
	}
}

// markEvery is how often at most a settle writes the stream position
// (one more page of WAL): a position written late is only lower, which
// makes the next reconciliation read a little more.
const markEvery = time.Second

// scanFrom is where the messages of rows not yet settled can begin, once
// the batches up to one claimed at floor are settled: every later batch
// is stored above floor, and a row whose publish ended without an answer
// (pins) above its batch's floor. It is 0 (write none) when the relay
// keeps no position, and when one was written less than markEvery ago,
// unless final (the last settle before the relay stops). Called by the
// settle loop alone.
func (r *Relay) scanFrom(floor uint64, final bool) uint64 {
	if r.o.Reconcile == nil || r.mustReconcile() {
		return 0
	}
	now := r.o.Clock.Now()
	if !final && now.Before(r.markAt.Add(markEvery)) {
		return 0
	}
	r.markAt = now
	return min(floor, r.pins.min()) + 1
}

// pins are the rows handed back after a publish that got no answer (a
// timeout, a connection lost, shutdown): their message may be stored. Each
// holds the stream position at its batch's floor until it is settled
// otherwise.
type pins struct {
	mu   sync.Mutex
	rows map[int64]uint64 // row id -> floor
}

func (p *pins) pin(id int64, floor uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if old, ok := p.rows[id]; !ok || floor < old {
		p.rows[id] = floor
	}
}

// has reports whether this relay sent row id before without an answer.
func (p *pins) has(id int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.rows[id]
	return ok
}

// settled unpins the rows of outs that were written as anything but a
// release (stale ones too: another relay settled them).
func (p *pins) settled(outs []event.Outcome) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, o := range outs {
		if o.Settlement != event.Release {
			delete(p.rows, o.Row.ID)
		}
	}
}

// any reports whether a row is pinned.
func (p *pins) any() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.rows) > 0
}

func (p *pins) min() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := uint64(1<<64 - 1)
	for _, f := range p.rows {
		m = min(m, f)
	}
	return m
}

func (p *pins) clear() {
	p.mu.Lock()
	defer p.mu.Unlock()
	clear(p.rows)
}
