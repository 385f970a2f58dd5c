package event

import (
	"sync/atomic"
	"testing"
	"time"
)

func TestClockDoesNotStepBack(t *testing.T) {
	var offset atomic.Int64
	c := NewClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) })
	before := c.Now()
	offset.Store(int64(-time.Hour)) // the wall clock steps back an hour
	after := c.Now()
	if after.Before(before) {
		t.Fatalf("clock went back from %v to %v", before, after)
	}
	time.Sleep(40 * time.Millisecond)
	later := c.Now()
	if d := later.Sub(after); d < 20*time.Millisecond || d > time.Minute {
		t.Fatalf("during the step the clock advanced %v in 40ms of monotonic time; want half of it", d)
	}
	// Forward steps are followed at once.
	offset.Store(int64(2 * time.Hour))
	if d := c.Now().Sub(later); d < 119*time.Minute {
		t.Fatalf("a step forward of two hours (from an hour back) moved the clock %v", d)
	}
}

func TestClockMeetsTheWallClockAgain(t *testing.T) {
	var offset atomic.Int64
	c := NewClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) })
	c.Now()
	offset.Store(int64(-30 * time.Millisecond))
	deadline := time.Now().Add(5 * time.Second)
	for {
		now := c.Now()
		gap := now.Sub(time.Now().Add(time.Duration(offset.Load())))
		if gap <= time.Millisecond {
			return // back on the wall clock
		}
		if time.Now().After(deadline) {
			t.Fatalf("still %v ahead of the wall clock 5 s after a 30 ms step back", gap)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
