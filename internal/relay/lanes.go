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
// is settled. From then on the table keeps the key waiting behind that row
// (see claim.Store.Claim), or lets it go on past a skipped dead letter.
// Rows of different keys, and rows without a key (which do not pass
// through here), are sent side by side.
type lanes struct {
	pub    Publisher
	ctx    context.Context // ends at shutdown: rows not yet sent are not sent
	ackCtx context.Context // how long a sent row's acknowledgement is awaited

	mu   sync.Mutex
	keys map[string]*lane
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
	return &lanes{pub: pub, ctx: ctx, ackCtx: ackCtx, keys: map[string]*lane{}}
}

// send queues m behind the rows of its key given before it.
func (l *lanes) send(m publish.Message) publish.Ack {
	a := &laneAck{msg: m, done: make(chan struct{})}
	l.enqueue(m.Row.OrderingKey, a)
	return a
}

// barrier stops the key of row, which is dead-lettered without being
// published (reason), at its place among the rows of its key.
func (l *lanes) barrier(row event.Row, reason string) {
	l.enqueue(row.OrderingKey, &laneAck{barrier: fmt.Errorf("row %d was dead-lettered: %s", row.ID, reason), done: make(chan struct{})})
}

func (l *lanes) enqueue(key string, a *laneAck) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ln := l.keys[key]
	if ln == nil {
		ln = &lane{}
		l.keys[key] = ln
	}
	ln.unsettled++
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
			if ln.unsettled <= 0 {
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

// block withholds ln's queue and whatever its key is given next, until
// every row given is settled.
func (l *lanes) block(key string, ln *lane, why error) {
	l.mu.Lock()
	queue := ln.queue
	ln.queue = nil
	if ln.blocked == nil {
		ln.blocked = why
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

// settled lets go of settled rows; a key whose rows are all settled sends
// again (the claim decides what of it comes next).
func (l *lanes) settled(outs []event.Outcome) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, o := range outs {
		key := o.Row.OrderingKey
		if key == "" {
			continue
		}
		if ln := l.keys[key]; ln != nil {
			if ln.unsettled--; ln.unsettled <= 0 && !ln.running {
				delete(l.keys, key)
			}
		}
	}
}
