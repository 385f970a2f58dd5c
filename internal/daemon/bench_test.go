package daemon_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// BenchmarkDrain measures the whole relay (claim, publish pipeline, settle)
// draining a backlog of 256-byte rows into an in-process JetStream server.
// Compare runs with benchstat; b.N rows per run.
func BenchmarkDrain(b *testing.B) {
	n := testenv.StartNATS(b)
	path := testenv.NewDB(b)
	db := testenv.AppDB(b, path)
	if err := benchkit.Seed(context.Background(), db, "event_queue", b.N, 256, "pending"); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	batch, inFlight := envInt("BENCH_BATCH", 1000), envInt("BENCH_IN_FLIGHT", 4000)
	h := startRelay(b, path, n.URL(), harnessOptions{batch: batch, inFlight: inFlight,
		mutateOpt: func(o *relay.Options) { o.SettleWindow = envDuration("BENCH_SETTLE_WINDOW") },
		mutateKeeper: func(o *housekeeping.Options) {
			o.StatsInterval = 5 * time.Second
			if d := envDuration("BENCH_CHECKPOINT"); d > 0 {
				o.CheckpointInterval = d
			}
		}})
	deadline := time.Now().Add(10 * time.Minute)
	for {
		drained, err := benchkit.Drained(context.Background(), db, "event_queue")
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

// envDuration reads a duration knob for benchmark runs
// (BENCH_SETTLE_WINDOW, BENCH_CHECKPOINT; unset: 0).
func envDuration(name string) time.Duration {
	d, _ := time.ParseDuration(os.Getenv(name))
	return d
}

// envInt reads a tuning knob for benchmark runs (BENCH_BATCH, BENCH_IN_FLIGHT).
func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}
