package relay

// The heartbeat: being visibly alive on the file, taking back a dead
// claimer's rows, and following who leads.

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// firstHeartbeat registers this relay, retrying database errors until it
// succeeds (nil) or ctx ends; a file this process cannot write, or one
// replaced since it was opened, is returned at once. Rows it reclaims
// from dead claimers are counted like every later reclaim.
func (r *Relay) firstHeartbeat(ctx context.Context) error {
	retry := backoff{min: 100 * time.Millisecond, max: 5 * time.Second}
	for {
		n, err := r.beat(ctx)
		if err == nil {
			r.beatTrouble.OK()
			r.reclaimed(n)
			r.lead()
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, event.ErrNotWritable) || errors.Is(err, event.ErrDatabaseReplaced) {
			return err // waiting will not make the file writable, or bring the old one back
		}
		r.beatTrouble.Fail(err)
		sleep(ctx, retry.next())
	}
}

// beat heartbeats with the rows in flight, and notes when it committed.
func (r *Relay) beat(ctx context.Context) (reclaimed int64, err error) {
	reclaimed, err = r.o.Lead.Heartbeat(ctx, r.o.Version, int(r.inflight.Load()), r.o.Lease, r.o.StaleAfter)
	if err == nil {
		r.beaten.Store(int64(time.Since(monoBase)))
	}
	return reclaimed, err
}

// reclaimed counts and logs rows a heartbeat made claimable again, and
// has the next claim look for them.
func (r *Relay) reclaimed(n int64) {
	if n > 0 {
		r.log.Info("took back processing rows of an expired lease or a stopped claimer", zap.Int64("rows", n))
		r.m.LeasesReclaimed.Add(float64(n))
		r.store.Rescan()
		r.wakeClaimer()
	}
}

// heartbeatLoop keeps this instance visibly alive and reclaims the claims
// of dead relays and expired leases.
func (r *Relay) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(r.o.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := r.beat(ctx)
		if r.stopIfReplaced(err) {
			continue
		}
		if err != nil {
			if ctx.Err() == nil {
				r.beatTrouble.Fail(err)
			}
			continue
		}
		r.beatTrouble.OK()
		r.reclaimed(n)
		r.lead()
	}
}

// lead follows the store's answer to who leads, logging changes.
func (r *Relay) lead() {
	leads := r.o.Lead.Leads()
	said := r.roleSaid.Swap(true)
	changed := r.leading.Swap(leads) != leads || !said
	if leads {
		signal(r.led) // the claim loop may wait for a heartbeat (see leadSure)
	}
	if !changed {
		return
	}
	if leads {
		r.leaderGauge.Set(1)
		r.log.Info("leading: this relay claims and publishes the rows")
		r.wakeClaimer() // idle after a claim its heartbeat row fenced, say
		return
	}
	r.leaderGauge.Set(0)
	r.reconcileAsked.Add(1) // whoever leads meanwhile publishes
	r.log.Info("standing by: another relay of this outbox table leads")
}

// monoBase is the origin of Relay.beaten: durations since it are read on
// the monotonic clock, which runs on while the process is stopped.
var monoBase = time.Now()

// leadSure reports whether this relay may publish: its latest heartbeat
// said it leads, and that still holds. A relay stopped (SIGSTOP) past the
// staleness may have been judged dead and its lead taken meanwhile:
// resumed, it would claim and publish on the lead it had before the stop.
// So once the latest heartbeat that committed is older than half the time
// after which others judge a relay dead, the lead is read again from the
// table, without the write lock: the application may hold it, and rows due
// meanwhile still go out while this relay's row is there and first.
func (r *Relay) leadSure(ctx context.Context) bool {
	if r.o.HeartbeatInterval == 0 {
		return true
	}
	if !r.o.Lead.Leads() {
		return false // the latest heartbeat said another relay leads
	}
	if r.o.StaleAfter <= 0 || time.Since(monoBase)-time.Duration(r.beaten.Load()) <= r.o.StaleAfter/2 {
		return true
	}
	leads, err := r.o.Lead.StillLeads(ctx)
	return err == nil && leads
}
