package relay

// Reconciling on taking the lead, and keeping the stream position that
// the next reconciliation starts from (see package reconcile).

import (
	"context"
	"errors"
	"sync"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// reconcile runs Options.Reconcile once nothing is in flight; it reports
// whether the claimer may go on to claim. A failure is an outage when the
// broker does not answer (no attempt is spent, the claimer waits for it),
// else logged and retried with a growing pause.
func (r *Relay) reconcile(ctx context.Context, retry *backoff) (ok bool, fatal error) {
	if r.inflight.Load() > 0 {
		wait(ctx, r.settled, nil) // what the last lead left in flight settles first
		return false, nil
	}
	last, err := r.o.Reconcile(ctx)
	if err == nil {
		r.reconcileTrouble.OK()
		retry.reset()
		r.maxSeq.Store(last)
		r.pins.clear()
		r.reconciled.Store(true)
		return true, nil
	}
	if ctx.Err() != nil {
		return false, nil
	}
	if perr := r.probe(ctx); perr != nil {
		if errors.Is(perr, publish.ErrClosed) {
			return false, perr
		}
		r.outage.begin(err, r.log, r.m)
		return false, nil
	}
	r.reconcileTrouble.Fail(err)
	sleep(ctx, retry.next())
	return false, nil
}

// Reconciling reports why this relay leads without publishing yet: its
// reconciliation failed (the error), or has not finished (nil, and true).
func (r *Relay) Reconciling() (bool, error) {
	if r.o.Reconcile == nil || r.reconciled.Load() {
		return false, nil
	}
	return r.leading.Load() || r.o.HeartbeatInterval == 0, r.reconcileTrouble.Err()
}

// ReconcileAgain makes the relay reconcile before it claims again (the
// stream was created anew: the sequences it knew are another stream's).
func (r *Relay) ReconcileAgain() {
	r.reconciled.Store(false)
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

// scanFrom is where the messages of rows not yet settled can begin, once
// the batches up to one claimed at floor are settled: every later batch
// is stored above floor, and a row whose publish ended without an answer
// (pins) above its batch's floor. 0 when the relay keeps no position.
func (r *Relay) scanFrom(floor uint64) uint64 {
	if r.o.Reconcile == nil || !r.reconciled.Load() {
		return 0
	}
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
