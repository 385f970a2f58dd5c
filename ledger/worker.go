package ledger

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/episode"
	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Backoff is the retry schedule every source applies after a failed
// delivery: 5 s after the first, doubling per delivery, at most 300 s. The
// relay retries broker rejections on the same schedule.
func Backoff(deliveries int) time.Duration { return event.RetryBackoff(deliveries) }

// WorkerOptions tune a Worker.
type WorkerOptions struct {
	// SubjectPrefix is the relay's stream.subject_prefix. An event's type
	// is its message's Outbox-Event-Type header, which the relay always
	// sends; for a message without one, the subject after "<prefix>.".
	// Required.
	SubjectPrefix string
	// Concurrency is how many messages are handled at once (1 when 0).
	Concurrency int
	// Backoff is the delay before the next delivery after a failed one
	// (the package's Backoff when nil).
	Backoff func(deliveries int) time.Duration
	// Log receives the worker's log lines (none when nil).
	Log *zap.Logger
}

// Worker feeds Handlers from a durable JetStream pull consumer and
// acknowledges each message by its Verdict:
//
//   - every handler done or skipped: Ack;
//   - a handler's claim held elsewhere: NakWithDelay until that claim may
//     be taken over (its holder's heartbeat stale, or its lease expired),
//     and not before the retry backoff (a live holder spends one delivery
//     a backoff step, not one every StaleAfter);
//   - a handler failed, or the ledger could not be read: NakWithDelay by
//     the retry backoff;
//   - on the consumer's last delivery (max_deliver), a failure or a busy
//     claim is logged as "event exhausted max deliveries" at error level,
//     with the event id, the handler and the error, and the message is
//     Nak'ed: JetStream keeps it, and outbox-relay records the server's
//     advisory.
//
// While a message's handlers run, the worker tells the server every half
// ack_wait that it is in progress, so that a handler may take longer than
// ack_wait without its message being delivered again; it does so for at
// most the Ledger's Lease after a handler took its claim, after which
// another process may take that claim over.
type Worker struct {
	cons       jetstream.Consumer
	h          *Handlers
	o          WorkerOptions
	maxDeliver atomic.Int64 // the consumer's max_deliver (see followConsumer)
	ackWait    atomic.Int64 // the shortest wait for an ack it allows, ns (see ackWaitOf)
	log        *zap.Logger
}

// consumerRefresh is how often a running worker reads the consumer's
// max_deliver and ack_wait again.
const consumerRefresh = 30 * time.Second

// NewWorker returns a Worker on cons, a durable pull consumer on the
// relay's stream (outbox-relay creates it with consumer.create; its
// max_deliver is relay.max_attempts) with explicit acknowledgements: a
// consumer with another ack policy is refused. A running worker follows a
// change of max_deliver or ack_wait within 30 s.
func NewWorker(cons jetstream.Consumer, h *Handlers, o WorkerOptions) (*Worker, error) {
	if o.SubjectPrefix == "" {
		return nil, errors.New("ledger worker: SubjectPrefix is required (the relay's stream.subject_prefix)")
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 1
	}
	if o.Backoff == nil {
		o.Backoff = Backoff
	}
	info := cons.CachedInfo()
	if info == nil {
		return nil, errors.New("ledger worker: the consumer has no info; get it with jetstream.Stream.Consumer")
	}
	if p := info.Config.AckPolicy; p != jetstream.AckExplicitPolicy {
		// With AckAll a later message's Ack acknowledges a failed one's
		// Nak away; with AckNone nothing is delivered again.
		return nil, fmt.Errorf("ledger worker: consumer %s acknowledges with %s; the worker needs explicit acknowledgements (ack_policy explicit), or failed events are not delivered again", info.Name, p)
	}
	w := &Worker{cons: cons, h: h, o: o, log: o.Log}
	w.follow(info)
	if w.log == nil {
		w.log = zap.NewNop()
	}
	w.log = w.log.With(zap.String("stream", info.Stream), zap.String("consumer", info.Name))
	return w, nil
}

// Run handles messages until ctx ends, then stops fetching, lets the
// handlers that are running finish, and returns nil. A message fetched
// but not started is Nak'ed, so that another worker gets it at once. It
// returns an error when the messages stop without ctx ending (the
// consumer or its stream was deleted, the connection closed for good).
//
// Each of the Concurrency slots fetches one message when it is free and
// handles it: nothing is fetched ahead, so a message's ack_wait runs
// while its handler does, not while it waits for a slot.
func (w *Worker) Run(ctx context.Context) error {
	followCtx, stopFollowing := context.WithCancel(ctx)
	followed := make(chan struct{})
	go func() { defer close(followed); w.followConsumer(followCtx, consumerRefresh) }()
	defer func() { stopFollowing(); <-followed }()
	slotsCtx, stopSlots := context.WithCancel(ctx)
	defer stopSlots()
	away := episode.New(w.log, zap.WarnLevel, "cannot fetch messages; trying again", "fetching messages again")
	var (
		running sync.WaitGroup
		once    sync.Once
		failed  error
	)
	for range w.o.Concurrency {
		running.Add(1)
		go func() {
			defer running.Done()
			if err := w.slot(slotsCtx, away); err != nil {
				once.Do(func() { failed = err; stopSlots() })
			}
		}()
	}
	running.Wait()
	if failed != nil && ctx.Err() == nil {
		return fmt.Errorf("ledger worker: %w", failed)
	}
	return nil
}

// pullExpiry is how long a slot's pull waits for a message. A pull is
// not cut short when the worker stops (a message the server sends to a
// pull cut short would wait out ack_wait): a stop waits for it, and Naks
// what it brings. A consumer deleted under a waiting pull is told at
// once, one deleted between pulls at the next.
const pullExpiry = time.Second

// slot fetches a message and handles it, one after another, until ctx
// ends (nil) or the messages stop for good (the error).
func (w *Worker) slot(ctx context.Context, away *episode.Log) error {
	for ctx.Err() == nil {
		msg, err := w.next()
		if ctx.Err() != nil {
			if msg != nil {
				_ = msg.Nak() // not started: deliver it elsewhere at once
			}
			return nil
		}
		switch {
		case err == nil:
			away.OK()
			// Handlers finish even when ctx ends: a graceful stop does
			// not cut a handler off half way.
			w.handle(context.WithoutCancel(ctx), msg)
		case errors.Is(err, nats.ErrTimeout):
			// No message within the pull's expiry; with the server away
			// too, so this ends no episode of trouble.
		case gone(err):
			return err
		default:
			// No responders (the consumer gone, or the server starting),
			// a connection lost (nats.go reconnects): ask, then wait.
			if _, ierr := w.cons.Info(ctx); gone(ierr) {
				return ierr
			}
			away.Fail(err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
	return nil
}

// next fetches one message, waiting up to pullExpiry.
func (w *Worker) next() (jetstream.Msg, error) {
	return w.cons.Next(jetstream.FetchMaxWait(pullExpiry))
}

// gone reports an error that says the messages stop for good: the
// consumer or its stream deleted, the connection closed.
func gone(err error) bool {
	return errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) ||
		errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, nats.ErrConnectionClosed)
}

// eventType is a message's event type: its Outbox-Event-Type header, or,
// for a message without one (not the relay's), its subject after
// "<SubjectPrefix>.".
func (w *Worker) eventType(msg jetstream.Msg) string {
	if t := msg.Headers().Get(event.HeaderEventType); t != "" {
		return t
	}
	return strings.TrimPrefix(msg.Subject(), w.o.SubjectPrefix+".")
}

// handle dispatches one message and acknowledges it.
func (w *Worker) handle(ctx context.Context, msg jetstream.Msg) {
	delivery := 1
	if md, err := msg.Metadata(); err == nil {
		delivery = int(md.NumDelivered)
	}
	ev := Event{
		ID:       msg.Headers().Get(jetstream.MsgIDHeader),
		Type:     w.eventType(msg),
		Data:     msg.Data(),
		Delivery: delivery,
	}
	log := w.log.With(zap.String("event_id", ev.ID), zap.String("event_type", ev.Type), zap.Int("delivery", delivery))
	stop, claimed := w.inProgress(msg, log)
	v, err := w.h.dispatch(ctx, ev, claimed)
	stop()
	failed := v.failures(err)
	if len(failed) == 0 && !v.BusyUntil.IsZero() {
		if !w.last(delivery) {
			wait := max(time.Until(v.BusyUntil), w.o.Backoff(delivery))
			log.Info("handler busy elsewhere; delivering again when its claim may be taken over", zap.Duration("delay", wait))
			w.ack(log, msg.NakWithDelay(wait))
			return
		}
		// A busy answer spends a delivery too; on the last one the
		// handler never runs for this message unless someone acts.
		for _, name := range v.Busy {
			failed = append(failed, HandlerError{Handler: name, Err: fmt.Errorf("claimed by another process until %s", v.BusyUntil.Format(time.RFC3339))})
		}
	}
	if len(failed) == 0 {
		w.ack(log, msg.Ack())
		return
	}
	if w.last(delivery) {
		for _, f := range failed {
			log.Error("event exhausted max deliveries", zap.String("handler", f.Handler), zap.Int64("max_deliver", w.maxDeliver.Load()), zap.Error(f.Err))
		}
		w.ack(log, msg.Nak())
		return
	}
	wait := w.o.Backoff(delivery)
	for _, f := range failed {
		log.Warn("handler failed; delivering again after the backoff", zap.String("handler", f.Handler), zap.Duration("delay", wait), zap.Error(f.Err))
	}
	w.ack(log, msg.NakWithDelay(wait))
}

// last reports whether delivery is the consumer's last (max_deliver).
func (w *Worker) last(delivery int) bool {
	n := w.maxDeliver.Load()
	return n > 0 && int64(delivery) >= n
}

// followConsumer reads the consumer's configuration every interval until
// ctx ends: outbox-relay reconciles max_deliver and ack_wait with
// relay.max_attempts and consumer.ack_wait at its start, the last delivery
// is the one that reports an exhausted event, and ack_wait sets how often
// a running handler's message is said to be in progress.
func (w *Worker) followConsumer(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if info, err := w.cons.Info(ctx); err == nil {
			w.follow(info)
		}
	}
}

// follow keeps what the worker uses of the consumer's configuration.
func (w *Worker) follow(info *jetstream.ConsumerInfo) {
	w.maxDeliver.Store(int64(info.Config.MaxDeliver))
	w.ackWait.Store(int64(ackWaitOf(info.Config)))
}

// ackWaitOf is the shortest time the consumer waits for a delivery's
// acknowledgement: ack_wait, or the shortest step of its backoff, which
// replaces ack_wait where it is set.
func ackWaitOf(c jetstream.ConsumerConfig) time.Duration {
	wait := c.AckWait
	if wait <= 0 {
		wait = 30 * time.Second // the server's default
	}
	for _, b := range c.BackOff {
		if b > 0 {
			wait = min(wait, b)
		}
	}
	return wait
}

// inProgress tells the server that msg is being worked on every half
// ack_wait (as last read, see followConsumer) until stop is called, and
// for at most the Ledger's Lease after the latest claim its handlers took
// (claimed is called at each): a handler that runs that long may have its
// claim taken over by another process, which needs the message delivered
// again.
func (w *Worker) inProgress(msg jetstream.Msg, log *zap.Logger) (stop, claimed func()) {
	done, finished, fresh := make(chan struct{}), make(chan struct{}), make(chan struct{}, 1)
	every := func() time.Duration { return max(time.Duration(w.ackWait.Load())/2, time.Millisecond) }
	go func() {
		defer close(finished)
		d := every()
		t := time.NewTicker(d)
		defer t.Stop()
		lease := time.NewTimer(w.h.l.lease)
		defer lease.Stop()
		for {
			select {
			case <-done:
				return
			case <-fresh:
				lease.Reset(w.h.l.lease)
			case <-lease.C:
				log.Warn("a handler still running after the ledger's lease; the message is no longer kept in progress, and is delivered again after ack_wait", zap.Duration("lease", w.h.l.lease))
				return
			case <-t.C:
				if err := msg.InProgress(); err != nil {
					log.Debug("tell the server the message is in progress", zap.Error(err))
				}
				if n := every(); n != d {
					d = n
					t.Reset(d)
				}
			}
		}
	}()
	stop = func() { close(done); <-finished }
	claimed = func() {
		select {
		case fresh <- struct{}{}:
		default:
		}
	}
	return stop, claimed
}

func (w *Worker) ack(log *zap.Logger, err error) {
	if err != nil {
		log.Warn("acknowledge message", zap.Error(err))
	}
}
