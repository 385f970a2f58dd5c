package publish

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Embedded is an in-process JetStream server, for nats.url "embedded", the
// demo, the bench and tests.
type Embedded struct {
	Server *server.Server
}

// embeddedReady bounds the wait for an embedded server that neither takes
// connections nor reports why it cannot.
const embeddedReady = 10 * time.Second

// StartEmbedded starts a JetStream server listening on the loopback address
// listen (port 0 picks a free port) with its data under storeDir. It fails
// at once, with the server's reason, when the server cannot start: listen
// already in use, a store directory it cannot create.
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
	} else if err := checkListen(listen); err != nil {
		return nil, err
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
	fatal := fatalLogger(make(chan string, 1))
	s.SetLogger(fatal, false, false)
	go s.Start()
	if err := waitReady(s, fatal); err != nil {
		s.Shutdown()
		s.WaitForShutdown()
		return nil, fmt.Errorf("start embedded nats on %s (data in %s): %w", listen, storeDir, err)
	}
	return &Embedded{Server: s}, nil
}

// checkListen reports, naming what to do, that another process listens on
// listen already. (The server would only log it, and never become ready.)
func checkListen(listen string) error {
	ln, err := net.Listen("tcp", listen)
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("start embedded nats: listen %s: address already in use: another process listens there (another demo or relay with an embedded server, or a nats-server); stop it, or set nats.embedded.listen (--nats-embedded-listen) to another address, or to port 0 for a free one", listen)
	}
	if err != nil {
		return fmt.Errorf("start embedded nats: listen %s: %w", listen, err)
	}
	return ln.Close()
}

// waitReady waits until s takes connections, or fails with the fatal error
// it logged (the server does not stop by itself then).
func waitReady(s *server.Server, fatal fatalLogger) error {
	deadline := time.Now().Add(embeddedReady)
	for !s.ReadyForConnections(50 * time.Millisecond) {
		select {
		case msg := <-fatal:
			return errors.New(msg)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %v", embeddedReady)
		}
	}
	return nil
}

// fatalLogger is the embedded server's logger: it keeps the first fatal
// error, for StartEmbedded to return, and drops every other line.
type fatalLogger chan string

func (l fatalLogger) Fatalf(format string, v ...any) {
	select {
	case l <- fmt.Sprintf(format, v...):
	default:
	}
}

func (fatalLogger) Noticef(string, ...any) {}
func (fatalLogger) Warnf(string, ...any)   {}
func (fatalLogger) Errorf(string, ...any)  {}
func (fatalLogger) Debugf(string, ...any)  {}
func (fatalLogger) Tracef(string, ...any)  {}

// URL is the client URL of the running server.
func (e *Embedded) URL() string { return e.Server.ClientURL() }

// Shutdown stops the server and waits for it.
func (e *Embedded) Shutdown() {
	e.Server.Shutdown()
	e.Server.WaitForShutdown()
}
