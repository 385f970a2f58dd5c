package relay

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// lanes holds the rows that carry an ordering key so that each key has one
// message in flight at a time: a row is sent only once the broker has
// stored the row before it of the same key. Messages of one key in flight
// together could be stored out of order: the broker may refuse one (a
// subject this user may not publish to, a size limit, a subject the stream
// stopped capturing) and take the next, or a connection may be lost after
// one and re-established before the next.
//
// A key's first row goes out with the claim's other rows (Relay.publish);
// the settler, which waits for every row's outcome in claim order, sends
// the key's next rows when it sees the ones before them stored (resolved):
// one row, or, where many wait and the stream takes atomic batches, up to
// a batch's limit of them as one atomic batch, stored all or none and in
// order, for one round trip. Rows of different keys, and rows without a
// key (which do not pass through here), are sent side by side.
//
// A row that can never be published (invalid) is a barrier: it is
// dead-lettered only once it is its key's next row, like a row the broker
// refused for the last time; behind a row that was not stored it waits
// with the others, so that a dead letter never passes an earlier row of
// its key that is still to go.
//
// Once a row of a key was not stored (or was dead-lettered without
// publishing), nothing more of that key is sent (Withheld: the row stays
// pending, no attempt spent) until every row of the key given here is
// settled, and then only rows of claims that began after that: from then
// on the table keeps the key waiting behind that row (see
// claim.Store.Claim), or lets it go on past a skipped dead letter. A claim
// that began earlier may have read the failed row as in flight, and taken
// the rows behind it. Claims are numbered by the relay (the seq arguments).
type lanes struct {
	mu      sync.Mutex
	keys    map[string]*lane
	blocked map[string]*lane // the lanes in keys that are blocked
}

// lane is one ordering key's rows given to lanes and not yet settled.
type lane struct {
	queue   []*laneAck // rows waiting to be sent, in id order
	sending int        // rows of the key in flight: one, or an atomic batch's
	// unsettled counts the rows given and not yet settled; the lane goes
	// when it reaches 0.
	unsettled int
	// blocked says why nothing more is sent (nil: sending).
	blocked error
	// clearAt, once every row given is settled, is the first claim whose
	// rows the table decides (0: not yet).
	clearAt uint64
}

// laneAck is the outcome of a row given to lanes: its publish's, once it
// is sent, or the reason it was not.
type laneAck struct {
	msg     publish.Message
	barrier error // not a message: why the row can never be published
	group   *group
	ack     publish.Ack
	res     publish.Result // when ack is nil: why it was not sent
}

// group is an atomic group's rows given to lanes: sent together as one
// atomic batch once it is the next of every ordering key it has rows of,
// or resolved together without being sent. A key it has rows of sends
// nothing else meanwhile. (A claim takes a group whole, and only when the
// group's rows of each key follow one another in the key and come after
// every other row of its keys before the group's first row: see
// claim.Store.Claim. So groups wait for one another in id order, never in
// a circle.)
type group struct {
	rows    []*laneAck // in id order, with an ordering key or not
	barrier error      // why the group can never be published, or nil
	waiting int        // keys where the group is not yet next
	next    map[string]bool
	over    bool // resolved without being sent
	// failed is the outcome of its first row the settler found not
	// stored (see laneAck.Wait; only the settler reads or writes it).
	failed *publish.Result
}

func (g *group) name() string { return g.rows[0].msg.Row.Group }

// keys returns the ordering keys g has rows of, each with its count of
// rows, in the order of their first row.
func (g *group) keys() (keys []string, rows map[string]int) {
	rows = map[string]int{}
	for _, a := range g.rows {
		if k := a.msg.Row.OrderingKey; k != "" {
			if rows[k] == 0 {
				keys = append(keys, k)
			}
			rows[k]++
		}
	}
	return keys, rows
}

// Wait returns the row's outcome. The settler waits for rows in claim
// order, so by the time it waits for a row the one before it of the same
// key is resolved, and the row was sent (ack) or withheld (res).
//
// The rows of an atomic group end alike: once one of them was not stored
// (a wait that ended at shutdown before the group's answer, say), the
// rows after it get that outcome too, so that they keep the same attempts
// and come back together.
func (a *laneAck) Wait(ctx context.Context) publish.Result {
	if a.ack == nil {
		return a.res
	}
	g := a.group
	if g != nil && g.failed != nil {
		return *g.failed
	}
	res := a.ack.Wait(ctx)
	if g != nil && res.Kind != publish.Stored && res.Kind != publish.Duplicate {
		g.failed = &res
	}
	return res
}

func newLanes() *lanes {
	return &lanes{keys: map[string]*lane{}, blocked: map[string]*lane{}}
}

// add gives lanes a row of claim seq (m, or a barrier when barrier is not
// nil) and returns its ack, and the message to send now when the row is
// its key's next (nil otherwise): the caller sends it and passes the ack
// to sent.
func (l *lanes) add(m publish.Message, barrier error, seq uint64) (*laneAck, *publish.Message) {
	a := &laneAck{msg: m, barrier: barrier}
	key := m.Row.OrderingKey
	l.mu.Lock()
	defer l.mu.Unlock()
	ln := l.lane(key, 1, seq)
	switch {
	case ln.blocked != nil:
		a.res = withheld(key, ln.blocked)
		// The claim that took the row began before it could know: claims
		// that began before this row is settled may read it as in flight
		// and take the rows behind it, so they too are withheld.
		ln.clearAt = 0
	case ln.sending > 0 || len(ln.queue) > 0:
		ln.queue = append(ln.queue, a)
	case barrier != nil:
		l.deadLetter(key, ln, a)
	default:
		ln.sending = 1
		return a, &a.msg
	}
	return a, nil
}

// lane returns key's lane, counting n more rows of claim seq given to it,
// and clears its block when seq is a claim that began after it. l.mu is
// held.
func (l *lanes) lane(key string, n int, seq uint64) *lane {
	ln := l.keys[key]
	if ln == nil {
		ln = &lane{}
		l.keys[key] = ln
	}
	ln.unsettled += n
	if ln.blocked != nil && ln.clearAt != 0 && seq >= ln.clearAt {
		ln.blocked, ln.clearAt = nil, 0
		delete(l.blocked, key)
	}
	return ln
}

// addGroup gives lanes the rows of an atomic group of claim seq (msgs, in
// id order; barrier: why the group can never be published, or nil) and
// returns their acks, and the rows to send now as one atomic batch when
// the group is the next of each of its keys (nil otherwise: the caller
// sends them and passes their acks to sent). A group one of whose keys
// is blocked is withheld whole, and blocks its other keys.
func (l *lanes) addGroup(msgs []publish.Message, barrier error, seq uint64) (acks, send []*laneAck) {
	g := &group{barrier: barrier, next: map[string]bool{}}
	for _, m := range msgs {
		g.rows = append(g.rows, &laneAck{msg: m, group: g})
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	keys, rows := g.keys()
	var why error
	for _, k := range keys {
		ln := l.lane(k, rows[k], seq)
		if ln.blocked != nil {
			why = withheld(k, ln.blocked).Err
			ln.clearAt = 0 // as in add
		}
	}
	if why != nil {
		l.failGroup(g, publish.Withheld, why)
		return g.rows, nil
	}
	for _, k := range keys {
		ln := l.keys[k]
		if ln.sending > 0 || len(ln.queue) > 0 {
			for _, a := range g.rows {
				if a.msg.Row.OrderingKey == k {
					ln.queue = append(ln.queue, a)
				}
			}
			g.waiting++
			continue
		}
		ln.sending, g.next[k] = rows[k], true
	}
	if g.waiting > 0 {
		return g.rows, nil
	}
	return g.rows, l.ready(g)
}

// arrive makes group g, whose rows of key head ln's queue, the key's
// next: its rows of the key leave the queue as if sent, and once g is
// the next of every key it has rows of, its rows are returned to send
// (see ready). l.mu is held.
func (l *lanes) arrive(key string, ln *lane, g *group) []*laneAck {
	n := 0
	for n < len(ln.queue) && ln.queue[n].group == g {
		n++
	}
	ln.queue, ln.sending, g.next[key] = ln.queue[n:], n, true
	if g.waiting--; g.waiting > 0 {
		return nil
	}
	return l.ready(g)
}

// ready returns the rows of g, the next of each of its keys, to send; or
// dead-letters them all, when g can never be published. l.mu is held.
func (l *lanes) ready(g *group) []*laneAck {
	if g.barrier != nil {
		l.failGroup(g, publish.Invalid, g.barrier)
		return nil
	}
	return g.rows
}

// failGroup resolves every row of g alike without sending it (Withheld,
// or Invalid when it can never be published, for why), takes its rows
// out of its keys' lanes, and blocks those keys: rows of a claim may
// already wait behind it. l.mu is held.
func (l *lanes) failGroup(g *group, kind publish.Kind, why error) {
	if g.over {
		return
	}
	g.over = true
	res := publish.Result{Kind: kind, Err: why}
	if kind == publish.Withheld {
		res.Err = fmt.Errorf("atomic group %q waits: %w", g.name(), why)
	}
	for _, a := range g.rows {
		a.res = res
	}
	keys, rows := g.keys()
	for _, k := range keys {
		ln := l.keys[k]
		if g.next[k] {
			ln.sending -= rows[k]
		} else {
			ln.queue = slices.DeleteFunc(ln.queue, func(a *laneAck) bool { return a.group == g })
		}
		first := g.rows[0].msg.Row.ID
		l.block(k, ln, fmt.Errorf("row %d of atomic group %q was not stored (%s)", first, g.name(), kind))
	}
}

// minBatch is the fewest rows of a key sent as one atomic batch. A batch
// costs the server about 3 ms whatever its size (it stages the batch in a
// store of its own, synced), a row sent alone about a round trip (0.1 ms
// on one host): below some 30 rows, one at a time is as fast. (The
// configuration's ordering.batch_max starts there: config.MinBatchMax.)
const minBatch = 32

// resolved records the outcome res of row a and, once every row of its
// key in flight is resolved, returns the key's next rows to send, if any:
// one, or up to batch rows (0: no atomic batches) when at least minBatch
// wait. After a failure, or when stop is set (at shutdown), the rest of
// the key is withheld instead. The caller sends the rows (more
// than one as one atomic batch) and passes their acks to sent. A row that
// was not sent changes nothing.
func (l *lanes) resolved(a *laneAck, res publish.Result, stop error, batch int) []*laneAck {
	row := a.msg.Row
	key := row.OrderingKey
	l.mu.Lock()
	defer l.mu.Unlock()
	ln := l.keys[key]
	if ln == nil || a.ack == nil {
		return nil
	}
	ln.sending--
	if res.Kind != publish.Stored && res.Kind != publish.Duplicate {
		l.block(key, ln, fmt.Errorf("row %d was not stored (%s)", row.ID, res.Kind))
		return nil
	}
	if ln.sending > 0 {
		return nil // the rest of its batch comes next
	}
	if stop != nil {
		// Shutdown, or a lead in doubt: the rest of the key is released
		// unsent, and a claim under way may have read it as in flight and
		// taken the rows behind it: the key sends nothing more.
		l.block(key, ln, stop)
		return nil
	}
	for len(ln.queue) > 0 {
		next := ln.queue[0]
		switch {
		case next.group != nil:
			return l.arrive(key, ln, next.group)
		case next.barrier != nil:
			ln.queue = ln.queue[1:]
			l.deadLetter(key, ln, next)
		default:
			n := batchable(ln.queue, batch)
			out := ln.queue[:n:n]
			ln.queue, ln.sending = ln.queue[n:], n
			return out
		}
	}
	return nil
}

// batchable returns how many rows at the head of queue go together: up to
// limit of them, stopping before a barrier or a group, when at least
// minBatch do; else one.
func batchable(queue []*laneAck, limit int) int {
	n := 0
	for n < len(queue) && n < limit && queue[n].barrier == nil && queue[n].group == nil {
		n++
	}
	if n < minBatch {
		return 1
	}
	return n
}

// sent records the ack of a message add or resolved asked to send.
func (l *lanes) sent(a *laneAck, ack publish.Ack) {
	l.mu.Lock()
	a.ack = ack
	l.mu.Unlock()
}

// block withholds ln's queue and whatever its key is given next (see
// lanes); l.mu is held.
func (l *lanes) block(key string, ln *lane, why error) {
	if ln.blocked == nil {
		ln.blocked = why
		l.blocked[key] = ln
	}
	queue := ln.queue
	ln.queue = nil
	for _, a := range queue {
		if a.group != nil {
			l.failGroup(a.group, publish.Withheld, withheld(key, why).Err)
			continue
		}
		a.res = withheld(key, why)
	}
}

// deadLetter resolves the barrier a, its key's next row, as Invalid and
// blocks the key behind it; l.mu is held.
func (l *lanes) deadLetter(key string, ln *lane, a *laneAck) {
	a.res = publish.Result{Kind: publish.Invalid, Err: a.barrier}
	l.block(key, ln, fmt.Errorf("row %d was dead-lettered: %w", a.msg.Row.ID, a.barrier))
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
			if ln.unsettled <= 0 && ln.blocked == nil {
				delete(l.keys, o.Row.OrderingKey)
			}
		}
	}
	// A blocked lane whose rows are all settled goes once no claim that
	// began before that can still hand it rows.
	for key, ln := range l.blocked {
		if ln.unsettled > 0 {
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
