package daemon

import (
	"context"
	"time"
)

// noteForeign wraps the relay's commit watch so that lastForeign follows
// the commits of other connections (the application, another relay).
func (a *App) noteForeign(watch func(ctx context.Context, interval time.Duration, foreign chan<- struct{}, any ...chan<- struct{}) error) func(ctx context.Context, interval time.Duration, foreign chan<- struct{}, any ...chan<- struct{}) error {
	a.lastForeign.Store(time.Now().UnixNano())
	if watch == nil {
		return nil
	}
	return func(ctx context.Context, interval time.Duration, foreign chan<- struct{}, any ...chan<- struct{}) error {
		seen := make(chan struct{}, 1)
		done := make(chan struct{})
		defer close(done)
		go func() {
			for {
				select {
				case <-done:
					return
				case <-seen:
					a.lastForeign.Store(time.Now().UnixNano())
					select {
					case foreign <- struct{}{}:
					default:
					}
				}
			}
		}()
		return watch(ctx, interval, seen, any...)
	}
}

// Idle reports whether the file has been quiet for after: no commit by
// another connection, nothing in flight, no outage, and, where this relay
// leads, no pending row due before after from now. wake is when the next
// pending row comes due (zero: none known). A fleet closes an idle file
// and opens it again on its next commit or at wake.
func (a *App) Idle(now time.Time, after time.Duration) (idle bool, wake time.Time) {
	if now.Sub(time.Unix(0, a.lastForeign.Load())) < after || a.relay.InFlight() > 0 || a.relay.Paused() != nil {
		return false, time.Time{}
	}
	if running, _ := a.relay.Reconciling(); running {
		return false, time.Time{}
	}
	if !a.relay.Leads() {
		return true, time.Time{} // the leader's commits (heartbeats) keep a standby open
	}
	quiet := a.claims.Quiet()
	if quiet.IsZero() || quiet.Before(now.Add(after)) {
		return false, time.Time{}
	}
	return true, quiet
}
