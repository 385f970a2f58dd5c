package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// BenchmarkDrain measures the whole relay (claim, publish pipeline, settle)
// draining a backlog of 256-byte rows into an in-process JetStream server.
// Compare runs with benchstat; b.N rows per run.
func BenchmarkDrain(b *testing.B) {
	n := testenv.StartNATS(b)
	path := testenv.NewDB(b)
	s := testenv.OpenStore(b, path)
	if err := s.Seed(context.Background(), b.N, 256, event.StatusPending); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	h := startRelay(b, path, n.URL(), harnessOptions{batch: 1000, inFlight: 4000, mutateOpt: func(o *relay.Options) { o.StatsInterval = 5 * time.Second }})
	deadline := time.Now().Add(10 * time.Minute)
	for {
		drained, err := s.Drained(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		if drained {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("not drained")
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.StopTimer()
	h.stop()
}
