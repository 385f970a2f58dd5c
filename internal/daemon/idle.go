package daemon

import (
	"time"
)

// Idle reports whether this relay may close its file for now: it leads,
// has claimed no row for after (nor since Open), has nothing in flight,
// no outage and no reconciliation, and no pending row comes due within
// after. wake is when the next pending row comes due (zero: none known).
// A fleet closes an idle file and opens it again on its next commit or
// at wake.
//
// A relay that stands by is never idle: it is there to take over while
// the file is busy. When the leader closes the file it leaves its lead,
// the standby leads, and closes the file in its turn once idle. Commits
// alone do not keep a file open: the relays' heartbeats are commits, and
// two relays would keep each other open for ever.
func (a *App) Idle(now time.Time, after time.Duration) (idle bool, wake time.Time) {
	if !a.relay.Leads() || a.relay.InFlight() > 0 || a.relay.Paused() != nil {
		return false, time.Time{}
	}
	if now.Sub(a.opened) < after || now.Sub(a.relay.LastClaim()) < after {
		return false, time.Time{}
	}
	if running, _ := a.relay.Reconciling(); running {
		return false, time.Time{}
	}
	quiet := a.claims.Quiet()
	if quiet.IsZero() || quiet.Before(now.Add(after)) {
		return false, time.Time{}
	}
	return true, quiet
}
