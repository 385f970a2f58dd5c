package publish

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// tlsURL is the server's URL with the tls scheme.
func tlsURL(n *testenv.NATS) string { return strings.Replace(n.URL(), "nats://", "tls://", 1) }

// storeOne creates a stream through c and stores one message: the proof a
// connection works for the relay.
func storeOne(t *testing.T, c *Conn) {
	t.Helper()
	js, err := jetstream.New(c.NC)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	p := newJS(t, c, 5*time.Second)
	if r := publishOne(p, "events.Secure", row("Secure", []byte("x"))); r.Kind != Stored {
		t.Fatalf("publish: %v %v", r.Kind, r.Err)
	}
}

func connectErr(t *testing.T, url string, cfg config.NATS) error {
	t.Helper()
	start := time.Now()
	c, err := Connect(context.Background(), url, cfg, "test", zap.NewNop())
	if err == nil {
		c.Close()
		t.Fatal("connected; want a refusal")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("refusal took %v: it must not hang", d)
	}
	return err
}

// TestTLS: server verification with a custom CA; a server certificate from
// another CA is refused with an error that names the certificate problem,
// at once (it is not an outage to wait out).
func TestTLS(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(false, false))
	storeOne(t, connect(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA}}))

	err := connectErr(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.OtherCA}})
	if !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
		t.Fatalf("wrong CA: %v", err)
	}
}

// TestMutualTLS: the server requires a client certificate.
func TestMutualTLS(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(true, false))
	storeOne(t, connect(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA, Cert: files.ClientCert, Key: files.ClientKey}}))
	if err := connectErr(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA}}); !errors.Is(err, ErrAuth) {
		t.Fatalf("no client certificate: %v", err)
	}
}

// TestTLSHandshakeFirst: a server that expects TLS before the NATS protocol.
func TestTLSHandshakeFirst(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(false, true))
	storeOne(t, connect(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA, HandshakeFirst: true}}))
}

// TestInsecureSkipVerify connects to a server whose CA it does not know,
// and says so.
func TestInsecureSkipVerify(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(false, false))
	core, logs := observer.New(zapcore.WarnLevel)
	c, err := Connect(context.Background(), tlsURL(n), config.NATS{TLS: config.TLS{InsecureSkipVerify: true}}, "test", zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	storeOne(t, c)
	if logs.FilterMessageSnippet("insecure_skip_verify").Len() != 1 {
		t.Fatalf("no warning about insecure_skip_verify: %v", logs.All())
	}
}

// TestAuthMethods: user/password, token, NKey seed file and JWT .creds, each
// against a server configured for it; wrong credentials fail at once.
func TestAuthMethods(t *testing.T) {
	seed, nkeyServer := testenv.NKeyUser(t)
	otherSeed, _ := testenv.NKeyUser(t)
	jwtAuth := testenv.NewJWTAuth(t)
	otherJWT := testenv.NewJWTAuth(t)
	for _, tc := range []struct {
		name        string
		server      func(*server.Options)
		good, wrong config.NATS
	}{
		{"user and password", func(o *server.Options) { o.Username, o.Password = "relay", "s3cret-pw" },
			config.NATS{User: "relay", Password: "s3cret-pw"}, config.NATS{User: "relay", Password: "wrong-pw"}},
		{"token", func(o *server.Options) { o.Authorization = "s3cret-token" },
			config.NATS{Token: "s3cret-token"}, config.NATS{Token: "wrong-token"}},
		{"nkey seed file", nkeyServer, config.NATS{NKey: seed}, config.NATS{NKey: otherSeed}},
		{"jwt creds file", jwtAuth.Configure, config.NATS{Creds: jwtAuth.CredsFile}, config.NATS{Creds: otherJWT.CredsFile}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := testenv.StartNATS(t, tc.server)
			storeOne(t, connect(t, n.URL(), tc.good))
			err := connectErr(t, n.URL(), tc.wrong)
			if !errors.Is(err, ErrAuth) {
				t.Fatalf("wrong credentials: %v; want ErrAuth", err)
			}
			// The server's own error stays inspectable too.
			if !errors.Is(err, nats.ErrAuthorization) {
				t.Fatalf("wrong credentials: %v; want it to wrap nats.ErrAuthorization", err)
			}
			for _, secret := range []string{tc.wrong.Password, tc.wrong.Token} {
				if secret != "" && strings.Contains(err.Error(), secret) {
					t.Fatalf("error %q shows the secret", err)
				}
			}
		})
	}
}
