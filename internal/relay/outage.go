package relay

// Broker outages: pausing without spending attempts, probing, and the
// half-open trial that ends an outage.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// waitBroker waits until every in-flight row is settled, then probes the
// broker with a growing interval until it answers, and ends the outage. A
// connection closed for good is returned: no probe can succeed.
func (r *Relay) waitBroker(ctx context.Context) error {
	for r.inflight.Load() > 0 {
		// The settles may wait for a long time (the application holds the
		// lock); a connection closed for good ends the relay meanwhile, and
		// Run bounds the writes still to come (the rows stay pending).
		if err := r.pub.Ready(ctx); errors.Is(err, publish.ErrClosed) {
			return err
		}
		t := time.NewTimer(time.Second)
		ok := wait(ctx, r.settled, t.C)
		t.Stop()
		if !ok {
			return nil
		}
	}
	for ctx.Err() == nil {
		sleep(ctx, r.outage.probeDelay())
		err := r.probe(ctx)
		if err == nil {
			// Not over yet: the next publish tells (a full stream, say,
			// answers every probe and refuses every message).
			r.outage.probeOK()
			return nil
		}
		if errors.Is(err, publish.ErrClosed) {
			return err
		}
		r.outage.update(err)
	}
	return nil
}

// probe asks the broker whether it takes publishes.
func (r *Relay) probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return r.o.Ready(ctx)
}

// outageState tracks a broker outage; it is shared by the settler (which
// detects outages and their end) and the claimer (which waits them out).
// When a probe succeeds the outage is half open: the claimer publishes one
// row, and only a publish made after that which succeeds ends the outage.
type outageState struct {
	mu       sync.Mutex
	since    time.Time
	last     error
	repeats  int       // outages since the last successful publish
	open     time.Time // when the outage became half open; zero: closed
	probes   int       // probes since the outage began
	deferred int       // rows deferred since the outage began
}

// maxDefer is the longest an outage defers a row (see begin).
const maxDefer = time.Minute

// active reports an outage that is not half open: nothing may be claimed.
func (o *outageState) active() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return !o.since.IsZero() && o.open.IsZero()
}

// halfOpen reports an outage whose probe succeeded: one row may go.
func (o *outageState) halfOpen() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return !o.since.IsZero() && !o.open.IsZero()
}

func (o *outageState) err() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.since.IsZero() {
		return nil
	}
	what := "broker unavailable"
	if errors.Is(o.last, publish.ErrStreamRefusesAll) {
		what = "paused" // the broker answers; the stream refuses (sealed, say)
	}
	return fmt.Errorf("%s for %s: %v", what, time.Since(o.since).Round(time.Second), o.last)
}

// begin records a transport failure and returns how long the row waits
// before it may be claimed again: 1 s, doubling with every outage that
// follows without a successful publish in between, capped at one minute.
// A failure while half open closes the outage again, silently.
func (o *outageState) begin(err error, log *zap.Logger, m *metrics.Metrics) time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.last = err
	o.open = time.Time{}
	if o.since.IsZero() {
		o.since = time.Now()
		o.repeats++
		o.probes, o.deferred = 0, 0
		m.BrokerConnected.Set(0)
		log.Warn("broker unavailable; pausing without spending attempts", zap.Error(err))
	}
	return min(time.Second<<min(o.repeats-1, 6), maxDefer)
}

// deferRow records a row put back because of the outage and returns how
// long it waits (see begin).
func (o *outageState) deferRow(err error, log *zap.Logger, m *metrics.Metrics) time.Duration {
	d := o.begin(err, log, m)
	o.mu.Lock()
	o.deferred++
	o.mu.Unlock()
	return d
}

// nothingToTry ends a half-open outage when there is no row to try: none
// was deferred (the outage began with a probe, at startup say), or every
// deferred row would have been due by now (another relay took them).
func (o *outageState) nothingToTry(log *zap.Logger, m *metrics.Metrics) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.since.IsZero() || o.open.IsZero() || (o.deferred > 0 && time.Since(o.open) < maxDefer) {
		return
	}
	o.endLocked(log, m)
}

func (o *outageState) endLocked(log *zap.Logger, m *metrics.Metrics) {
	log.Info("broker recovered; resuming", zap.Duration("outage", time.Since(o.since).Round(time.Millisecond)))
	o.since, o.open, o.repeats = time.Time{}, time.Time{}, 0
	m.BrokerConnected.Set(1)
}

func (o *outageState) update(err error) {
	o.mu.Lock()
	o.last = err
	o.mu.Unlock()
}

// probeDelay is how long to wait before the next probe: none before the
// first of an outage, then 250 ms doubling to 5 s, also across half-open
// tries that failed.
func (o *outageState) probeDelay() time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.probes++
	if o.probes == 1 {
		return 0
	}
	return min(250*time.Millisecond<<min(o.probes-2, 5), 5*time.Second)
}

func (o *outageState) probeOK() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.since.IsZero() && o.open.IsZero() {
		o.open = time.Now()
	}
}

// answered records a publish made at published that the broker took or
// refused on its merits. It ends a half-open outage when the publish was
// made after it opened.
func (o *outageState) answered(published time.Time, log *zap.Logger, m *metrics.Metrics) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.since.IsZero() {
		o.repeats = 0
		return
	}
	if o.open.IsZero() || published.Before(o.open) {
		return
	}
	o.endLocked(log, m)
}
