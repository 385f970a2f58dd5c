package event

import (
	"sync"
	"time"
)

// ClockSkew is how far the application's clock, as created_at tells it,
// may be ahead of the relay's and the broker's: a row is taken to have
// been written no earlier than its created_at less ClockSkew.
const ClockSkew = 5 * time.Minute

// Clock is the time by which the relay decides that a row is due, and
// times retries and deferrals. It follows the wall clock forward, but when
// the wall clock steps back (an NTP step, a VM restored from a snapshot) it
// does not follow: it goes on from where it was at half the monotonic pace,
// so it meets the wall clock again after twice the step (an hour's step is
// absorbed in two hours). Meanwhile no row that was due stops being due,
// nothing waits for the wall clock to pass an earlier reading, and rows the
// application writes carry the earlier wall time and are due at once; a row
// scheduled less than the remaining gap ahead may go out that much early.
type Clock struct {
	wall func() time.Time

	mu   sync.Mutex
	last time.Time // the latest reading returned
	mono time.Time // time.Now() when last was returned (monotonic)
}

// NewClock returns a clock over wall (time.Now when nil).
func NewClock(wall func() time.Time) *Clock {
	if wall == nil {
		wall = time.Now
	}
	return &Clock{wall: wall}
}

// Now returns the current time, never earlier than a previous reading.
func (c *Clock) Now() time.Time {
	w, m := c.wall().Round(0), time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mono.IsZero() || !w.Before(c.last) {
		c.last, c.mono = w, m
		return w
	}
	// The wall clock is behind a reading already given out: advance that
	// reading at half the monotonic pace, closing the gap.
	next := c.last.Add(m.Sub(c.mono) / 2)
	if w.After(next) {
		next = w
	}
	c.last, c.mono = next, m
	return next
}
