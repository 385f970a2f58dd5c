package relay

import (
	"context"
	"fmt"
	"sync"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// lanes publishes the rows that carry an ordering key one at a time per
// key: a row is sent only once the broker has stored the row before it of
// the same key. Messages of one key in flight together could be stored out
// of order: the broker may refuse one (a subject this user may not publish
// to, a size limit, a subject the stream stopped capturing) and take the
// next, or a connection may be lost after one and re-established before
// the next.
//
// Once a row of a key was not stored (or was dead-lettered without
// publishing), the lane sends nothing more of that key (Withheld: the row
// stays pending, no attempt spent) until every row of the key it was given
// is settled, and then only rows of claims that began after that: from
// then on the table keeps the key waiting behind that row (see
// claim.Store.Claim), or lets it go on past a skipped dead letter. A claim
// that began earlier may have read the failed row as in flight, and taken
// the rows behind it. Claims are numbered by the relay (the seq arguments).
// Rows of different keys, and rows without a key (which do not pass
// through here), are sent side by side.
type lanes struct {
	pub    Publisher
	ctx    context.Context // ends at shutdown: rows not yet sent are not sent
	ackCtx context.Context // how long a sent row's acknowledgement is awaited

	mu      sync.Mutex
	keys    map[string]*lane
	blocked map[string]*lane // the lanes in keys that are blocked
}

// lane is one ordering key's rows given to lanes and not yet settled.
type lane struct {
	queue   []*laneAck // rows to send, in id order; nil msg: a barrier
	running bool       // a goroutine sends the queue
	// unsettled counts the rows given and not yet settled; the lane goes
	// when it reaches 0.
	unsettled int
	// blocked says why nothing more is sent (nil: sending).
	blocked error
	// clearAt, once every row given is settled, is the first claim whose
	// rows the table decides (0: not yet).
	clearAt uint64
}

// laneAck is the pending outcome of a row given to lanes.
type laneAck struct {
	msg     publish.Message
	barrier error // not a message: a row dead-lettered without publishing
	done    chan struct{}
	res     publish.Result
}

func (a *laneAck) Wait(ctx context.Context) publish.Result {
	select {
	case <-a.done:
		return a.res
	case <-ctx.Done():
		return publish.Result{Kind: publish.Transport, Err: ctx.Err()}
	}
}

func (a *laneAck) resolve(res publish.Result) {
	a.res = res
	close(a.done)
}

func newLanes(pub Publisher, ctx, ackCtx context.Context) *lanes {
	return &lanes{pub: pub, ctx: ctx, ackCtx: ackCtx, keys: map[string]*lane{}, blocked: map[string]*lane{}}
}

// send queues m, a row of claim seq, behind the rows of its key given
// before it.
func (l *lanes) send(m publish.Message, seq uint64) publish.Ack {
	a := &laneAck{msg: m, done: make(chan struct{})}
	l.enqueue(m.Row.OrderingKey, seq, a)
	return a
}

// barrier stops the key of row (of claim seq), which is dead-lettered
// without being published (reason), at its place among the rows of its
// key.
func (l *lanes) barrier(row event.Row, reason string, seq uint64) {
	l.enqueue(row.OrderingKey, seq, &laneAck{barrier: fmt.Errorf("row %d was dead-lettered: %s", row.ID, reason), done: make(chan struct{})})
}

func (l *lanes) enqueue(key string, seq uint64, a *laneAck) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ln := l.keys[key]
	if ln == nil {
		ln = &lane{}
		l.keys[key] = ln
	}
	ln.unsettled++
	if ln.blocked != nil && ln.clearAt != 0 && seq >= ln.clearAt {
		ln.blocked, ln.clearAt = nil, 0
		delete(l.blocked, key)
	}
	if ln.blocked != nil {
		if a.barrier == nil {
			a.resolve(withheld(key, ln.blocked))
		}
		return
	}
	ln.queue = append(ln.queue, a)
	if !ln.running {
		ln.running = true
		go l.run(key, ln)
	}
}

// run sends ln's rows one at a time until its queue is empty or a row was
// not stored.
func (l *lanes) run(key string, ln *lane) {
	for {
		l.mu.Lock()
		if len(ln.queue) == 0 {
			ln.running = false
			if ln.unsettled <= 0 && ln.blocked == nil {
				delete(l.keys, key)
			}
			l.mu.Unlock()
			return
		}
		a := ln.queue[0]
		ln.queue = ln.queue[1:]
		l.mu.Unlock()
		if a.barrier != nil {
			l.block(key, ln, a.barrier)
			continue
		}
		var res publish.Result
		if err := l.ctx.Err(); err != nil {
			res = publish.Result{Kind: publish.Transport, Err: err}
		} else {
			res = l.pub.Publish(l.ctx, []publish.Message{a.msg})[0].Wait(l.ackCtx)
		}
		if res.Kind != publish.Stored && res.Kind != publish.Duplicate {
			l.block(key, ln, fmt.Errorf("row %d was not stored (%s)", a.msg.Row.ID, res.Kind))
		}
		a.resolve(res)
	}
}

// block withholds ln's queue and whatever its key is given next (see
// lanes).
func (l *lanes) block(key string, ln *lane, why error) {
	l.mu.Lock()
	queue := ln.queue
	ln.queue = nil
	if ln.blocked == nil {
		ln.blocked = why
		l.blocked[key] = ln
	}
	l.mu.Unlock()
	for _, a := range queue {
		if a.barrier == nil {
			a.resolve(withheld(key, why))
		}
	}
}

func withheld(key string, why error) publish.Result {
	return publish.Result{Kind: publish.Withheld, Err: fmt.Errorf("ordering key %q waits: %w", key, why)}
}

// settled lets go of settled rows, seq being the latest claim begun. A
// key whose rows are all settled sends again: at once if nothing of it
// failed, else the rows of claims after seq (see lanes).
func (l *lanes) settled(outs []event.Outcome, seq uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, o := range outs {
		if ln := l.keys[o.Row.OrderingKey]; ln != nil && o.Row.OrderingKey != "" {
			ln.unsettled--
			if ln.unsettled <= 0 && !ln.running && ln.blocked == nil {
				delete(l.keys, o.Row.OrderingKey)
			}
		}
	}
	// A blocked lane whose rows are all settled goes once no claim that
	// began before that can still hand it rows.
	for key, ln := range l.blocked {
		if ln.unsettled > 0 || ln.running {
			continue
		}
		switch {
		case ln.clearAt == 0:
			ln.clearAt = seq + 1
		case seq >= ln.clearAt:
			delete(l.blocked, key)
			delete(l.keys, key)
		}
	}
}
