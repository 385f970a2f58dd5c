package publish

// Atomic groups: the rows of one application transaction (an
// atomic_group), published as one atomic batch or not at all. Unlike a
// key's batch (PublishBatch), a group is never cut into parts and never
// published one message at a time, which would store a part of it should
// a later message fail: a message that fails fails the whole group.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
)

// ErrGroupsHeld marks the rows of an atomic group that the publisher held
// back because the stream takes no atomic batches: they stay pending, no
// attempt spent, until it does.
var ErrGroupsHeld = errors.New("the stream takes no atomic batches, so the rows of an atomic group are held rather than published in parts")

// GroupLimit returns how many rows an atomic group may hold: the
// server's batch limit, once a refusal said it; 0 while it is not known
// (a group is then sent and the server answers).
func (p *JetStream) GroupLimit() int {
	p.batchMu.Lock()
	defer p.batchMu.Unlock()
	return p.serverLimit
}

// PublishGroup starts publishing msgs, the rows of one atomic group in id
// order or of several (each group's rows together, in id order), and
// returns one Ack each. Each group goes whole in one atomic batch, and
// every row of a group gets the same outcome: all stored, or all not (see
// publishGroups).
func (p *JetStream) PublishGroup(ctx context.Context, msgs []Message) []Ack {
	b := &batch{done: make(chan struct{}), results: make([]Result, len(msgs))}
	acks := make([]Ack, len(msgs))
	for i := range msgs {
		acks[i] = batchAck{b, i}
	}
	go func() {
		defer close(b.done)
		p.publishGroups(context.WithoutCancel(ctx), msgs, b.results)
	}()
	return acks
}

// publishGroups publishes msgs, the rows of one or more atomic groups
// (each group's rows together), and fills results. Several groups share a
// batch, as many whole groups as the batch limit allows: a batch costs the
// server about the same whatever its size. A shared batch that fails
// because of one of its messages (the server names none) is published
// again one group a batch (publishGroup), so that each group gets its own
// outcome; one that fails on the connection fails every row alike.
func (p *JetStream) publishGroups(ctx context.Context, msgs []Message, results []Result) {
	var starts []int // where each group begins in msgs
	for i, m := range msgs {
		if i == 0 || m.Row.Group != msgs[i-1].Row.Group {
			starts = append(starts, i)
		}
	}
	starts = append(starts, len(msgs))
	limit := p.BatchLimit()
	for g := 0; g < len(starts)-1; {
		// Groups g..end-1 go together: the first whatever its size.
		end := g + 1
		for end < len(starts)-1 && starts[end+1]-starts[g] <= limit {
			end++
		}
		lo, hi := starts[g], starts[end]
		if end-g == 1 {
			p.publishGroup(ctx, msgs[lo:hi], results[lo:hi])
		} else {
			p.together(ctx, msgs[lo:hi], results[lo:hi], starts[g:end+1])
		}
		g = end
	}
}

// together publishes msgs, the rows of several groups (starts: where each
// begins, offset by starts[0], and where the last ends), as one atomic
// batch; see publishGroups. Only a failure one of the messages causes (a
// refused subject, a duplicate id, a row too large, a batch over the
// server's limit, a stream that refuses batches) sends the groups again a
// batch each; any other fails every row alike, at once.
func (p *JetStream) together(ctx context.Context, msgs []Message, results []Result, starts []int) {
	nmsgs := batchMsgs(msgs)
	if !p.allFit(ctx, nmsgs) {
		p.eachGroup(ctx, msgs, results, starts, metrics.FallbackTooLarge)
		return
	}
	p.startGroup()
	sent := time.Now()
	err := p.commitAll(ctx, msgs, nmsgs, sent, results)
	p.endBatch()
	if err == nil {
		return
	}
	var apiErr *jetstream.APIError
	code := jetstream.ErrorCode(0)
	if errors.As(err, &apiErr) {
		code = apiErr.ErrorCode
	}
	reason := ""
	switch {
	case code == batchTooLarge:
		// Kept to from now on; publishGroups cuts the groups again.
		p.lowerBatchLimit(apiErr, len(msgs))
		p.fellBack(metrics.FallbackTooLarge)
		p.publishGroups(ctx, msgs, results)
		return
	case code == batchDisabled:
		p.refuseBatches(err)
		reason = metrics.FallbackDisabled
	case code == batchDuplicate:
		reason = metrics.FallbackDuplicate
	case p.refusedRow(msgs, sent) >= 0, errors.Is(p.atLimit("", err), ErrSubjectFull):
		// A row refused, or a subject at its max_msgs_per_subject: a
		// group at a time, the groups before it go.
		reason = metrics.FallbackRefused
	case code == batchIncomplete || code == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		// No row refused: a row over a size limit lowered since it was
		// read (read again now), or else back-pressure.
		p.sizeRefused()
		if !p.allFit(ctx, nmsgs) {
			reason = metrics.FallbackTooLarge
		}
	}
	if reason != "" {
		p.eachGroup(ctx, msgs, results, starts, reason)
		return
	}
	if Classify(err) == Rejected && code != batchIncomplete && code != jetstream.JSErrCodeStreamMessageExceedsMaximum {
		for i := range results {
			results[i] = Result{Kind: Rejected, Err: err}
		}
		return
	}
	p.transportAll(msgs, results, err)
}

// transportAll fails every row of msgs with err, spending no attempt,
// explained where the stream refused the batch at a limit (see atLimit):
// a subject at its max_msgs_per_subject holds its rows alone.
func (p *JetStream) transportAll(msgs []Message, results []Result, err error) {
	for i := range results {
		results[i] = Result{Kind: Transport, Err: err}
		if why := p.atLimit(msgs[i].Subject, err); why != nil {
			results[i].Err = why
		}
	}
}

// eachGroup publishes the groups of msgs (see together) a batch each,
// counted as a fallback for reason.
func (p *JetStream) eachGroup(ctx context.Context, msgs []Message, results []Result, starts []int, reason string) {
	p.fellBack(reason)
	for g := 0; g < len(starts)-1; g++ {
		lo, hi := starts[g]-starts[0], starts[g+1]-starts[0]
		p.publishGroup(ctx, msgs[lo:hi], results[lo:hi])
	}
}

// publishGroup publishes msgs as one atomic batch and fills results:
//   - a group of one row is published as any row;
//   - while the stream takes no atomic batches, every row is Withheld
//     (ErrGroupsHeld);
//   - a group that can never be stored whole (more rows than the server's
//     limit, a row too large) is Invalid, row by row, saying why;
//   - a refused row (a denied subject) makes every row Rejected;
//   - a duplicate id (a group stored whole before a crash) is published
//     again one row at a time, so that each row gets its sequence;
//   - anything else (the connection, back-pressure, a message the stream
//     dropped for no refusal) is a Transport failure of every row: no
//     attempt spent.
func (p *JetStream) publishGroup(ctx context.Context, msgs []Message, results []Result) {
	all := func(res Result) {
		for i := range results {
			results[i] = res
		}
	}
	group := msgs[0].Row.Group
	if len(msgs) == 1 {
		p.oneByOne(ctx, msgs, results)
		return
	}
	if p.BatchLimit() == 0 {
		all(Result{Kind: Withheld, Err: fmt.Errorf("atomic group %q: %w", group, ErrGroupsHeld)})
		return
	}
	if limit := p.GroupLimit(); limit > 0 && len(msgs) > limit {
		all(Result{Kind: Invalid, Err: fmt.Errorf("atomic group %q has %d rows, more than the %d the server stores in one atomic batch: it can never be stored whole", group, len(msgs), limit)})
		return
	}
	nmsgs := batchMsgs(msgs)
	if res, ok := p.groupFits(ctx, msgs, nmsgs); !ok {
		all(res)
		return
	}
	p.startGroup()
	defer p.endBatch()
	sent := time.Now()
	err := p.commitAll(ctx, msgs, nmsgs, sent, results)
	if err == nil {
		return
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case batchTooLarge:
			p.lowerBatchLimit(apiErr, len(msgs))
			all(Result{Kind: Invalid, Err: fmt.Errorf("atomic group %q has %d rows, more than the server stores in one atomic batch: it can never be stored whole (%w)", group, len(msgs), err)})
			return
		case batchDisabled:
			p.refuseBatches(err)
			all(Result{Kind: Withheld, Err: fmt.Errorf("atomic group %q: %w", group, ErrGroupsHeld)})
			return
		case batchDuplicate:
			p.fellBack(metrics.FallbackDuplicate)
			p.oneByOne(ctx, msgs, results)
			return
		}
	}
	if i := p.refusedRow(msgs, sent); i >= 0 {
		why := fmt.Errorf("its row %d was refused: %w", msgs[i].Row.ID, deniedErr(msgs[i].Subject))
		all(Result{Kind: Rejected, Err: fmt.Errorf("atomic group %q was not stored: %w", group, why)})
		return
	}
	if errors.As(err, &apiErr) && (apiErr.ErrorCode == batchIncomplete || apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum) {
		// The stream dropped a message of the batch and no row was
		// refused: a row larger than a limit lowered since it was read
		// (read again now), or else too many batches in flight
		// (back-pressure).
		p.sizeRefused()
		if res, ok := p.groupFits(ctx, msgs, nmsgs); !ok {
			all(res)
			return
		}
		all(Result{Kind: Transport, Err: err})
		return
	}
	if Classify(err) == Rejected {
		all(Result{Kind: Rejected, Err: fmt.Errorf("atomic group %q was not stored: %w", group, err)})
		return
	}
	p.transportAll(msgs, results, err)
}

// groupFits reports whether every message of a group (nmsgs, msgs as
// batchMsgs made them) fits the server's and the stream's size limits;
// if not, the result of every row.
func (p *JetStream) groupFits(ctx context.Context, msgs []Message, nmsgs []*nats.Msg) (Result, bool) {
	for i, m := range nmsgs {
		if err := p.fits(ctx, m); err != nil {
			return Result{Kind: Invalid, Err: fmt.Errorf("atomic group %q cannot be stored whole: its row %d: %w", msgs[0].Row.Group, msgs[i].Row.ID, err)}, false
		}
	}
	return Result{}, true
}

// refusedRow returns the index of the first of msgs whose subject the
// server refused since sent, waiting up to refusalGrace for the refusal
// (the server reports it to the connection's error handler, which may run
// after the batch's answer), or -1.
func (p *JetStream) refusedRow(msgs []Message, sent time.Time) int {
	deadline := time.Now().Add(refusalGrace)
	for {
		for i, m := range msgs {
			if p.conn.deniedSince(m.Subject, sent) {
				return i
			}
		}
		if time.Now().After(deadline) {
			return -1
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// startGroup counts a group's batch in flight, waiting while as many are
// as the publisher allows: past that the server turns batches away
// (too many in flight), and a group cannot go one row at a time as a
// key's batch does. A batch that ends wakes one waiter (endBatch).
func (p *JetStream) startGroup() {
	p.batchMu.Lock()
	defer p.batchMu.Unlock()
	if p.batchEnded == nil {
		p.batchEnded = sync.NewCond(&p.batchMu)
	}
	for p.batchesOpen >= maxBatchesInFlight {
		p.batchEnded.Wait()
	}
	p.batchesOpen++
}
