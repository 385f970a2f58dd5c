package metrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func value(t *testing.T, g prometheus.Gauge) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

func TestPartsSumAndTheHighestShows(t *testing.T) {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g"})
	a, b := NewPart(g), NewPart(g)
	a.Set(3)
	b.Set(4)
	a.Set(1)
	if got := value(t, g); got != 5 {
		t.Fatalf("parts 1 and 4: gauge %v, want 5", got)
	}
	b.Set(0)
	if got := value(t, g); got != 1 {
		t.Fatalf("parts 1 and 0: gauge %v, want 1", got)
	}

	hg := prometheus.NewGauge(prometheus.GaugeOpts{Name: "h"})
	h := NewHighest(hg)
	x, y, z := h.Part(), h.Part(), h.Part()
	x.Set(10)
	y.Set(30)
	z.Set(20)
	if got := value(t, hg); got != 30 {
		t.Fatalf("10, 30, 20: gauge %v, want 30", got)
	}
	y.Set(5) // the top goes down
	if got := value(t, hg); got != 20 {
		t.Fatalf("10, 5, 20: gauge %v, want 20", got)
	}
	z.Drop()
	if got := value(t, hg); got != 10 {
		t.Fatalf("10, 5: gauge %v, want 10", got)
	}
}
