package config

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeContext saves a natscli context called name under the
// configuration directory dir, as `nats context save` does, and returns
// its path.
func writeContext(t *testing.T, dir, name string, fields map[string]any) string {
	t.Helper()
	p := filepath.Join(dir, "nats", "context", name+".json")
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(fields)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestNatscliVariables: natscli's NATS_USER, NATS_PASSWORD, NATS_CREDS,
// NATS_NKEY, NATS_TOKEN and NATS_CA/CERT/KEY set their keys, below the
// relay's own OUTBOX_RELAY_* names, and each key says where it came from.
func TestNatscliVariables(t *testing.T) {
	c, err := load(t, "", nil, []string{"NATS_USER=relay", "NATS_PASSWORD=pw"})
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.User != "relay" || c.NATS.Password != "pw" || c.NATS.From("nats.password") != "NATS_PASSWORD" {
		t.Fatalf("NATS_USER/NATS_PASSWORD: %+v", c.NATS)
	}
	for env, want := range map[string]func(NATS) string{
		"NATS_CREDS=/x/relay.creds": func(n NATS) string { return n.Creds },
		"NATS_NKEY=/x/relay.nk":     func(n NATS) string { return n.NKey },
		"NATS_TOKEN=s3cret-token":   func(n NATS) string { return n.Token },
		"NATS_CA=/x/ca.pem":         func(n NATS) string { return n.TLS.CA },
	} {
		c, err := load(t, "", nil, []string{env})
		_, val, _ := strings.Cut(env, "=")
		if err != nil || want(c.NATS) != val {
			t.Errorf("%s: %+v, %v", env, c.NATS, err)
		}
	}
	c, err = load(t, "", nil, []string{"NATS_CERT=/x/c.pem", "NATS_KEY=/x/k.pem"})
	if err != nil || c.NATS.TLS.Cert != "/x/c.pem" || c.NATS.TLS.Key != "/x/k.pem" {
		t.Fatalf("NATS_CERT/NATS_KEY: %+v, %v", c.NATS.TLS, err)
	}
	// The relay's own name wins, and the file loses to both.
	file := writeFile(t, "nats:\n  user: file-user\n  password: file-pw\n")
	c, err = load(t, file, nil, []string{"NATS_USER=natscli", "NATS_PASSWORD=natscli-pw", "OUTBOX_RELAY_NATS_USER=own"})
	if err != nil || c.NATS.User != "own" || c.NATS.Password != "natscli-pw" {
		t.Fatalf("precedence: %+v, %v", c.NATS, err)
	}
	// Two kinds of credential from two places: the error names both.
	file = writeFile(t, "nats:\n  creds: /x/relay.creds\n")
	msg := loadErr(t, "", "NATS_USER=relay", "NATS_PASSWORD=pw", "OUTBOX_RELAY_NATS_CREDS=/x/relay.creds")
	for _, want := range []string{"set only one of", "nats.creds (OUTBOX_RELAY_NATS_CREDS)", "nats.user (NATS_USER)"} {
		if !strings.Contains(msg, want) {
			t.Errorf("conflict error %q does not say %q", msg, want)
		}
	}
	_, err = load(t, file, nil, []string{"NATS_USER=relay", "NATS_PASSWORD=pw"})
	if err == nil || !strings.Contains(err.Error(), "nats.creds in "+file) {
		t.Errorf("conflict with the file: %v", err)
	}
}

// TestNatscliUserIsTokenWithoutPassword: natscli sends NATS_USER as a
// token when no password is given, and so does the relay, so a token is
// never sent or shown as a user name.
func TestNatscliUserIsTokenWithoutPassword(t *testing.T) {
	c, err := load(t, "", nil, []string{"NATS_USER=s3cret-token"})
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.User != "" || c.NATS.Token != "s3cret-token" || c.NATS.From("nats.token") != "NATS_USER" {
		t.Fatalf("NATS_USER alone: %+v", c.NATS)
	}
	// With a password from anywhere it is the user.
	for _, env := range [][]string{{"NATS_USER=relay", "NATS_PASSWORD=pw"}, {"NATS_USER=relay", "OUTBOX_RELAY_NATS_PASSWORD=pw"}} {
		if c, err := load(t, "", nil, env); err != nil || c.NATS.User != "relay" || c.NATS.Token != "" {
			t.Errorf("%q: %+v, %v", env, c.NATS, err)
		}
	}
	file := writeFile(t, "nats:\n  password: pw\n")
	if c, err := load(t, file, nil, []string{"NATS_USER=relay"}); err != nil || c.NATS.User != "relay" || c.NATS.Token != "" {
		t.Errorf("password in the file: %+v, %v", c.NATS, err)
	}
}

// TestNatscliContext: nats.context (or NATS_CONTEXT) names a context saved
// by natscli under $XDG_CONFIG_HOME (else $HOME/.config); its server,
// credentials and TLS files fill what the other sources leave unset.
func TestNatscliContext(t *testing.T) {
	dir := t.TempDir()
	home := t.TempDir()
	writeContext(t, dir, "prod", map[string]any{
		"description": "production", "url": "nats-1.example:4222,tls://nats-2.example:4222",
		"user": "relay", "password": "env://PROD_NATS_PASSWORD", "creds": "", "nkey": "",
		"ca": "~/ca.pem", "cert": "$CERTS/client.pem", "key": "file://$CERTS/client-key.pem", "tls_first": true,
		"color_scheme": "dark", "jetstream_domain": "",
	})
	base := []string{"XDG_CONFIG_HOME=" + dir, "HOME=" + home, "CERTS=/etc/certs", "PROD_NATS_PASSWORD=s3cret"}
	c, err := load(t, "", nil, append(base, "NATS_CONTEXT=prod"))
	if err != nil {
		t.Fatal(err)
	}
	n := c.NATS
	if n.URL != "nats://nats-1.example:4222,tls://nats-2.example:4222" || n.User != "relay" || n.Password != "s3cret" ||
		n.TLS.CA != home+"/ca.pem" || n.TLS.Cert != "/etc/certs/client.pem" || n.TLS.Key != "/etc/certs/client-key.pem" || !n.TLS.HandshakeFirst {
		t.Fatalf("context values: %+v", n)
	}
	if n.From("nats.password") != `nats context "prod"` || n.From("nats.context") != "NATS_CONTEXT" {
		t.Fatalf("sources: %v", n.Sources)
	}

	// The file beats the context for the URL; credentials from any other
	// source replace the context's as a whole.
	file := writeFile(t, "nats:\n  context: prod\n  url: nats://file:4222\n  creds: /x/relay.creds\n")
	c, err = load(t, file, nil, base)
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.URL != "nats://file:4222" || c.NATS.Creds != "/x/relay.creds" || c.NATS.User != "" || c.NATS.Password != "" || c.NATS.TLS.CA != home+"/ca.pem" {
		t.Fatalf("file over context: %+v", c.NATS)
	}
	// Keys a file copied from config.example.yaml leaves empty or false
	// keep the context's values.
	file = writeFile(t, "nats:\n  context: prod\n  user: \"\"\n  password: \"\"\n  tls:\n    ca: \"\"\n    handshake_first: false\n")
	c, err = load(t, file, nil, base)
	if err != nil || c.NATS.User != "relay" || c.NATS.Password != "s3cret" || c.NATS.TLS.CA != home+"/ca.pem" || !c.NATS.TLS.HandshakeFirst {
		t.Fatalf("empty keys in the file: %+v, %v", c.NATS, err)
	}
	c, err = load(t, "", nil, append(base, "NATS_CONTEXT=prod", "NATS_TOKEN=tok"))
	if err != nil || c.NATS.Token != "tok" || c.NATS.User != "" {
		t.Fatalf("natscli variables over the context: %+v, %v", c.NATS, err)
	}
	// A context's password that is not used need not resolve.
	if _, err := load(t, "", nil, []string{"XDG_CONFIG_HOME=" + dir, "HOME=" + home, "NATS_CONTEXT=prod", "NATS_TOKEN=tok"}); err != nil {
		t.Fatalf("unused context password: %v", err)
	}
	// OUTBOX_RELAY_NATS_CONTEXT beats NATS_CONTEXT.
	writeContext(t, dir, "dev", map[string]any{"url": "nats://dev:4222"})
	if c, err := load(t, "", nil, append(base, "NATS_CONTEXT=prod", "OUTBOX_RELAY_NATS_CONTEXT=dev")); err != nil || c.NATS.URL != "nats://dev:4222" {
		t.Fatalf("OUTBOX_RELAY_NATS_CONTEXT: %+v, %v", c.NATS, err)
	}
	// Without XDG_CONFIG_HOME: $HOME/.config; a .json path works too.
	p := writeContext(t, filepath.Join(home, ".config"), "home", map[string]any{"url": "nats://home:4222"})
	if c, err := load(t, "", nil, []string{"HOME=" + home, "XDG_CONFIG_HOME=", "NATS_CONTEXT=home"}); err != nil || c.NATS.URL != "nats://home:4222" {
		t.Fatalf("context under $HOME/.config: %+v, %v", c.NATS, err)
	}
	if c, err := load(t, "", flags(t, "--nats-context="+p), nil); err != nil || c.NATS.URL != "nats://home:4222" {
		t.Fatalf("context by path: %+v, %v", c.NATS, err)
	}
}

// TestNatscliContextErrors: a context that is missing, unreadable or sets
// what the relay cannot honour is refused naming the key, the context and
// what to do.
func TestNatscliContextErrors(t *testing.T) {
	dir := t.TempDir()
	env := []string{"XDG_CONFIG_HOME=" + dir}
	writeContext(t, dir, "domain", map[string]any{"url": "nats://a:4222", "jetstream_domain": "hub"})
	writeContext(t, dir, "jwt", map[string]any{"user_jwt": "eyJ...", "user_seed": "SUA..."})
	writeContext(t, dir, "vault", map[string]any{"creds": "op://vault/relay/creds"})
	writeContext(t, dir, "unset", map[string]any{"token": "env://NO_SUCH_VARIABLE_SET"})
	if err := os.WriteFile(filepath.Join(dir, "nats", "context", "broken.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		env  string
		want []string
	}{
		{"NATS_CONTEXT=missing", []string{"nats.context (NATS_CONTEXT)", `no natscli context "missing"`, filepath.Join(dir, "nats", "context", "missing.json"), "nats context ls"}},
		{"OUTBOX_RELAY_NATS_CONTEXT=../etc/passwd", []string{"nats.context (OUTBOX_RELAY_NATS_CONTEXT)", "neither a context name"}},
		{"NATS_CONTEXT=domain", []string{`natscli context "domain"`, "jetstream_domain", "does not support"}},
		{"NATS_CONTEXT=jwt", []string{"user_jwt", ".creds file"}},
		{"NATS_CONTEXT=vault", []string{"creds", "not op:"}},
		{"NATS_CONTEXT=unset", []string{"token", "NO_SUCH_VARIABLE_SET", "not set"}},
		{"NATS_CONTEXT=broken", []string{"read natscli context", "broken.json"}},
	} {
		msg := loadErr(t, "", append(env, tc.env)...)
		for _, w := range tc.want {
			if !strings.Contains(msg, w) {
				t.Errorf("%s: error %q does not say %q", tc.env, msg, w)
			}
		}
	}
}
