package metrics

import (
	"math"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Part is one database file's share of a gauge that sums over the files a
// relay serves (rows in flight, backlog, files led): Set sets the file's
// value and moves the gauge by the difference, so that with one file the
// gauge is that file's value and with a fleet it is the fleet's total.
// Safe for concurrent use.
type Part struct {
	g    prometheus.Gauge
	last atomic.Uint64 // float64 bits of the value this part added
}

// NewPart returns a part of g, at 0.
func NewPart(g prometheus.Gauge) *Part { return &Part{g: g} }

// Set makes v this part's share of the gauge.
func (p *Part) Set(v float64) {
	old := math.Float64frombits(p.last.Swap(math.Float64bits(v)))
	p.g.Add(v - old)
}

// Highest is a gauge that shows the highest of its parts' values (the
// oldest pending row's age over a fleet's files).
type Highest struct {
	g    prometheus.Gauge
	mu   sync.Mutex
	vals map[*HighPart]float64
	top  *HighPart // whose value the gauge shows
}

// NewHighest returns a Highest on g.
func NewHighest(g prometheus.Gauge) *Highest {
	return &Highest{g: g, vals: map[*HighPart]float64{}}
}

// HighPart is one file's value in a Highest.
type HighPart struct{ h *Highest }

// Part returns a new part of h, at 0.
func (h *Highest) Part() *HighPart { return &HighPart{h: h} }

// Set makes v this part's value.
func (p *HighPart) Set(v float64) {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	h.vals[p] = v
	switch {
	case h.top == p:
		for q, w := range h.vals { // the top may have gone down
			if w > h.vals[h.top] {
				h.top = q
			}
		}
	case h.top == nil || v >= h.vals[h.top]:
		h.top = p
	}
	h.g.Set(h.vals[h.top])
}

// Drop removes this part: the gauge shows the highest of the others.
func (p *HighPart) Drop() {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.vals, p)
	h.top = nil
	top := 0.0
	for q, w := range h.vals {
		if h.top == nil || w > top {
			h.top, top = q, w
		}
	}
	h.g.Set(top)
}
