package publish

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestStartEmbeddedOnAnAddressInUse: an embedded server asked to listen
// where another process listens fails at once saying so, with the
// address and what to do, instead of waiting for a server that cannot
// start.
func TestStartEmbeddedOnAnAddressInUse(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	addr := busy.Addr().String()
	e, err := StartEmbedded(addr, filepath.Join(t.TempDir(), "nats"))
	if err == nil {
		e.Shutdown()
		t.Fatalf("an embedded server started on %s, where another listener is", addr)
	}
	for _, want := range []string{addr, "address already in use", "nats.embedded.listen", "port 0"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// TestStartEmbeddedFailsAtOnceWhenJetStreamCannotStart: a store directory
// the server cannot create is reported with the server's own reason.
func TestStartEmbeddedFailsAtOnceWhenJetStreamCannotStart(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	e, err := StartEmbedded("127.0.0.1:0", filepath.Join(file, "nats"))
	if err == nil {
		e.Shutdown()
		t.Fatal("an embedded server started with its store under a file")
	}
	if !strings.Contains(err.Error(), "JetStream") || strings.Contains(err.Error(), "not ready after") {
		t.Errorf("error %q does not give the server's reason", err)
	}
}

// TestStartEmbeddedServesJetStream: on a free port the server takes
// connections.
func TestStartEmbeddedServesJetStream(t *testing.T) {
	e, err := StartEmbedded("127.0.0.1:0", filepath.Join(t.TempDir(), "nats"))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Shutdown()
	if !strings.HasPrefix(e.URL(), "nats://127.0.0.1:") || !e.Server.JetStreamEnabled() {
		t.Fatalf("server at %q, JetStream %v", e.URL(), e.Server.JetStreamEnabled())
	}
}
