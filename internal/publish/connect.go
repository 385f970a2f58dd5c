// Package publish is everything NATS on the relay's publish path: the
// connection, the embedded server, the JetStream and core publishers, and
// the classification of every publish outcome as stored, transport failure
// or rejection. It takes its settings as options of its own
// (ConnectOptions), which the composition root fills from the
// configuration.
package publish

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/natsname"
)

// Conn is the relay's NATS connection. It reconnects forever, fails publishes
// fast while disconnected (no reconnect buffer), and remembers the subjects
// the server refused for lack of permission, which the server reports only
// to the connection's error handler.
type Conn struct {
	NC  *nats.Conn
	log *zap.Logger

	mu      sync.Mutex
	denied  map[string]time.Time     // subject -> when the server last refused it
	refusal map[string]chan struct{} // subject -> closed at its next refusal (see denied.go)
	// lastStored: subject -> when the latest message the stream stored
	// on it was sent.
	lastStored map[string]time.Time
	closing    atomic.Bool // Close was called: closing is expected
}

// ErrClosed is returned by Ready when the connection is closed for good
// (nats.go gives up on some server errors): nothing will reconnect it.
var ErrClosed = errors.New("nats connection closed")

// ErrAuth marks a connection error that retrying cannot fix (credentials,
// certificates): the relay exits instead of waiting forever. The error's
// own text says which it is; a TLS failure also matches ErrTLS.
var ErrAuth = errors.New("nats refused the connection")

// ErrTLS marks a connection that failed in the TLS handshake (a server
// certificate the relay does not trust, a client certificate the server
// wants or refuses). Such an error matches ErrAuth too.
var ErrTLS = errors.New("nats TLS handshake failed")

// Connect connects to the comma-separated servers of o.URLs with the
// credentials and TLS settings of o. When no server answers it returns a
// connection that keeps trying in the background, so the relay can start
// paused; a credential or certificate problem is returned as an error
// wrapping ErrAuth (and ErrTLS for a TLS one) whose text names what was
// sent and what to check.
func Connect(ctx context.Context, o ConnectOptions, log *zap.Logger) (*Conn, error) {
	c, opts, err := connectOnce(o, log)
	if err == nil {
		return c, nil
	}
	if c == nil {
		return nil, err // bad options or credentials: waiting will not help
	}
	log.Warn("nats unavailable at startup; starting paused and reconnecting in the background",
		zap.String("url", natsname.RedactURLs(o.URLs)), zap.Error(err))
	// Only a connection made in the background needs the callback; a
	// connection made here is logged here (callbacks run after Connect
	// returns, when a short-lived command may be gone).
	nc, err := nats.Connect(o.URLs, append(opts, nats.RetryOnFailedConnect(true), nats.ConnectHandler(func(nc *nats.Conn) {
		if !c.closing.Load() {
			c.log.Info("nats connected", zap.String("server", natsname.RedactURLs(nc.ConnectedUrl())))
		}
	}))...)
	if err != nil {
		return nil, fmt.Errorf("connect to nats %s: %w", natsname.RedactURLs(o.URLs), err)
	}
	c.NC = nc
	return c, nil
}

// ConnectOnce connects like Connect but fails when no server answers now:
// for commands that do one thing and exit.
func ConnectOnce(ctx context.Context, o ConnectOptions, log *zap.Logger) (*Conn, error) {
	c, _, err := connectOnce(o, log)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// connectOnce tries the servers once. On failure it returns the Conn and
// options for a retrying attempt (nil when the options themselves are wrong).
func connectOnce(o ConnectOptions, log *zap.Logger) (*Conn, []nats.Option, error) {
	c := &Conn{log: log, denied: map[string]time.Time{}, refusal: map[string]chan struct{}{}, lastStored: map[string]time.Time{}}
	opts, err := c.options(o)
	if err != nil {
		return nil, nil, err
	}
	nc, err := nats.Connect(o.URLs, opts...)
	if err == nil {
		c.NC = nc
		log.Info("nats connected", zap.String("server", natsname.RedactURLs(nc.ConnectedUrl())))
		return c, opts, nil
	}
	if r := refusal(err, o); r != nil {
		return nil, opts, fmt.Errorf("connect to nats %s: %w", natsname.RedactURLs(o.URLs), r)
	}
	return c, opts, fmt.Errorf("connect to nats %s: %w", natsname.RedactURLs(o.URLs), err)
}

func (c *Conn) options(cfg ConnectOptions) ([]nats.Option, error) {
	opts := []nats.Option{
		nats.Name(cfg.Name),
		nats.Timeout(5 * time.Second),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(time.Second),
		nats.ReconnectJitter(500*time.Millisecond, time.Second),
		// Publishes made while disconnected fail at once instead of being
		// buffered and silently lost if the connection closes.
		nats.ReconnectBufSize(-1),
		nats.PingInterval(10 * time.Second),
		nats.MaxPingsOutstanding(3),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if !c.closing.Load() {
				c.log.Info("nats disconnected", zap.Error(err))
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			c.log.Info("nats reconnected", zap.String("server", natsname.RedactURLs(nc.ConnectedUrl())))
		}),
		nats.ClosedHandler(func(nc *nats.Conn) {
			if !c.closing.Load() {
				c.log.Error("nats connection closed by the client library; the relay cannot publish any more", zap.NamedError("last_error", nc.LastError()))
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { c.asyncError(err) }),
	}
	if err := checkFiles(cfg); err != nil {
		return nil, err
	}
	opts = append(opts, c.tlsOptions(cfg.TLS)...)
	auth, err := authOption(cfg)
	if err != nil {
		return nil, err
	}
	if auth != nil {
		opts = append(opts, auth)
	}
	return opts, nil
}

// tlsOptions are the options of the client side of TLS.
func (c *Conn) tlsOptions(cfg TLSOptions) []nats.Option {
	var opts []nats.Option
	if cfg.CA != "" {
		opts = append(opts, nats.RootCAs(cfg.CA))
	}
	if cfg.Cert != "" {
		opts = append(opts, nats.ClientCert(cfg.Cert, cfg.Key))
	}
	if cfg.InsecureSkipVerify {
		c.log.Warn("nats.tls.insecure_skip_verify is set: the server's certificate is not verified")
		opts = append(opts, func(o *nats.Options) error {
			o.Secure = true
			if o.TLSConfig == nil {
				o.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
			}
			o.TLSConfig.InsecureSkipVerify = true
			return nil
		})
	}
	if cfg.HandshakeFirst {
		opts = append(opts, nats.TLSHandshakeFirst())
	}
	return opts
}

// authOption is the option that sends the one credential cfg sets, or nil
// for none.
func authOption(cfg ConnectOptions) (nats.Option, error) {
	switch {
	case cfg.Creds != "":
		return nats.UserCredentials(cfg.Creds), nil
	case cfg.NKey != "":
		o, err := nats.NkeyOptionFromSeed(cfg.NKey)
		if err != nil {
			return nil, fmt.Errorf("%s: read seed file %s: %w", label(cfg, "nats.nkey"), cfg.NKey, err)
		}
		return o, nil
	case cfg.Token != "":
		return nats.Token(cfg.Token), nil
	case cfg.User != "":
		return nats.UserInfo(cfg.User, cfg.Password), nil
	}
	return nil, nil
}

// checkFiles reads the credential and TLS files once before connecting,
// so that a missing or unreadable one is named with its key at once: the
// library reads them on every connection attempt, and reports a missing
// .creds file as if the server were down. They are read again at each
// connection, so that renewed certificates and credentials take effect.
func checkFiles(cfg ConnectOptions) error {
	if cfg.Creds != "" {
		data, err := os.ReadFile(cfg.Creds)
		if err == nil {
			_, err = jwt.ParseDecoratedJWT(data)
		}
		if err != nil {
			return fmt.Errorf("%s: read credentials file %s: %w", label(cfg, "nats.creds"), cfg.Creds, err)
		}
	}
	if cfg.TLS.CA != "" {
		data, err := os.ReadFile(cfg.TLS.CA)
		if err == nil && !x509.NewCertPool().AppendCertsFromPEM(data) {
			err = errors.New("no PEM certificate in it")
		}
		if err != nil {
			return fmt.Errorf("%s: read CA file %s: %w", label(cfg, "nats.tls.ca"), cfg.TLS.CA, err)
		}
	}
	if cfg.TLS.Cert != "" {
		if _, err := tls.LoadX509KeyPair(cfg.TLS.Cert, cfg.TLS.Key); err != nil {
			return fmt.Errorf("%s, %s: load client certificate %s and key %s: %w",
				label(cfg, "nats.tls.cert"), label(cfg, "nats.tls.key"), cfg.TLS.Cert, cfg.TLS.Key, err)
		}
	}
	return nil
}

// label names a key with where its value came from, when that is not the
// key itself: "nats.creds (from NATS_CREDS)".
func label(cfg ConnectOptions, key string) string {
	switch from := cfg.from(key); {
	case from == key:
		return key
	case strings.HasPrefix(from, key+" "): // "nats.creds in /etc/x.yaml"
		return from
	default:
		return key + " (from " + from + ")"
	}
}

// fatalConnectError reports errors that waiting will not cure.
func fatalConnectError(err error) bool {
	if errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired) {
		return true
	}
	msg := strings.ToLower(err.Error())
	// A server that closes the connection during or right after the TLS
	// handshake (a missing client certificate) reports it in several ways.
	for _, s := range []string{"authorization", "authentication", "x509", "certificate", "tls:", "tls error", "remote error", "nkey", "credentials", "secure connection"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// Ready reports why the connection cannot publish now, or nil; a closed
// connection wraps ErrClosed.
func (c *Conn) Ready() error { return c.check() }

// check reports why the connection cannot publish now, or nil; a closed
// connection wraps ErrClosed.
func (c *Conn) check() error {
	switch {
	case c.NC.IsClosed():
		return fmt.Errorf("%w (last error: %v)", ErrClosed, c.NC.LastError())
	case !c.NC.IsConnected():
		return fmt.Errorf("nats not connected (%s)", c.NC.Status())
	}
	return nil
}

// Close closes the connection without draining: callers settle what is
// outstanding before.
func (c *Conn) Close() {
	c.closing.Store(true) // the handlers run after Close returns: keep them quiet
	c.NC.Close()
}
