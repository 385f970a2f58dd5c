package relay_test

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// benchJetStream connects to a fresh in-process server whose stream the
// relay's configuration describes; the connection closes with b.
func benchJetStream(b *testing.B) (*publish.Conn, *publish.JetStream) {
	n := testenv.StartNATS(b)
	conn, err := publish.Connect(context.Background(), publish.ConnectOptions{URLs: n.URL(), Name: "bench"}, zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(conn.Close)
	js, err := publish.NewJetStream(conn, "EVENTS", 4000, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	want := streamsync.Want{Stream: "EVENTS", Subjects: []string{"events.>"}, DuplicateWindow: time.Hour, Replicas: 1, Create: true, SubjectPrefix: "events"}
	if _, err := streamsync.Sync(context.Background(), js.API(), want, streamsync.Options{}); err != nil {
		b.Fatal(err)
	}
	return conn, js
}

// BenchmarkPublishPipeline runs the relay's publish pipeline (publish
// async, await acks in order, settle) against an in-process JetStream
// server with rows from memory: the relay minus SQLite. ns/op is per row.
func BenchmarkPublishPipeline(b *testing.B) {
	_, js := benchJetStream(b)
	store := &testenv.MemStore{}
	store.AddN(b.N, "Bench", make([]byte, 256))
	r := relay.New(store, js, relay.Options{SubjectPrefix: "events", BatchSize: benchkit.EnvInt("BENCH_BATCH", 1000), MaxInFlight: benchkit.EnvInt("BENCH_IN_FLIGHT", 4000),
		PollInterval: time.Millisecond, MaxAttempts: 10, ShutdownTimeout: time.Second, SettleWindow: benchkit.EnvDuration("BENCH_SETTLE_WINDOW")})
	ctx, cancel := context.WithCancel(context.Background())
	b.ResetTimer()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	for n, _ := store.Settled(); n < b.N; n, _ = store.Settled() {
		time.Sleep(time.Millisecond)
	}
	b.StopTimer()
	cancel()
	<-done
}

// BenchmarkCeiling is the raw JetStream rate the relay is measured
// against, in process: the same messages published async, 4000 in flight.
func BenchmarkCeiling(b *testing.B) {
	conn, _ := benchJetStream(b)
	b.ResetTimer()
	if _, err := benchkit.Ceiling(context.Background(), conn.NC, "events.BenchEvent", b.N, 256, benchkit.EnvInt("BENCH_IN_FLIGHT", 4000)); err != nil {
		b.Fatal(err)
	}
}
