package publish

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/natsname"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// from is a ConnectOptions.Source that answers from m.
func from(m map[string]string) func(key string) string {
	return func(key string) string { return m[key] }
}

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

func connectErr(t *testing.T, url string, cfg ConnectOptions) error {
	t.Helper()
	start := time.Now()
	cfg.URLs, cfg.Name = url, "test"
	c, err := Connect(context.Background(), cfg, zap.NewNop())
	if err == nil {
		c.Close()
		t.Fatal("connected; want a refusal")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("refusal took %v: it must not hang", d)
	}
	return err
}

// tlsRefused checks that err is a TLS refusal (ErrTLS, and ErrAuth for the
// callers that exit on it) worded as one, saying each of want.
func tlsRefused(t *testing.T, what string, err error, want ...string) {
	t.Helper()
	if !errors.Is(err, ErrTLS) || !errors.Is(err, ErrAuth) {
		t.Errorf("%s: %v; want ErrTLS and ErrAuth", what, err)
	}
	for _, w := range append([]string{"TLS handshake failed"}, want...) {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: error %q does not say %q", what, err, w)
		}
	}
	if strings.Contains(err.Error(), "authentication") {
		t.Errorf("%s: error %q calls a TLS failure an authentication failure", what, err)
	}
}

// TestTLS: server verification with a custom CA; a server certificate the
// relay cannot verify is refused at once (it is not an outage to wait out)
// with an error that says it is a TLS problem and what to check.
func TestTLS(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(false, false))
	storeOne(t, connect(t, tlsURL(n), ConnectOptions{TLS: TLSOptions{CA: files.CA}}))

	err := connectErr(t, tlsURL(n), ConnectOptions{TLS: TLSOptions{CA: files.OtherCA}, Source: from(map[string]string{"nats.tls.ca": "NATS_CA"})})
	tlsRefused(t, "wrong CA", err, "certificate signed by unknown authority", "set nats.tls.ca", "now "+files.OtherCA+" from NATS_CA")
	// A server that requires TLS, reached by nats:// with no CA.
	tlsRefused(t, "system CAs", connectErr(t, n.URL(), ConnectOptions{}), "the system's CAs", "set nats.tls.ca")

	// A certificate for another name: the server is reached by an address
	// its certificate does not list.
	other := testenv.StartNATS(t, files.ServerTLS(false, false), func(o *server.Options) { o.Host = "127.0.0.2" })
	tlsRefused(t, "wrong name", connectErr(t, "tls://"+other.Srv.Addr().String(), ConnectOptions{TLS: TLSOptions{CA: files.CA}}),
		"not valid for the name in nats.url")

	// TLS asked of a server without it.
	plain := testenv.StartNATS(t)
	tlsRefused(t, "no TLS on the server", connectErr(t, tlsURL(plain), ConnectOptions{TLS: TLSOptions{CA: files.CA}}), "does not offer it")
}

// TestMutualTLS: the server requires a client certificate; without one the
// error says to set one.
func TestMutualTLS(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(true, false))
	storeOne(t, connect(t, tlsURL(n), ConnectOptions{TLS: TLSOptions{CA: files.CA, Cert: files.ClientCert, Key: files.ClientKey}}))
	// The server's alert (certificate required) or, when the client wrote
	// first, a closed connection: both name the client certificate.
	tlsRefused(t, "no client certificate", connectErr(t, tlsURL(n), ConnectOptions{TLS: TLSOptions{CA: files.CA}}),
		"requires a client certificate", "set nats.tls.cert and nats.tls.key")
	// A client certificate from a CA the server does not trust.
	other := testenv.NewTLSFiles(t)
	tlsRefused(t, "client certificate from another CA",
		connectErr(t, tlsURL(n), ConnectOptions{TLS: TLSOptions{CA: files.CA, Cert: other.ClientCert, Key: other.ClientKey}}),
		"the client certificate "+other.ClientCert, "signed by a CA the server trusts")
}

// TestMissingFilesNamed: a credentials, CA or client certificate file that
// cannot be read is reported at once with its key, not taken for a server
// that is down.
func TestMissingFilesNamed(t *testing.T) {
	n := testenv.StartNATS(t)
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tc := range []struct {
		cfg  ConnectOptions
		want string
	}{
		{ConnectOptions{Creds: missing + ".creds", Source: from(map[string]string{"nats.creds": "NATS_CREDS"})}, "nats.creds (from NATS_CREDS): read credentials file " + missing + ".creds"},
		{ConnectOptions{TLS: TLSOptions{CA: missing + ".pem"}}, "nats.tls.ca: read CA file " + missing + ".pem"},
		{ConnectOptions{TLS: TLSOptions{Cert: missing + ".pem", Key: missing + "-key.pem"}}, "nats.tls.cert, nats.tls.key: load client certificate"},
	} {
		tc.cfg.URLs, tc.cfg.Name = n.URL(), "test"
		c, err := Connect(context.Background(), tc.cfg, zap.NewNop())
		if err == nil {
			c.Close()
			t.Errorf("%+v: connected", tc.cfg)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "no such file") {
			t.Errorf("error %q does not say %q", err, tc.want)
		}
	}
}

// TestTLSHandshakeFirst: a server that expects TLS before the NATS protocol.
func TestTLSHandshakeFirst(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(false, true))
	storeOne(t, connect(t, tlsURL(n), ConnectOptions{TLS: TLSOptions{CA: files.CA, HandshakeFirst: true}}))
}

// TestInsecureSkipVerify connects to a server whose CA it does not know,
// and says so.
func TestInsecureSkipVerify(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(false, false))
	core, logs := observer.New(zapcore.WarnLevel)
	c, err := Connect(context.Background(), ConnectOptions{URLs: tlsURL(n), Name: "test", TLS: TLSOptions{InsecureSkipVerify: true}}, zap.New(core))
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
	otherUser, err := jwt.DecodeUserClaims(otherJWT.UserJWT)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name        string
		server      func(*server.Options)
		good, wrong ConnectOptions
		says        []string
	}{
		{"user and password", func(o *server.Options) { o.Username, o.Password = "relay", "s3cret-pw" },
			ConnectOptions{User: "relay", Password: "s3cret-pw"}, ConnectOptions{User: "relay", Password: "wrong-pw"},
			[]string{`user "relay" (from nats.user) with its password (from nats.password)`}},
		{"token", func(o *server.Options) { o.Authorization = "s3cret-token" },
			ConnectOptions{Token: "s3cret-token"}, ConnectOptions{Token: "wrong-token"},
			[]string{"the token (from nats.token)"}},
		{"nkey seed file", nkeyServer, ConnectOptions{NKey: seed}, ConnectOptions{NKey: otherSeed},
			[]string{"NKey user " + publicKey(t, otherSeed), "(from nats.nkey)"}},
		{"jwt creds file", jwtAuth.Configure, ConnectOptions{Creds: jwtAuth.CredsFile}, ConnectOptions{Creds: otherJWT.CredsFile},
			[]string{`user "relay" (` + otherUser.Subject + " of account " + otherUser.IssuerAccount, "credentials file " + otherJWT.CredsFile, "(from nats.creds)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := testenv.StartNATS(t, tc.server)
			storeOne(t, connect(t, n.URL(), tc.good))
			err := connectErr(t, n.URL(), tc.wrong)
			if !errors.Is(err, ErrAuth) || errors.Is(err, ErrTLS) {
				t.Fatalf("wrong credentials: %v; want ErrAuth and not ErrTLS", err)
			}
			// The error says which credential was sent, and where it was set.
			for _, want := range append([]string{"authorization violation: the server refused "}, tc.says...) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
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

// publicKey is the public key of the NKey seed in file.
func publicKey(t *testing.T, file string) string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	kp, err := nkeys.ParseDecoratedNKey(data)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	return pub
}

// TestAuthErrorNamesWhatWasSent: a refusal says that no credentials were
// sent, or that those of nats.url were, with the advice to set them.
func TestAuthErrorNamesWhatWasSent(t *testing.T) {
	n := testenv.StartNATS(t, func(o *server.Options) { o.Username, o.Password = "relay", "s3cret-pw" })
	for _, tc := range []struct {
		url  string
		cfg  ConnectOptions
		says string
	}{
		{n.URL(), ConnectOptions{}, "no credentials were sent; set nats.creds, nats.nkey, nats.token or nats.user and nats.password, or nats.context"},
		{strings.Replace(n.URL(), "nats://", "nats://relay:wrong-pw@", 1), ConnectOptions{Source: from(map[string]string{"nats.url": "NATS_URL"})},
			`user "relay" and the password in nats.url (from NATS_URL)`},
		{strings.Replace(n.URL(), "nats://", "nats://wrong-token@", 1), ConnectOptions{}, "the token in nats.url (from nats.url)"},
	} {
		err := connectErr(t, tc.url, tc.cfg)
		if !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), "authorization violation: ") || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: error %q does not say %q", natsname.RedactURLs(tc.url), err, tc.says)
		}
		if strings.Contains(err.Error(), "wrong-") {
			t.Errorf("error %q shows the secret", err)
		}
	}
}
