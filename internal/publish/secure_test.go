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

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/natsname"
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
	storeOne(t, connect(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA}}))

	err := connectErr(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.OtherCA}, Sources: map[string]string{"nats.tls.ca": "NATS_CA"}})
	tlsRefused(t, "wrong CA", err, "certificate signed by unknown authority", "set nats.tls.ca", "now "+files.OtherCA+" from NATS_CA")
	// A server that requires TLS, reached by nats:// with no CA.
	tlsRefused(t, "system CAs", connectErr(t, n.URL(), config.NATS{}), "the system's CAs", "set nats.tls.ca")

	// A certificate for another name: the server is reached by an address
	// its certificate does not list.
	other := testenv.StartNATS(t, files.ServerTLS(false, false), func(o *server.Options) { o.Host = "127.0.0.2" })
	tlsRefused(t, "wrong name", connectErr(t, "tls://"+other.Srv.Addr().String(), config.NATS{TLS: config.TLS{CA: files.CA}}),
		"not valid for the name in nats.url")

	// TLS asked of a server without it.
	plain := testenv.StartNATS(t)
	tlsRefused(t, "no TLS on the server", connectErr(t, tlsURL(plain), config.NATS{TLS: config.TLS{CA: files.CA}}), "does not offer it")
}

// TestMutualTLS: the server requires a client certificate; without one the
// error says to set one.
func TestMutualTLS(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(true, false))
	storeOne(t, connect(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA, Cert: files.ClientCert, Key: files.ClientKey}}))
	// The server's alert (certificate required) or, when the client wrote
	// first, a closed connection: both name the client certificate.
	tlsRefused(t, "no client certificate", connectErr(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA}}),
		"requires a client certificate", "set nats.tls.cert and nats.tls.key")
	// A client certificate from a CA the server does not trust.
	other := testenv.NewTLSFiles(t)
	tlsRefused(t, "client certificate from another CA",
		connectErr(t, tlsURL(n), config.NATS{TLS: config.TLS{CA: files.CA, Cert: other.ClientCert, Key: other.ClientKey}}),
		"the client certificate "+other.ClientCert, "signed by a CA the server trusts")
}

// TestMissingFilesNamed: a credentials, CA or client certificate file that
// cannot be read is reported at once with its key, not taken for a server
// that is down.
func TestMissingFilesNamed(t *testing.T) {
	n := testenv.StartNATS(t)
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tc := range []struct {
		cfg  config.NATS
		want string
	}{
		{config.NATS{Creds: missing + ".creds", Sources: map[string]string{"nats.creds": "NATS_CREDS"}}, "nats.creds (from NATS_CREDS): read credentials file " + missing + ".creds"},
		{config.NATS{TLS: config.TLS{CA: missing + ".pem"}}, "nats.tls.ca: read CA file " + missing + ".pem"},
		{config.NATS{TLS: config.TLS{Cert: missing + ".pem", Key: missing + "-key.pem"}}, "nats.tls.cert, nats.tls.key: load client certificate"},
	} {
		c, err := Connect(context.Background(), n.URL(), tc.cfg, "test", zap.NewNop())
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
	otherUser, err := jwt.DecodeUserClaims(otherJWT.UserJWT)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name        string
		server      func(*server.Options)
		good, wrong config.NATS
		says        []string
	}{
		{"user and password", func(o *server.Options) { o.Username, o.Password = "relay", "s3cret-pw" },
			config.NATS{User: "relay", Password: "s3cret-pw"}, config.NATS{User: "relay", Password: "wrong-pw"},
			[]string{`user "relay" (from nats.user) with its password (from nats.password)`}},
		{"token", func(o *server.Options) { o.Authorization = "s3cret-token" },
			config.NATS{Token: "s3cret-token"}, config.NATS{Token: "wrong-token"},
			[]string{"the token (from nats.token)"}},
		{"nkey seed file", nkeyServer, config.NATS{NKey: seed}, config.NATS{NKey: otherSeed},
			[]string{"NKey user " + publicKey(t, otherSeed), "(from nats.nkey)"}},
		{"jwt creds file", jwtAuth.Configure, config.NATS{Creds: jwtAuth.CredsFile}, config.NATS{Creds: otherJWT.CredsFile},
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
		cfg  config.NATS
		says string
	}{
		{n.URL(), config.NATS{}, "no credentials were sent; set nats.creds, nats.nkey, nats.token or nats.user and nats.password, or nats.context"},
		{strings.Replace(n.URL(), "nats://", "nats://relay:wrong-pw@", 1), config.NATS{Sources: map[string]string{"nats.url": "NATS_URL"}},
			`user "relay" and the password in nats.url (from NATS_URL)`},
		{strings.Replace(n.URL(), "nats://", "nats://wrong-token@", 1), config.NATS{}, "the token in nats.url (from nats.url)"},
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

// loadNATS loads the configuration from env alone (plus file, if not
// empty), as the relay does: no other configuration or natscli variable of
// the test's process counts.
func loadNATS(t *testing.T, file string, env ...string) (config.NATS, error) {
	t.Helper()
	names := []string{"HOME", "XDG_CONFIG_HOME"}
	for _, k := range config.Keys() {
		names = append(names, k.Alias)
	}
	testenv.ReplaceEnv(t, config.EnvPrefix, names, env)
	c, err := config.Load(file, nil)
	return c.NATS, err
}

// TestNatscliVariablesConnect: the relay connects with the credentials of
// natscli's NATS_USER and NATS_PASSWORD, NATS_CREDS and NATS_NKEY, and a
// refusal names the variable that set what was sent.
func TestNatscliVariablesConnect(t *testing.T) {
	seed, nkeyServer := testenv.NKeyUser(t)
	jwtAuth := testenv.NewJWTAuth(t)
	users := testenv.StartNATS(t, func(o *server.Options) { o.Username, o.Password = "relay", "s3cret-pw" })
	for name, tc := range map[string]struct {
		n   *testenv.NATS
		env []string
	}{
		"NATS_USER and NATS_PASSWORD": {users, []string{"NATS_USER=relay", "NATS_PASSWORD=s3cret-pw"}},
		"NATS_NKEY":                   {testenv.StartNATS(t, nkeyServer), []string{"NATS_NKEY=" + seed}},
		"NATS_CREDS":                  {testenv.StartNATS(t, jwtAuth.Configure), []string{"NATS_CREDS=" + jwtAuth.CredsFile}},
	} {
		cfg, err := loadNATS(t, "", append(tc.env, "NATS_URL="+tc.n.URL())...)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		storeOne(t, connect(t, cfg.URL, cfg))
	}
	cfg, err := loadNATS(t, "", "NATS_URL="+users.URL(), "NATS_USER=relay", "NATS_PASSWORD=wrong-pw")
	if err != nil {
		t.Fatal(err)
	}
	err = connectErr(t, cfg.URL, cfg)
	if want := `the server refused user "relay" (from NATS_USER) with its password (from NATS_PASSWORD)`; !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not say %q", err, want)
	}
	if strings.Contains(err.Error(), "wrong-pw") {
		t.Errorf("error %q shows the password", err)
	}
}

// TestNatscliContextConnects: a context saved by natscli, named by
// NATS_CONTEXT or by nats.context in the file, gives the server, the user,
// the password (here through env://) and the CA (here under ~) of a TLS
// server the relay then publishes to; a refusal names the context.
func TestNatscliContextConnects(t *testing.T) {
	files := testenv.NewTLSFiles(t)
	n := testenv.StartNATS(t, files.ServerTLS(false, false), func(o *server.Options) { o.Username, o.Password = "relay", "s3cret-pw" })
	home, xdg := t.TempDir(), t.TempDir()
	ca, err := os.ReadFile(files.CA)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(home, "ca.pem"), ca, 0o600); err != nil {
		t.Fatal(err)
	}
	// natscli writes the server as given, with or without a scheme.
	server := strings.TrimPrefix(n.URL(), "nats://")
	write := func(dir, name, password string) {
		p := filepath.Join(dir, "nats", "context", name+".json")
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		body := `{"description": "", "url": "` + server + `", "user": "relay", "password": "` + password + `",
			"creds": "", "nkey": "", "cert": "", "key": "", "ca": "~/ca.pem", "nsc": "", "jetstream_domain": ""}`
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(xdg, "prod", "env://PROD_NATS_PASSWORD")
	cfg, err := loadNATS(t, "", "HOME="+home, "XDG_CONFIG_HOME="+xdg, "NATS_CONTEXT=prod", "PROD_NATS_PASSWORD=s3cret-pw")
	if err != nil {
		t.Fatal(err)
	}
	storeOne(t, connect(t, cfg.URL, cfg))

	// No XDG_CONFIG_HOME: $HOME/.config, the context named in the file.
	write(filepath.Join(home, ".config"), "staging", "wrong-pw")
	file := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(file, []byte("nats:\n  context: staging\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err = loadNATS(t, file, "HOME="+home)
	if err != nil {
		t.Fatal(err)
	}
	err = connectErr(t, cfg.URL, cfg)
	if want := `the server refused user "relay" (from nats context "staging") with its password (from nats context "staging")`; !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not say %q", err, want)
	}
}

// TestPercentEncodedPasswordInURL: a password with '/' and '#', which the
// configuration refuses raw, connects percent-encoded.
func TestPercentEncodedPasswordInURL(t *testing.T) {
	n := testenv.StartNATS(t, func(o *server.Options) { o.Username, o.Password = "relay", "pa/ss#wd" })
	url := strings.Replace(n.URL(), "nats://", "nats://relay:pa%2Fss%23wd@", 1)
	cfg, err := loadNATS(t, "", "NATS_URL="+url)
	if err != nil {
		t.Fatal(err)
	}
	storeOne(t, connect(t, cfg.URL, cfg))
}
