package event

import (
	"sync"
	"time"
)

// Clock is the wall clock as the relay uses it for the times it writes and
// compares with the table (claims, due rows, retries): it follows the wall
// clock forward, but when the wall clock steps back (an NTP step, a VM
// restored from a snapshot) it does not follow; it goes on from where it was
// at the pace of the monotonic clock until the wall clock catches up. A step
// back therefore neither hides due rows nor stalls anything that waits for
// the next millisecond. Rows the application writes during such a step carry
// the earlier wall time and are simply due at once.
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
	// reading by the monotonic time since.
	c.last, c.mono = c.last.Add(m.Sub(c.mono)), m
	return c.last
}
