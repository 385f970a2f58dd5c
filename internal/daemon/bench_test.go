package daemon_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// BenchmarkDrain measures the whole relay (claim, publish pipeline, settle)
// draining a backlog of 256-byte rows (BENCH_SIZE bytes) into an
// in-process JetStream server, marking them done (deleting them with
// BENCH_DELETE_DONE=1), over BENCH_KEYS ordering keys (0: none). Compare runs with benchstat; b.N rows per run.
func BenchmarkDrain(b *testing.B) {
	n := testenv.StartNATS(b)
	path := testenv.NewDB(b)
	db := testenv.AppDB(b, path)
	if err := benchkit.Seed(context.Background(), db, "event_queue", b.N, benchkit.EnvInt("BENCH_SIZE", 256), "pending",
		benchkit.Keys(benchkit.EnvInt("BENCH_KEYS", 0))); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	batch, inFlight := benchkit.EnvInt("BENCH_BATCH", 1000), benchkit.EnvInt("BENCH_IN_FLIGHT", 4000)
	doneRows := config.DoneRowsKeep
	if benchkit.EnvInt("BENCH_DELETE_DONE", 0) == 1 {
		doneRows = config.DoneRowsDelete
	}
	h := startRelay(b, path, n.URL(), harnessOptions{batch: batch, inFlight: inFlight, doneRows: doneRows,
		mutateOpt: func(o *relay.Options) { o.SettleWindow = benchkit.EnvDuration("BENCH_SETTLE_WINDOW") },
		mutateKeeper: func(o *housekeeping.Options) {
			o.StatsInterval = 5 * time.Second
			if d := benchkit.EnvDuration("BENCH_CHECKPOINT"); d > 0 {
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
