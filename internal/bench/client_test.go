package bench

import (
	"context"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// TestSyncClient: the one-PubAck-at-a-time yardstick, against the server
// the bench embeds, stores exactly the messages it was asked for, each
// with its own Nats-Msg-Id and the payload's size, and reports their rate.
func TestSyncClient(t *testing.T) {
	ctx := context.Background()
	srv, err := publish.StartEmbedded("127.0.0.1:0", filepath.Join(t.TempDir(), "nats"))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// A dedup window, as the bench's streams have: messages sharing an id
	// would be dropped, and the count would say so.
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "SYNC", Subjects: []string{"sync.>"}, Duplicates: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	const n, size = 300, 64
	run, err := SyncClient(nc, "sync.BenchEvent", n, size)
	if err != nil {
		t.Fatal(err)
	}
	if run.Messages != n || run.Seconds <= 0 || run.MsgsPerSec <= 0 {
		t.Fatalf("run %+v; want %d messages, a time and a rate", run, n)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != n {
		t.Fatalf("the stream holds %d messages; want %d", info.State.Msgs, n)
	}
	last, err := st.GetLastMsgForSubject(ctx, "sync.BenchEvent")
	if err != nil {
		t.Fatal(err)
	}
	if id := last.Header.Get(jetstream.MsgIDHeader); id != "bench-sync-client-"+strconv.Itoa(n-1) || len(last.Data) != size {
		t.Fatalf("last message: %s %q, %d bytes; want the %d-th id, %d bytes", jetstream.MsgIDHeader, id, len(last.Data), n, size)
	}
}
