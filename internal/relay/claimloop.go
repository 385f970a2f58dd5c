package relay

// The claim loop: take due rows while there is room in flight, and start
// publishing them.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/natsname"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// claimLoop claims and publishes until ctx ends or the broker connection is
// gone for good (returned).
func (r *Relay) claimLoop(ctx context.Context) error {
	retry := backoff{min: 100 * time.Millisecond, max: 5 * time.Second}
	reconcileRetry := backoff{min: 500 * time.Millisecond, max: 30 * time.Second}
	// Claim nothing before the broker can take it: a missing stream or a
	// broker down at startup is an outage, not a reason to spend attempts.
	if err := r.probe(ctx); err != nil && ctx.Err() == nil {
		if errors.Is(err, publish.ErrClosed) {
			return err
		}
		r.outage.begin(err, r.log, r.m)
		r.started()
	} else if err == nil {
		r.m.BrokerConnected.Set(1)
	}
	for ctx.Err() == nil {
		if r.outage.active() {
			if err := r.waitBroker(ctx); err != nil {
				return err
			}
			if r.o.Reconcile != nil && r.pins.any() {
				// Rows whose publish got no answer may be stored: found
				// before they go again, however long the outage was.
				r.reconcileAsked.Add(1)
			}
			continue
		}
		if !r.leading.Load() && r.o.HeartbeatInterval > 0 {
			r.started()
			wait(ctx, r.led, nil) // a standby claims nothing
			continue
		}
		if !r.leadSure(ctx) {
			// Its row is gone, or unreadable: the heartbeat says next.
			wait(ctx, r.led, time.After(r.o.HeartbeatInterval))
			continue
		}
		if r.mustReconcile() {
			// Nothing is published before the rows published already
			// are found; then the loop looks again whether it leads.
			if err := r.reconcile(ctx, &reconcileRetry); err != nil {
				return err
			}
			continue
		}
		if r.outage.halfOpen() && r.inflight.Load() > 0 {
			wait(ctx, r.settled, nil) // the row on trial decides first
			continue
		}
		free := int64(r.o.MaxInFlight) - r.inflight.Load()
		if free <= 0 {
			wait(ctx, r.settled, nil)
			continue
		}
		// Payload is claimed again once a quarter of its budget is free
		// (see release): claims of a row or two at a time would cost a
		// read of the table each.
		freeBytes := int64(r.o.MaxInFlightBytes) - r.inflightBytes.Load()
		if r.o.MaxInFlightBytes > 0 && freeBytes < int64(r.o.MaxInFlightBytes)/4 && r.inflightBytes.Load() > 0 {
			wait(ctx, r.room, nil)
			continue
		}
		limit := min(int64(r.o.BatchSize), free)
		if r.outage.halfOpen() {
			limit = 1 // one row tells whether the broker takes publishes again
		}
		var maxBytes int64 // the claim reads no payload past the budget
		if r.o.MaxInFlightBytes > 0 {
			maxBytes = freeBytes
		}
		var got room // from the budget shared with other files' relays
		if r.o.Budget != nil {
			var ok bool
			if got, ok = r.o.Budget.take(ctx, limit, r.inflight.Load()); !ok {
				return nil
			}
			limit = got.rows
			if got.bytes > 0 && (maxBytes == 0 || got.bytes < maxBytes) {
				maxBytes = got.bytes
			}
		}
		seq := r.claimSeq.Add(1)
		rows, err := r.store.Claim(ctx, int(limit), maxBytes)
		r.started()
		bytes := event.PayloadBytes(rows)
		r.o.Budget.give(room{rows: got.rows - int64(len(rows)), bytes: got.bytes - bytes})
		if r.stopIfReplaced(err) {
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			r.claimTrouble.Fail(err)
			sleep(ctx, retry.next())
			continue
		}
		retry.reset()
		if len(rows) == 0 {
			// An empty claim may not have written (it looks first): it
			// proves nothing about the lock, but the database answered.
			r.claimTrouble.OKUnlessBusy()
			r.outage.nothingToTry(r.log, r.m)
			r.idle(ctx)
			continue
		}
		r.claimTrouble.OK()
		r.lastClaim.Store(time.Now().UnixNano())
		r.inFlightGauge.Set(float64(r.inflight.Add(int64(len(rows)))))
		r.inflightBytes.Add(bytes)
		r.pipeline.push(r.publish(ctx, rows, seq))
		if int64(len(rows)) < limit && (maxBytes == 0 || bytes < maxBytes) {
			// Caught up: wait for the next commit rather than spinning.
			r.idle(ctx)
		} else if r.o.Backlog != nil && len(rows) > 1 {
			// One row cut by the limits says little: a fleet's files
			// claiming at once may find the shared payload budget
			// taken for a moment, and each claim then reads one row.
			r.o.Backlog()
		}
	}
	return nil
}

// maxQuiet bounds how long an idle relay with a commit watch goes without
// claiming: the watch announces every commit, so the poll only has to find
// rows that came due, but a claim at least this often is cheap insurance.
const maxQuiet = time.Minute

// idle waits for a wake-up, the poll timer or the end; and for rows to
// settle when due rows wait for room in their ordering key. While the
// commit watch announces commits, the poll waits until a row comes due
// (Store.Quiet; at least PollInterval, at most maxQuiet): an idle claim
// walks every pending row, thousands where keys are parked.
func (r *Relay) idle(ctx context.Context) {
	var timer <-chan time.Time
	if r.o.PollInterval > 0 {
		d := r.o.PollInterval
		if r.watching.Load() {
			d = min(max(d, time.Until(r.store.Quiet())), max(d, maxQuiet))
		}
		t := time.NewTimer(d)
		defer t.Stop()
		timer = t.C
	}
	var settled chan struct{}
	if r.store.Waiting() {
		settled = r.settled
	}
	select {
	case <-ctx.Done():
	case <-r.wake:
	case <-settled:
	case <-timer:
	}
}

// publish starts publishing rows of claim seq: those without an ordering
// key in one go, those with one through their key's lane. A row that cannot be
// published (an event type that cannot form a subject, say) is
// dead-lettered without publishing, and stops its key's lane.
func (r *Relay) publish(ctx context.Context, rows []event.Row, seq uint64) *batch {
	b := &batch{msgs: make([]publish.Message, 0, len(rows)), published: time.Now(), floor: r.maxSeq.Load()}
	b.acks = make([]publish.Ack, 0, len(rows))
	nowAt := make([]int, 0, len(rows))      // indexes in b.msgs and b.acks of the rows sent in one go
	keyed := make([]*laneAck, 0, len(rows)) // of those, the rows with a key; nil for others
	groups := map[string][]*laneAck{}
	var ready []*laneAck // the rows of the groups that may go now
	for i, row := range rows {
		if row.Group != "" {
			// The claim takes a group's rows together: given to lanes as
			// one at its first row, each in its place in the batch.
			g, ok := groups[row.Group]
			if !ok {
				var send []*laneAck
				g, send = r.addGroup(rows[i:], seq)
				groups[row.Group] = g
				ready = append(ready, send...)
			}
			b.msgs = append(b.msgs, g[0].msg)
			b.acks = append(b.acks, g[0])
			groups[row.Group] = g[1:]
			continue
		}
		m, invalid := r.message(row)
		if invalid != nil && row.OrderingKey == "" {
			b.outcomes = append(b.outcomes, r.invalid(row, invalid))
			continue
		}
		// A keyed row that is invalid waits for its turn in its lane.
		b.msgs = append(b.msgs, m)
		var lane *laneAck
		if row.OrderingKey != "" {
			a, send := r.lanes.add(m, invalid, seq)
			if send == nil {
				b.acks = append(b.acks, a)
				continue
			}
			lane = a
		}
		nowAt = append(nowAt, len(b.acks))
		keyed = append(keyed, lane)
		b.acks = append(b.acks, lane)
	}
	r.sendGroup(ctx, ready) // together: a batch costs about the same whatever its size
	// b.msgs, when every row goes now (most claims): a copy of each
	// message otherwise.
	now := b.msgs
	if len(nowAt) < len(b.msgs) {
		now = make([]publish.Message, len(nowAt))
		for i, at := range nowAt {
			now[i] = b.msgs[at]
		}
	}
	if len(now) > 0 {
		for i, a := range r.pub.Publish(ctx, now) {
			if keyed[i] != nil {
				r.lanes.sent(keyed[i], a)
				continue
			}
			b.acks[nowAt[i]] = a
		}
	}
	return b
}

// addGroup gives lanes the atomic group of rows[0], whose other rows are
// among rows, and returns the group's acks, in id order, and its rows to
// send now if it may go now (see lanes.addGroup).
func (r *Relay) addGroup(rows []event.Row, seq uint64) (acks, send []*laneAck) {
	name := rows[0].Group
	var msgs []publish.Message
	var barrier error
	for _, row := range rows {
		if row.Group != name {
			continue
		}
		m, invalid := r.message(row)
		if invalid != nil && barrier == nil {
			barrier = fmt.Errorf("atomic group %q cannot be published: its row %d: %w", name, row.ID, invalid)
		}
		msgs = append(msgs, m)
	}
	return r.lanes.addGroup(msgs, barrier, seq)
}

// sendGroup sends the rows of atomic groups that lanes released (each
// group's rows together; none: does nothing), several groups in one
// batch where the publisher takes them. A publisher that takes no atomic
// batches holds each group, unless it is one row.
func (r *Relay) sendGroup(ctx context.Context, rows []*laneAck) {
	if len(rows) == 0 {
		return
	}
	msgs := make([]publish.Message, len(rows))
	for i, a := range rows {
		msgs[i] = a.msg
	}
	var acks []publish.Ack
	switch {
	case len(msgs) == 1: // all or none already
		acks = r.pub.Publish(ctx, msgs)
	case r.batcher != nil:
		acks = r.batcher.PublishGroup(ctx, msgs)
		r.m.AtomicBatches.Inc()
	default:
		for i, m := range msgs {
			if i+1 < len(msgs) && msgs[i+1].Row.Group == m.Row.Group || i > 0 && msgs[i-1].Row.Group == m.Row.Group {
				acks = append(acks, knownAck{Kind: publish.Withheld, Err: fmt.Errorf("atomic group %q: %w", m.Row.Group, publish.ErrGroupsHeld)})
				continue
			}
			acks = append(acks, r.pub.Publish(ctx, msgs[i:i+1])[0]) // a group of one row
		}
	}
	for i, a := range rows {
		r.lanes.sent(a, acks[i])
	}
}

// knownAck is an outcome known without publishing.
type knownAck publish.Result

func (k knownAck) Wait(context.Context) publish.Result { return publish.Result(k) }

// invalid returns the outcome of a row that can never be published as it
// is, and logs it.
func (r *Relay) invalid(row event.Row, why error) event.Outcome {
	r.log.Warn("dead-lettered invalid row", zap.Int64("row_id", row.ID), zap.String("event_id", row.EventID), zap.String("reason", why.Error()))
	o := event.Invalid(row, why.Error())
	if errors.Is(why, publish.ErrTooLarge) {
		o.Reason = event.DeadLetterTooLarge
	}
	return o
}

// message returns the message to publish for row, or why the row cannot
// be published as it is.
// (A row too large for the broker is found by the publisher, which knows
// the limits.)
func (r *Relay) message(row event.Row) (publish.Message, error) {
	m := publish.Message{Row: row}
	if row.Problem != "" {
		return m, errors.New(row.Problem)
	}
	subject, err := natsname.Subjects{Prefix: r.o.SubjectPrefix, Suffix: r.o.SubjectSuffix}.Of(row.EventType)
	if err != nil {
		return m, err
	}
	if err := event.ValidateEventID(row.EventID); err != nil {
		return m, err
	}
	if err := event.ValidateCreatedAt(row.CreatedAt); err != nil {
		return m, err
	}
	if row.OrderingKey != "" {
		if err := event.ValidateOrderingKey(row.OrderingKey); err != nil {
			return m, err
		}
	}
	headers, err := event.ParseHeaders(row.Headers, r.reserved...)
	if err != nil {
		return m, err
	}
	if err := r.o.Format.CheckHeaders(headers); err != nil {
		return m, err
	}
	m.Subject, m.Headers, m.Format = subject, headers, r.o.Format
	return m, nil
}

// stopIfReplaced ends the claim loop when err says the database file was
// replaced (Run then returns it and writes nothing more), and reports it.
func (r *Relay) stopIfReplaced(err error) bool {
	if !errors.Is(err, event.ErrDatabaseReplaced) {
		return false
	}
	r.halt(err)
	return true
}
