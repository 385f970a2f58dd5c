package daemon

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// connect connects as the relay does with the settings of cfg, and closes
// the connection when the test ends.
func connect(t *testing.T, cfg config.NATS) *publish.Conn {
	t.Helper()
	c, err := publish.Connect(context.Background(), ConnectOptions(cfg, "test"), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// connectErr connects as the relay does with the settings of cfg, and
// returns the refusal, which must come at once.
func connectErr(t *testing.T, cfg config.NATS) error {
	t.Helper()
	start := time.Now()
	c, err := publish.Connect(context.Background(), ConnectOptions(cfg, "test"), zap.NewNop())
	if err == nil {
		c.Close()
		t.Fatal("connected; want a refusal")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("refusal took %v: it must not hang", d)
	}
	return err
}

// storeOne creates a stream through c and stores one message: the proof a
// connection works for the relay.
func storeOne(t *testing.T, c *publish.Conn) {
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
	p, err := publish.NewJetStream(c, "EVENTS", 100, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	row := event.Row{ID: 1, EventID: event.NewID(), EventType: "Secure", Payload: []byte("x"), CreatedAt: time.Now().UnixMilli()}
	if r := p.Publish(ctx, []publish.Message{{Row: row, Subject: "events.Secure"}})[0].Wait(ctx); r.Kind != publish.Stored {
		t.Fatalf("publish: %v %v", r.Kind, r.Err)
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
		storeOne(t, connect(t, cfg))
	}
	cfg, err := loadNATS(t, "", "NATS_URL="+users.URL(), "NATS_USER=relay", "NATS_PASSWORD=wrong-pw")
	if err != nil {
		t.Fatal(err)
	}
	err = connectErr(t, cfg)
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
	storeOne(t, connect(t, cfg))

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
	err = connectErr(t, cfg)
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
	storeOne(t, connect(t, cfg))
}
