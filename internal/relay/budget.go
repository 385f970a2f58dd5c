package relay

// The room in flight that the relays of a fleet's files share.

import (
	"context"
	"sync"
)

// Budget is the room in flight that several relays share: together they
// hold at most rows rows claimed and not settled, and bytes of payload
// claimed and not acknowledged, however many of them have a backlog.
// Without it every file of a fleet would hold a relay's whole room: a
// hundred files draining at once held every one of their rows in memory,
// and the garbage collector, kept to the fleet's memory limit, took most
// of the relay's CPU.
//
// Room goes to the relays in the order they asked for it, so that files
// with backlogs claim a batch each in turn. A relay with fewer than
// trickleRows rows in flight is given up to that many at once, past the
// budget if need be: a file with a trickle of commits never waits behind
// files with backlogs, and the budget is exceeded by at most trickleRows
// rows per open file.
type Budget struct {
	maxRows, maxBytes int64

	mu          sync.Mutex
	rows, bytes int64 // free; below zero after trickles past the budget
	queue       []*ask
	// wanted is closed while a relay waits in the queue (see Wanted).
	wanted chan struct{}
}

// trickleRows is the room a relay with few rows in flight is given at
// once (see Budget).
const trickleRows = 16

// room is rows and payload bytes in flight.
type room struct{ rows, bytes int64 }

// ask is a relay waiting for room.
type ask struct {
	rows  int64
	given chan room // one slot
}

// NewBudget returns a budget of rows rows and bytes payload bytes in
// flight (bytes 0: no limit on payload).
func NewBudget(rows int, bytes int64) *Budget {
	return &Budget{maxRows: int64(rows), maxBytes: bytes, rows: int64(rows), bytes: bytes, wanted: make(chan struct{})}
}

// Wanted returns a channel that is closed while a relay waits for room:
// the others settle the rows they hold at once instead of at the end of
// their settle window, so that files draining side by side do not wait
// for each other's windows. Nil (never ready) for a nil budget.
func (b *Budget) Wanted() <-chan struct{} {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.wanted
}

// noteQueue closes wanted when a relay waits, and replaces it once none
// does. Called with b.mu held.
func (b *Budget) noteQueue() {
	select {
	case <-b.wanted:
		if len(b.queue) == 0 {
			b.wanted = make(chan struct{})
		}
	default:
		if len(b.queue) > 0 {
			close(b.wanted)
		}
	}
}

// take waits its turn for room to claim up to rows rows, for a relay that
// holds held rows in flight, and returns it; false if ctx ended first.
// The room's bytes are 0 when the budget has no limit on payload. What
// the claim does not use goes back with give.
func (b *Budget) take(ctx context.Context, rows, held int64) (room, bool) {
	b.mu.Lock()
	if held < trickleRows {
		r := room{rows: min(rows, trickleRows-held)}
		if b.maxBytes > 0 {
			r.bytes = max(1, min(b.bytes, b.maxBytes/2)) // one row at least
		}
		b.rows, b.bytes = b.rows-r.rows, b.bytes-r.bytes
		b.mu.Unlock()
		return r, true
	}
	a := &ask{rows: rows, given: make(chan room, 1)}
	b.queue = append(b.queue, a)
	b.serve()
	b.mu.Unlock()
	select {
	case r := <-a.given:
		return r, true
	case <-ctx.Done():
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, q := range b.queue {
		if q == a {
			b.queue = append(b.queue[:i], b.queue[i+1:]...)
			b.noteQueue()
			return room{}, false
		}
	}
	r := <-a.given // served meanwhile: given back
	b.rows, b.bytes = b.rows+r.rows, b.bytes+r.bytes
	b.serve()
	return room{}, false
}

// give returns room: what a claim did not use (negative where it used
// more bytes than it was given), rows settled, payload acknowledged.
func (b *Budget) give(r room) {
	if b == nil {
		return
	}
	if b.maxBytes == 0 {
		r.bytes = 0 // payload is not counted
	}
	if r == (room{}) {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rows, b.bytes = b.rows+r.rows, b.bytes+r.bytes
	b.serve()
}

// serve gives room to the relays waiting, first come first served: to a
// relay waiting alone whatever rows are free, as a relay of its own takes
// them; to the first of several once there is enough for a worthwhile
// claim, a quarter of the rows (or what it asks, if less), so that files
// with backlogs take turns in batches rather than in crumbs. Payload is
// given once a quarter of it is free, as a relay of its own waits for
// (see claimLoop). Called with b.mu held.
func (b *Budget) serve() {
	defer b.noteQueue()
	for len(b.queue) > 0 {
		a := b.queue[0]
		need := min(a.rows, max(1, b.maxRows/4))
		if len(b.queue) == 1 {
			need = 1
		}
		if b.rows < need || (b.maxBytes > 0 && b.bytes < max(1, b.maxBytes/4)) {
			return
		}
		r := room{rows: min(a.rows, b.rows)}
		if b.maxBytes > 0 {
			r.bytes = min(b.bytes, b.maxBytes/2) // two claims may read at once
		}
		b.rows, b.bytes = b.rows-r.rows, b.bytes-r.bytes
		b.queue = b.queue[1:]
		a.given <- r
	}
}
