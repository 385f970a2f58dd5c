package relay

// Small waiting helpers shared by the loops.

import (
	"context"
	"time"
)

// backoff doubles from min to max.
type backoff struct {
	min, max, cur time.Duration
}

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.min
	} else {
		b.cur = min(2*b.cur, b.max)
	}
	return b.cur
}

func (b *backoff) reset() { b.cur = 0 }

// signal sends on a one-slot channel without blocking.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// wait blocks until ch or timer fires (true) or ctx ends (false).
func wait(ctx context.Context, ch <-chan struct{}, timer <-chan time.Time) bool {
	select {
	case <-ctx.Done():
		return false
	case <-ch:
	case <-timer:
	}
	return true
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// isClosed reports whether ch, a channel that is only ever closed, is
// closed (false for nil).
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
