package ledger

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Event is one event as a handler sees it.
type Event struct {
	// ID is the event id (the outbox row's event_id, the message's
	// Nats-Msg-Id). outbox-relay gives every row one before publishing
	// it, so it is empty only for a message another publisher sent without
	// Nats-Msg-Id, or a row without event_id that a TableSource reads:
	// such an event runs its handlers without the ledger, on every
	// delivery.
	ID string
	// Type is the event type: the row's event_type, which the relay sends
	// as Outbox-Event-Type.
	Type string
	// Data is the payload.
	Data []byte
	// Delivery counts the deliveries of this event, 1 the first time: on
	// JetStream the message's delivery count (busy answers count), from
	// the table the row's attempts + 1 (only failures count).
	Delivery int
}

// HandlerFunc handles an event. An error fails this delivery: the claim is
// released and the event comes again after the retry backoff.
type HandlerFunc func(ctx context.Context, ev Event) error

// TxHandlerFunc handles an event inside tx, the transaction that marks the
// claim done: the handler's writes to the same SQLite file commit with the
// done mark, or not at all.
type TxHandlerFunc func(ctx context.Context, tx *sql.Tx, ev Event) error

type handler struct {
	name string
	fn   HandlerFunc
	tx   TxHandlerFunc
}

// Handlers maps event types to handlers and runs them through a Ledger.
// Register every handler before the first Dispatch.
type Handlers struct {
	l      *Ledger
	byType map[string][]handler
	names  map[string]bool
	m      *handlerMetrics
}

// NewHandlers returns an empty set of handlers on l. Its metrics are
// registered on reg (none when reg is nil):
//
//	outbox_ledger_handled_total{handler,outcome}
//	outbox_ledger_handler_duration_seconds{handler}
//	outbox_ledger_events_without_id_total
//
// outcome is handled, failed, skipped (done before), busy (claimed
// elsewhere), lost (the claim was taken over while the handler ran) or
// error (the ledger could not be read or written).
func NewHandlers(l *Ledger, reg prometheus.Registerer) (*Handlers, error) {
	h := &Handlers{l: l, byType: map[string][]handler{}, names: map[string]bool{}, m: newHandlerMetrics()}
	if reg != nil {
		if err := h.m.register(reg); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// Handle registers fn as the handler name of eventType. The name keys the
// handler's ledger rows: keep it stable across releases. Several handlers
// may handle one type, each with its own row; names are unique across
// types.
func (h *Handlers) Handle(eventType, name string, fn HandlerFunc) {
	h.add(eventType, handler{name: name, fn: fn})
}

// HandleTx registers fn like Handle, run in the transaction that marks the
// claim done (see TxHandlerFunc). Open the ledger's database with
// immediate transactions (go-sqlite3: _txlock=immediate), so that the
// transaction takes the write lock when it begins instead of failing to
// upgrade later. The transaction holds SQLite's write lock while fn runs:
// keep fn to its database writes, and do slow work in a Handle handler.
func (h *Handlers) HandleTx(eventType, name string, fn TxHandlerFunc) {
	h.add(eventType, handler{name: name, tx: fn})
}

func (h *Handlers) add(eventType string, hd handler) {
	if eventType == "" || hd.name == "" {
		panic("ledger: a handler needs an event type and a name")
	}
	if h.names[hd.name] {
		panic(fmt.Sprintf("ledger: handler %q registered twice", hd.name))
	}
	h.names[hd.name] = true
	h.byType[eventType] = append(h.byType[eventType], hd)
	h.m.handled.WithLabelValues(hd.name, "handled")
}

// Types lists the event types that have handlers, sorted.
func (h *Handlers) Types() []string {
	out := make([]string, 0, len(h.byType))
	for t := range h.byType {
		out = append(out, t)
	}
	slices.Sort(out)
	return out
}

// HandlerError is a handler's failure.
type HandlerError struct {
	Handler string // the handler's name ("ledger" for a ledger error)
	Err     error  // what it returned
}

// Error names the handler and its error.
func (e HandlerError) Error() string { return e.Handler + ": " + e.Err.Error() }

// Unwrap returns the handler's error.
func (e HandlerError) Unwrap() error { return e.Err }

// Verdict is what became of an event's handlers, for its source to
// acknowledge. With no failure and no BusyUntil, every handler has handled
// the event (now or before).
type Verdict struct {
	// Failed lists the handlers that failed this delivery; their claims
	// were released. Deliver the event again after the retry backoff.
	Failed []HandlerError
	// BusyUntil is set when another process holds a handler's claim:
	// deliver the event again at that time, the earliest the claim may be
	// taken over (its heartbeat stale, or its lease expired), whatever the
	// other process does.
	BusyUntil time.Time
	// Busy names the handlers whose claims are held elsewhere.
	Busy []string
}

// Done reports whether every handler has handled the event.
func (v Verdict) Done() bool { return len(v.Failed) == 0 && v.BusyUntil.IsZero() }

// Dispatch runs ev's handlers one after the other, in the order they were
// registered, each through its own claim. A failed handler does not stop
// the others. A busy one does: another delivery of the event holds its
// claim and runs the handlers after it, so they do not run here. An error
// means the ledger could not be read or written: the handlers from that
// one on did not run, and the event must come again (those that ran are
// done and are skipped then). An event with no handler is done.
//
// ctx is also the context of the done marks and releases: cancelled after
// a handler ran, it leaves that handler's claim unheartbeated, for another
// process to take over once it is stale (StaleAfter). Sources pass a
// context that outlives a graceful stop (context.WithoutCancel).
func (h *Handlers) Dispatch(ctx context.Context, ev Event) (Verdict, error) {
	return h.dispatch(ctx, ev, nil)
}

// dispatch is Dispatch that calls claimed, when set, each time a handler
// has taken its claim (the Worker's in-progress notices follow its lease).
func (h *Handlers) dispatch(ctx context.Context, ev Event, claimed func()) (Verdict, error) {
	var v Verdict
	hs := h.byType[ev.Type]
	if ev.ID == "" && len(hs) > 0 {
		h.m.withoutID.Inc()
	}
	for _, hd := range hs {
		outcome, err := h.run(ctx, hd, ev, &v, claimed)
		h.m.handled.WithLabelValues(hd.name, outcome).Inc()
		switch outcome {
		case "error":
			return v, err
		case "busy", "lost":
			// Another delivery of the event is running its handlers, in
			// the same order: leave the rest to it. Running them here too
			// would let each delivery find a claim of the other busy, and
			// both would put the event off until it could be taken over.
			return v, nil
		}
	}
	return v, nil
}

// run runs one handler for ev and returns its outcome label; failures and
// busy claims go into v. claimed, when set, is called once it holds the
// handler's claim.
func (h *Handlers) run(ctx context.Context, hd handler, ev Event, v *Verdict, claimed func()) (string, error) {
	if ev.ID == "" {
		// No id, no ledger row: the handler runs on every delivery (a
		// TxHandlerFunc in a transaction of its own).
		if err := h.callAlone(ctx, hd, ev); err != nil {
			return h.failed(ctx, hd, nil, v, err)
		}
		return "handled", nil
	}
	c, state, until, err := h.l.Claim(ctx, ev.ID, hd.name)
	switch {
	case err != nil:
		return "error", err
	case state == AlreadyDone:
		return "skipped", nil
	case state == Busy:
		v.busy(hd.name, until)
		return "busy", nil
	}
	if claimed != nil {
		claimed()
	}
	if hd.tx != nil {
		return h.runTx(ctx, hd, c, ev, v)
	}
	if err := h.call(ctx, hd, nil, ev); err != nil {
		return h.failed(ctx, hd, c, v, err)
	}
	if err := c.Done(ctx); errors.Is(err, ErrClaimLost) {
		// The handler's effect happened, and the process that took the
		// claim over runs it again: at least once, never lost. The
		// handlers after it did not run here: the event is not done
		// until that process has run them, so it comes again once its
		// claim could go stale, in case it does not finish.
		v.busy(hd.name, h.l.now().Add(h.l.staleAfter))
		return "lost", nil
	} else if err != nil {
		// The effect happened but is not recorded: the claim is no
		// longer heartbeated, and the next delivery finds it busy until
		// it is stale, then runs the handler again.
		return "error", err
	}
	return "handled", nil
}

// runTx runs a TxHandlerFunc and the done mark in one transaction.
func (h *Handlers) runTx(ctx context.Context, hd handler, c *Claim, ev Event, v *Verdict) (string, error) {
	err := h.callInTx(ctx, hd, ev, func(tx *sql.Tx) error { return c.DoneTx(ctx, tx) })
	switch {
	case errors.Is(err, ErrClaimLost):
		// Rolled back: the effect did not happen. The process that took
		// the claim over runs the handler; come again once its claim
		// could go stale, in case it does not finish.
		v.busy(hd.name, h.l.now().Add(h.l.staleAfter))
		return "lost", nil
	case err != nil:
		return h.failed(ctx, hd, c, v, err)
	}
	return "handled", nil
}

// failed records hd's failure in v, after releasing its claim c (nil:
// none) so that the next delivery claims it at once. A claim that cannot
// be released stays, no longer heartbeated: the event comes again and
// finds it busy until it is stale.
func (h *Handlers) failed(ctx context.Context, hd handler, c *Claim, v *Verdict, err error) (string, error) {
	if c != nil {
		if rerr := c.Release(ctx); rerr != nil && !errors.Is(rerr, ErrClaimLost) {
			err = errors.Join(err, rerr)
		}
	}
	v.Failed = append(v.Failed, HandlerError{Handler: hd.name, Err: err})
	return "failed", nil
}

// callInTx runs a TxHandlerFunc in a transaction of its own, then mark (if
// not nil) in the same transaction, and commits. The transaction has ended
// when it returns, so the caller may write on the pool's connection.
//
// SQLite rolls a whole transaction back by itself on some errors (an
// interrupted statement, SQLITE_FULL, SQLITE_IOERR, SQLITE_NOMEM), and the
// connection then writes each later statement in a transaction of its
// own. A handler that goes on after such an error and returns nil would
// have the done mark commit alone, without its effects. The handler runs
// inside a savepoint, released after it: a release that fails says the
// transaction is gone, and the handler has failed.
func (h *Handlers) callInTx(ctx context.Context, hd handler, ev Event, mark func(*sql.Tx) error) error {
	tx, err := h.l.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin the handler's transaction: %w", err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `SAVEPOINT outbox_ledger_handler`); err != nil {
		return fmt.Errorf("begin the handler's transaction: %w", err)
	}
	if err := h.call(ctx, hd, tx, ev); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `RELEASE outbox_ledger_handler`); err != nil {
		return fmt.Errorf("the handler's transaction was rolled back by SQLite (after an error the handler did not return?): %w", err)
	}
	if mark != nil {
		if err := mark(tx); err != nil {
			return err
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit the handler's transaction: %w", err)
	}
	return nil
}

// call runs the handler, timing it; a panic is the handler's failure.
func (h *Handlers) call(ctx context.Context, hd handler, tx *sql.Tx, ev Event) (err error) {
	start := time.Now()
	defer func() {
		h.m.duration.WithLabelValues(hd.name).Observe(time.Since(start).Seconds())
		if p := recover(); p != nil {
			err = fmt.Errorf("handler panicked: %v", p)
		}
	}()
	if hd.tx != nil {
		return hd.tx(ctx, tx, ev)
	}
	return hd.fn(ctx, ev)
}

// callAlone runs a handler without a claim; a TxHandlerFunc gets a
// transaction of its own, committed when it succeeds.
func (h *Handlers) callAlone(ctx context.Context, hd handler, ev Event) error {
	if hd.tx == nil {
		return h.call(ctx, hd, nil, ev)
	}
	return h.callInTx(ctx, hd, ev, nil)
}

// failures lists v's failed handlers and, when Dispatch returned err, the
// ledger's error under the name "ledger": what a source reports and
// retries.
func (v Verdict) failures(err error) []HandlerError {
	if err == nil {
		return v.Failed
	}
	return append(slices.Clip(v.Failed), HandlerError{Handler: "ledger", Err: err})
}

func (v *Verdict) busy(handler string, until time.Time) {
	v.Busy = append(v.Busy, handler)
	if until.After(v.BusyUntil) {
		v.BusyUntil = until
	}
}

type handlerMetrics struct {
	handled   *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	withoutID prometheus.Counter
}

func newHandlerMetrics() *handlerMetrics {
	return &handlerMetrics{
		handled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_ledger_handled_total",
			Help: "Handler runs by outcome: handled, failed, skipped, busy, lost, error.",
		}, []string{"handler", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "outbox_ledger_handler_duration_seconds",
			Help:    "How long handlers ran.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"handler"}),
		withoutID: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_ledger_events_without_id_total",
			Help: "Events with no event id, handled without the ledger.",
		}),
	}
}

func (m *handlerMetrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.handled, m.duration, m.withoutID} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("register ledger metrics: %w", err)
		}
	}
	return nil
}
