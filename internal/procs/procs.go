// Package procs runs the relay's Go code on one thread while it trickles
// and on as many as the runtime would give it while it drains a backlog.
//
// At a trickle each row wakes the relay a few times, and on a virtual
// machine most of its CPU goes to the Go runtime's handling of those
// wake-ups: its monitor thread's polls and the threads it starts to look
// for work that another thread already took. With GOMAXPROCS at 1 there
// is no other thread to start, and the relay uses about a sixth less CPU
// at 100 and at 1,000 rows a second (docs/performance.md). A drain runs
// Go code on several threads at once, so a claim that finds more due rows
// than it takes raises GOMAXPROCS back to the runtime's default at once,
// and so does a fleet opening a file: many files woken at once open side
// by side.
package procs

import (
	"context"
	"os"
	"runtime"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Hold is how long GOMAXPROCS stays at the default after the last claim
// that found a backlog.
const Hold = 2 * time.Second

// Governor sets GOMAXPROCS by what the relay's claims find. The nil
// Governor does nothing.
type Governor struct {
	last  atomic.Int64 // when a claim last found a backlog (Unix ns)
	wide  atomic.Bool  // GOMAXPROCS is the default
	raise chan struct{}
	// set sets GOMAXPROCS: to the runtime's default (wide), else to 1.
	set  func(wide bool)
	hold time.Duration
}

// New returns a Governor of this process's GOMAXPROCS, or nil when there
// is nothing to govern: the operator set GOMAXPROCS, or it is 1 already.
func New() *Governor {
	if os.Getenv("GOMAXPROCS") != "" || runtime.GOMAXPROCS(0) == 1 {
		return nil
	}
	return NewWith(func(wide bool) {
		if wide {
			runtime.SetDefaultGOMAXPROCS() // and its updates with the CPU quota
		} else {
			runtime.GOMAXPROCS(1)
		}
	}, Hold)
}

// NewWith returns a Governor that calls set instead of changing
// GOMAXPROCS, and waits hold instead of Hold (for tests).
func NewWith(set func(wide bool), hold time.Duration) *Governor {
	g := &Governor{raise: make(chan struct{}, 1), set: set, hold: hold}
	g.wide.Store(true)
	g.last.Store(time.Now().UnixNano())
	return g
}

// Backlog says that work is waiting: a claim found more due rows than it
// took, or a fleet is opening a file.
func (g *Governor) Backlog() {
	if g == nil {
		return
	}
	g.last.Store(time.Now().UnixNano())
	if !g.wide.Load() {
		select {
		case g.raise <- struct{}{}:
		default:
		}
	}
}

// Run sets GOMAXPROCS until ctx ends: to the default at once after a
// backlog, to 1 once no claim has found one for Hold, checked every
// check; each change is logged at debug level. It leaves the default
// behind.
func (g *Governor) Run(ctx context.Context, check time.Duration, log *zap.Logger) {
	if g == nil {
		return
	}
	t := time.NewTicker(check)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			if !g.wide.Load() {
				g.to(true, nil)
			}
			return
		case <-g.raise:
			if !g.wide.Load() {
				g.to(true, log)
			}
		case now := <-t.C:
			if g.wide.Load() && now.Sub(time.Unix(0, g.last.Load())) >= g.hold {
				g.to(false, log)
				if time.Unix(0, g.last.Load()).After(now) {
					g.to(true, log) // a backlog while it narrowed saw it wide
				}
			}
		}
	}
}

func (g *Governor) to(wide bool, log *zap.Logger) {
	g.wide.Store(wide) // first: a backlog from now on raises it again
	g.set(wide)
	if log == nil {
		return
	}
	if wide {
		log.Debug("a claim found a backlog: GOMAXPROCS back to the default", zap.Int("gomaxprocs", runtime.GOMAXPROCS(0)))
	} else {
		log.Debug("no claim found a backlog: GOMAXPROCS 1 until one does", zap.Duration("for", g.hold), zap.Int("gomaxprocs", runtime.GOMAXPROCS(0)))
	}
}

// Wide reports whether GOMAXPROCS is at the default.
func (g *Governor) Wide() bool { return g == nil || g.wide.Load() }
