package publish

// Atomic batches (JetStream's atomic batch publish, nats-server 2.12 and
// later, on a stream with allow_atomic): several rows of one ordering key
// stored all or none, in consecutive stream sequences, for one
// acknowledgement. A batch that fails because of one of its messages (a
// refusal, a duplicate id, a message too large) is published again one
// message at a time, in order, so that each row gets its own outcome as
// if it had never been batched: the rows before the faulty one are stored
// once, the faulty one gets its own result, and the rows after it are
// withheld.

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
)

// MaxBatch is the most messages the relay puts in one atomic batch: the
// server's default limit (jetstream { limits { batch { max_msgs } } }). A
// server with a lower limit says so when it refuses a batch, and the
// publisher keeps to it from then on.
const MaxBatch = 1000

// maxBatchesInFlight is how many atomic batches the publisher has in
// flight at most (the server's default limit is 50 a stream, 1,000 a
// server, shared with other publishers): more do not store faster, and past
// it a key's rows go one at a time until a batch ends. A batch the server
// refuses for too many in flight is published one message at a time.
const maxBatchesInFlight = 8

// The JetStream error codes of atomic batches.
const (
	batchDisabled jetstream.ErrorCode = 10174 // the stream does not allow atomic publish
	// A message of the batch never reached the stream: refused (a denied
	// subject), or the first one, when the server holds too many batches in
	// flight (10210, which a first message sent without a reply subject
	// cannot tell).
	batchIncomplete jetstream.ErrorCode = 10176
	batchTooLarge   jetstream.ErrorCode = 10199 // more messages than the server's limit, which the description gives
	batchDuplicate  jetstream.ErrorCode = 10201 // a message's Nats-Msg-Id is in the stream already
)

// batchIDPlaceholder stands for a batch id (a nuid) in the size guard.
const batchIDPlaceholder = "0123456789012345678901"

// batchLimitRe reads the server's limit from a batchTooLarge refusal
// ("atomic publish batch is too large: 1000").
var batchLimitRe = regexp.MustCompile(`too large: (\d+)`)

// EnableBatches lets PublishBatch publish up to limit messages (at most
// MaxBatch) as one atomic batch: call it once the stream allows atomic
// publish (0 turns batches off). Without it, or after the stream refused a
// batch as disabled, BatchLimit is 0 and PublishBatch publishes one
// message at a time.
func (p *JetStream) EnableBatches(limit int) {
	p.batchMu.Lock()
	defer p.batchMu.Unlock()
	p.batchLimit, p.batchesOff = min(max(limit, 0), MaxBatch), nil
}

// BatchLimit returns how many messages an atomic batch holds at most; 0
// when the stream takes no atomic batches.
func (p *JetStream) BatchLimit() int {
	p.batchMu.Lock()
	defer p.batchMu.Unlock()
	return p.batchLimit
}

// BatchRoom returns how many messages a batch sent now may hold: the
// limit, or 0 while as many batches are in flight as the publisher allows
// (or batches are off).
func (p *JetStream) BatchRoom() int {
	p.batchMu.Lock()
	defer p.batchMu.Unlock()
	if p.batchesOpen >= maxBatchesInFlight {
		return 0
	}
	return p.batchLimit
}

// BatchesOff says why the publisher stopped publishing atomic batches
// after they were enabled (nil: it did not).
func (p *JetStream) BatchesOff() error {
	p.batchMu.Lock()
	defer p.batchMu.Unlock()
	return p.batchesOff
}

// refuseBatches turns atomic batches off: the stream no longer allows
// them (an operator turned allow_atomic off). Logged once.
func (p *JetStream) refuseBatches(err error) {
	p.batchMu.Lock()
	was := p.batchLimit
	p.batchLimit = 0
	p.batchesOff = fmt.Errorf("stream %s refused an atomic batch (allow_atomic is off): an ordering key's rows go one at a time until the relay restarts (%w)", p.stream, err)
	p.batchMu.Unlock()
	if was > 0 {
		p.conn.log.Warn("the stream refuses atomic batches; publishing ordered rows one at a time", zap.String("stream", p.stream), zap.Error(err))
	}
}

// lowerBatchLimit keeps to the server's batch limit, read from its
// refusal of a larger batch.
func (p *JetStream) lowerBatchLimit(apiErr *jetstream.APIError, size int) {
	limit, said := size/2, 0
	if m := batchLimitRe.FindStringSubmatch(apiErr.Description); m != nil {
		if n, err := strconv.Atoi(m[1]); err == nil && n < size {
			limit, said = n, n
		}
	}
	p.batchMu.Lock()
	p.batchLimit = min(p.batchLimit, limit)
	if said > 0 {
		p.serverLimit = said
	}
	p.batchMu.Unlock()
	p.conn.log.Warn("the server's atomic batches are smaller; keeping to its limit", zap.Int("limit", limit), zap.String("reason", apiErr.Description))
}

// batch is one atomic batch on its way: results is filled, one per
// message, before done is closed.
type batch struct {
	done    chan struct{}
	results []Result
}

// batchAck is the outcome of one message of a batch.
type batchAck struct {
	b *batch
	i int
}

func (a batchAck) Wait(ctx context.Context) Result {
	select {
	case <-a.b.done: // a known result first: the rows of a batch end alike
		return a.b.results[a.i]
	default:
	}
	select {
	case <-a.b.done:
		return a.b.results[a.i]
	case <-ctx.Done():
		return Result{Kind: Transport, Err: ctx.Err()}
	}
}

// PublishBatch starts publishing msgs as one atomic batch and returns one
// Ack each. Messages more than the server takes in a batch go as several
// batches in turn. When atomic batches are off (BatchLimit 0), or a
// message is larger than the server or the stream takes, the messages are
// published one at a time instead, each after the one before it was
// stored (see the comment at the top of this file).
func (p *JetStream) PublishBatch(ctx context.Context, msgs []Message) []Ack {
	b := &batch{done: make(chan struct{}), results: make([]Result, len(msgs))}
	acks := make([]Ack, len(msgs))
	for i := range msgs {
		acks[i] = batchAck{b, i}
	}
	p.batchMu.Lock()
	p.batchesOpen++ // before it starts: BatchRoom counts it at once
	p.batchMu.Unlock()
	go p.runBatch(context.WithoutCancel(ctx), msgs, b)
	return acks
}

// runBatch publishes b's messages and fills its results.
func (p *JetStream) runBatch(ctx context.Context, msgs []Message, b *batch) {
	defer func() {
		p.endBatch()
		close(b.done)
	}()
	p.publishAtomic(ctx, msgs, b.results)
}

// endBatch counts a batch in flight as ended, and wakes a group waiting
// for room (see startGroup).
func (p *JetStream) endBatch() {
	p.batchMu.Lock()
	defer p.batchMu.Unlock()
	p.batchesOpen--
	if p.batchEnded != nil {
		p.batchEnded.Signal()
	}
}

// publishAtomic publishes msgs as one atomic batch, or as several in turn
// when they are more than the server takes, and fills results.
func (p *JetStream) publishAtomic(ctx context.Context, msgs []Message, results []Result) {
	if limit := p.BatchLimit(); len(msgs) > limit {
		p.inParts(ctx, msgs, results, limit)
		return
	}
	nmsgs := batchMsgs(msgs)
	if len(msgs) < 2 {
		p.oneByOne(ctx, msgs, results)
		return
	}
	if !p.allFit(ctx, nmsgs) {
		p.fellBack(metrics.FallbackTooLarge)
		p.oneByOne(ctx, msgs, results)
		return
	}
	sent := time.Now()
	err := p.commitAll(ctx, msgs, nmsgs, sent, results)
	if err == nil {
		return
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == batchTooLarge {
		p.lowerBatchLimit(apiErr, len(msgs))
		p.inParts(ctx, msgs, results, p.BatchLimit())
		return
	}
	if reason := p.byMessage(err, msgs, sent); reason != "" {
		p.fellBack(reason)
		p.oneByOne(ctx, msgs, results)
		return
	}
	res := p.classify(msgs[len(msgs)-1].Subject, sent, err)
	if res.Kind != Transport {
		res = Result{Kind: Transport, Err: err}
	}
	for i := range results {
		results[i] = res
	}
}

// inParts publishes msgs as atomic batches of at most limit messages in
// turn (one at a time below 2), each once the one before it was stored
// whole, and fills results: after a part that was not, the rest are
// withheld (or fail alike, when the broker did not answer).
func (p *JetStream) inParts(ctx context.Context, msgs []Message, results []Result, limit int) {
	if limit < 2 {
		p.oneByOne(ctx, msgs, results)
		return
	}
	for start := 0; start < len(msgs); start += limit {
		end := min(start+limit, len(msgs))
		p.publishAtomic(ctx, msgs[start:end], results[start:end])
		last := results[end-1]
		if last.Kind == Stored || last.Kind == Duplicate {
			continue
		}
		rest := last
		if rest.Kind != Transport {
			rest = Result{Kind: Withheld, Err: fmt.Errorf("row %d before it was not stored (%s)", msgs[end-1].Row.ID, last.Kind)}
		}
		for i := end; i < len(msgs); i++ {
			results[i] = rest
		}
		return
	}
}

// batchMsgs returns msgs as the messages of one atomic batch.
func batchMsgs(msgs []Message) []*nats.Msg {
	nmsgs := make([]*nats.Msg, len(msgs))
	for i, m := range msgs {
		nmsgs[i] = NewMsg(m)
		// The batch's own headers count towards a message's size: set as
		// long as PublishMsgBatch sets them (a nuid is 22 characters), so
		// that the size guard sees them.
		nmsgs[i].Header.Set(jetstreamext.BatchIDHeader, batchIDPlaceholder)
		nmsgs[i].Header.Set(jetstreamext.BatchSeqHeader, strconv.Itoa(i+1))
	}
	nmsgs[len(nmsgs)-1].Header.Set(jetstreamext.BatchCommitHeader, "1")
	return nmsgs
}

// commitAll publishes nmsgs (msgs, as batchMsgs made them) as one atomic
// batch sent at sent and, once it is stored, fills results with each
// message's sequence; else it returns why not.
func (p *JetStream) commitAll(ctx context.Context, msgs []Message, nmsgs []*nats.Msg, sent time.Time, results []Result) error {
	ack, err := p.commit(ctx, nmsgs)
	if err != nil {
		return err
	}
	if err := p.elsewhere(ack.Stream); err != nil {
		return err
	}
	if ack.BatchSize != uint64(len(msgs)) || ack.Sequence < ack.BatchSize {
		return fmt.Errorf("%w: the batch's acknowledgement counts %d messages ending at sequence %d, %d were sent", jetstream.ErrInvalidJSAck, ack.BatchSize, ack.Sequence, len(msgs))
	}
	first := ack.Sequence - ack.BatchSize + 1
	for i, m := range msgs {
		p.conn.stored(m.Subject, sent)
		results[i] = Result{Kind: Stored, Seq: first + uint64(i)}
	}
	return nil
}

// commit sends msgs as one atomic batch and waits for its
// acknowledgement (relay.ack_timeout at most), or for the server to refuse
// the last message's subject, which it would not answer.
func (p *JetStream) commit(ctx context.Context, msgs []*nats.Msg) (*jetstreamext.BatchAck, error) {
	ctx, cancel := context.WithTimeout(ctx, p.ackTimeout)
	defer cancel()
	refused := p.conn.refused(msgs[len(msgs)-1].Subject, time.Now())
	go func() {
		select {
		case <-refused:
			cancel()
		case <-ctx.Done():
		}
	}()
	// Every message but the last goes without a reply subject: the whole
	// batch costs one round trip.
	return jetstreamext.PublishMsgBatch(ctx, p.js, msgs, jetstreamext.BatchFlowControl{AckFirst: false, AckTimeout: p.ackTimeout})
}

// byMessage returns why a batch failed because of one of its messages (a
// refusal, a duplicate id, a size), so that publishing them one at a time
// finds which and gives each row its own outcome; "" for the other
// failures (the connection, the stream, back-pressure), which are every
// row's alike.
func (p *JetStream) byMessage(err error, msgs []Message, sent time.Time) string {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case batchDisabled:
			p.refuseBatches(err)
			return metrics.FallbackDisabled
		case batchIncomplete:
			return metrics.FallbackIncomplete
		case batchDuplicate:
			return metrics.FallbackDuplicate
		case storeFailed:
			if errors.Is(p.atLimit("", err), ErrSubjectFull) {
				// A subject at its max_msgs_per_subject: one at a time,
				// the rows before it go, and only it is held.
				return metrics.FallbackRefused
			}
		}
	} else {
		for _, m := range msgs {
			if p.conn.deniedSince(m.Subject, sent) {
				return metrics.FallbackRefused
			}
		}
	}
	// The client's own refusals (a message over max_payload) are a
	// message's too.
	if Classify(err) == Rejected {
		return metrics.FallbackRefused
	}
	return ""
}

// fellBack counts a batch published again one message at a time.
func (p *JetStream) fellBack(reason string) {
	if p.OnFallback != nil {
		p.OnFallback(reason)
	}
}

// oneByOne publishes msgs one at a time, each once the one before it was
// stored, and fills results: after the first message that was not stored
// (nor a duplicate), the rest are withheld.
func (p *JetStream) oneByOne(ctx context.Context, msgs []Message, results []Result) {
	for i, m := range msgs {
		res := p.Publish(ctx, []Message{m})[0].Wait(ctx)
		results[i] = res
		if res.Kind == Stored || res.Kind == Duplicate {
			continue
		}
		why := fmt.Errorf("row %d before it in the batch was not stored (%s)", m.Row.ID, res.Kind)
		for j := i + 1; j < len(msgs); j++ {
			results[j] = Result{Kind: Withheld, Err: why}
		}
		return
	}
}

// allFit reports whether every message fits the server's and the stream's
// size limits (see fits).
func (p *JetStream) allFit(ctx context.Context, msgs []*nats.Msg) bool {
	for _, m := range msgs {
		if p.fits(ctx, m) != nil {
			return false
		}
	}
	return true
}

// batchState is the JetStream publisher's atomic batch settings.
type batchState struct {
	batchMu     sync.Mutex
	batchLimit  int   // messages an atomic batch holds at most; 0: no batches
	batchesOff  error // why batches were turned off after they were enabled
	batchesOpen int   // batches in flight
	// serverLimit is the server's batch limit once a refusal said it (0:
	// not known). Atomic groups are held to it, never to batchLimit: a
	// group is not cut.
	serverLimit int
	batchEnded  *sync.Cond // signalled when a batch ends (nil: no group ever waited)
}
