package publish

import (
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Embedded is an in-process JetStream server, for nats.url "embedded", the
// demo, the bench and tests.
type Embedded struct {
	Server *server.Server
}

// StartEmbedded starts a JetStream server listening on the loopback address
// listen (port 0 picks a free port) with its data under storeDir.
func StartEmbedded(listen, storeDir string) (*Embedded, error) {
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("start embedded nats: listen %q: %w", listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("start embedded nats: listen %q: bad port", listen)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	opts := &server.Options{
		ServerName: "outbox-relay-embedded",
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   storeDir,
		NoLog:      true,
		NoSigs:     true,
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("start embedded nats: %w", err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, fmt.Errorf("start embedded nats on %s: not ready after 10s", listen)
	}
	return &Embedded{Server: s}, nil
}

// URL is the client URL of the running server.
func (e *Embedded) URL() string { return e.Server.ClientURL() }

// Shutdown stops the server and waits for it.
func (e *Embedded) Shutdown() {
	e.Server.Shutdown()
	e.Server.WaitForShutdown()
}
