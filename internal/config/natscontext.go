package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spf13/viper"
)

// contextFile is what outbox-relay reads of a natscli context, the JSON
// file `nats context save` writes (jsm.go's natscontext format, natscli
// v0.5.0). Settings it does not list (description, color_scheme,
// jetstream_event_prefix) change nothing for the relay and are ignored.
type contextFile struct {
	URL      string `json:"url"`
	User     string `json:"user"`
	Password string `json:"password"`
	Token    string `json:"token"`
	Creds    string `json:"creds"`
	NKey     string `json:"nkey"`
	Cert     string `json:"cert"`
	Key      string `json:"key"`
	CA       string `json:"ca"`
	TLSFirst bool   `json:"tls_first"`

	// Settings the relay cannot honour. Each changes where or as whom a
	// client connects, or which subjects it needs, so a context that sets
	// one is refused rather than half followed.
	NSC          string `json:"nsc"`
	UserJWT      string `json:"user_jwt"`
	UserSeed     string `json:"user_seed"`
	SocksProxy   string `json:"socks_proxy"`
	JSDomain     string `json:"jetstream_domain"`
	JSAPIPrefix  string `json:"jetstream_api_prefix"`
	InboxPrefix  string `json:"inbox_prefix"`
	WinCertStore string `json:"windows_cert_store"`
}

// natsContext is a loaded context: the configuration keys it sets, and
// which of them Load took (the others are set by a source above it).
type natsContext struct {
	name, path string
	values     map[string]any
	applied    map[string]bool
}

func (c *natsContext) String() string { return fmt.Sprintf("nats context %q", c.name) }

// credentialKeys are the keys that say who the relay is; they are taken
// from one source as a whole (see applyContext).
var credentialKeys = []string{"nats.creds", "nats.nkey", "nats.token", "nats.user", "nats.password"}

// applyContext loads the natscli context that nats.context names, if any,
// and fills the keys it sets that every other source leaves empty or false
// (unset, for nats.url, whose default is not empty), as a file copied from
// config.example.yaml leaves them. The credentials are taken only as a
// whole, and only when no other source names any, also not in nats.url: a
// context's creds beside a file's nats.user would be two identities at
// once. of says where a key's value comes from without the context.
func applyContext(v *viper.Viper, of func(string) string) (*natsContext, error) {
	name := strings.TrimSpace(v.GetString("nats.context"))
	if name == "" {
		return nil, nil
	}
	ctx, err := loadContext(name)
	if err != nil {
		return nil, configErr("%s: %w", label("nats.context", of("nats.context")), err)
	}
	own := urlUserinfo(v.GetString("nats.url")) && of("nats.url") != ""
	for _, k := range credentialKeys {
		own = own || v.GetString(k) != ""
	}
	ctx.applied = map[string]bool{}
	for key, val := range ctx.values {
		switch {
		case slices.Contains(credentialKeys, key):
			if own {
				continue
			}
		case key == "nats.url":
			if of(key) != "" {
				continue
			}
		case key == "nats.tls.handshake_first":
			if v.GetBool(key) {
				continue
			}
		case v.GetString(key) != "":
			continue
		}
		if ref, ok := val.(secretRef); ok {
			// Resolved only now: a context's password that another
			// source's credentials replace need not resolve.
			var err error
			if val, err = contextSecret(ref.field, ref.ref); err != nil {
				return nil, configErr("%s: %s (%s): %w", label("nats.context", of("nats.context")), ctx, ctx.path, err)
			}
		}
		v.Set(key, val)
		ctx.applied[key] = true
	}
	return ctx, nil
}

// secretRef is a context's password or token as written: a value or a
// reference that contextSecret resolves.
type secretRef struct{ field, ref string }

// label names key with the source of its value when that is not the key
// itself: "nats.context (NATS_CONTEXT)", "nats.context in /etc/x.yaml".
func label(key, source string) string {
	switch {
	case source == "" || source == key:
		return key
	case strings.HasPrefix(source, key+" "):
		return source
	}
	return key + " (" + source + ")"
}

// urlUserinfo reports whether any of the comma-separated server URLs
// carries a user or a token.
func urlUserinfo(urls string) bool {
	for _, s := range strings.Split(urls, ",") {
		if u, err := url.Parse(strings.TrimSpace(s)); err == nil && u.User != nil {
			return true
		}
	}
	return false
}

// loadContext reads the context called name, or the .json file name
// names, as natscli does.
func loadContext(name string) (*natsContext, error) {
	path, err := contextPath(name)
	if err != nil {
		return nil, err
	}
	if strings.HasSuffix(name, ".json") && path == name {
		name = strings.TrimSuffix(filepath.Base(name), ".json")
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("no natscli context %q: %s does not exist (`nats context ls` lists the contexts of the user running it; the relay reads $XDG_CONFIG_HOME/nats/context, else $HOME/.config/nats/context, of the user it runs as)", name, path)
	}
	if err != nil {
		return nil, fmt.Errorf("read natscli context %s: %w", path, err)
	}
	var f contextFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("read natscli context %s: %w", path, err)
	}
	ctx := &natsContext{name: name, path: path}
	if ctx.values, err = f.values(); err != nil {
		return nil, fmt.Errorf("natscli context %q (%s): %w", name, path, err)
	}
	return ctx, nil
}

// contextPath is where the context name lives: name itself when it is an
// existing .json file, else <config dir>/nats/context/<name>.json.
func contextPath(name string) (string, error) {
	if strings.HasSuffix(name, ".json") {
		if st, err := os.Stat(name); err == nil && !st.IsDir() {
			return name, nil
		}
	}
	if strings.Contains(name, "..") || strings.ContainsAny(name, `/\`) {
		return "", fmt.Errorf("%q is neither a context name (no '/', '\\' or '..') nor an existing .json file", name)
	}
	dir, err := configDir()
	if err != nil {
		return "", fmt.Errorf("find natscli context %q: %w", name, err)
	}
	return filepath.Join(dir, "nats", "context", name+".json"), nil
}

// configDir is natscli's configuration directory: $XDG_CONFIG_HOME, else
// $HOME/.config, else the user's home directory from the password
// database (a service started without HOME).
func configDir() (string, error) {
	if d := os.Getenv("XDG_CONFIG_HOME"); d != "" {
		return d, nil
	}
	home, err := homeDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(home, ".config"), nil
}

func homeDir() (string, error) {
	if h := os.Getenv("HOME"); h != "" {
		return h, nil
	}
	u, err := user.Current()
	if err != nil || u.HomeDir == "" {
		return "", fmt.Errorf("no home directory: set HOME or XDG_CONFIG_HOME (%v)", err)
	}
	return u.HomeDir, nil
}

// values maps the context's settings to configuration keys. Of several
// credentials it takes the one natscli uses: user, else creds, else nkey,
// else token.
func (f contextFile) values() (map[string]any, error) {
	if err := f.unsupported(); err != nil {
		return nil, err
	}
	out := map[string]any{}
	if f.URL != "" {
		out["nats.url"] = contextURLs(f.URL)
	}
	if f.TLSFirst {
		out["nats.tls.handshake_first"] = true
	}
	files := map[string]string{"nats.tls.ca": f.CA, "nats.tls.cert": f.Cert, "nats.tls.key": f.Key}
	switch {
	case f.User != "":
		out["nats.user"] = f.User
		if f.Password != "" {
			out["nats.password"] = secretRef{"password", f.Password}
		}
	case f.Creds != "":
		files["nats.creds"] = f.Creds
	case f.NKey != "":
		files["nats.nkey"] = f.NKey
	case f.Token != "":
		out["nats.token"] = secretRef{"token", f.Token}
	}
	for key, ref := range files {
		if ref == "" {
			continue
		}
		path, err := contextFilePath(key, ref)
		if err != nil {
			return nil, err
		}
		out[key] = path
	}
	return out, nil
}

func (f contextFile) unsupported() error {
	for _, s := range []struct{ field, value, instead string }{
		{"nsc", f.NSC, "export the user's .creds file with nsc and set creds"},
		{"user_jwt", f.UserJWT, "save the JWT and seed as a .creds file and set creds"},
		{"user_seed", f.UserSeed, "save the JWT and seed as a .creds file and set creds"},
		{"socks_proxy", f.SocksProxy, "the relay connects directly"},
		{"jetstream_domain", f.JSDomain, "the relay uses the JetStream of the account it connects to"},
		{"jetstream_api_prefix", f.JSAPIPrefix, "the relay uses the JetStream of the account it connects to"},
		{"inbox_prefix", f.InboxPrefix, "the relay's replies use _INBOX.>"},
		{"windows_cert_store", f.WinCertStore, "give the certificate and key as files (cert, key)"},
	} {
		if s.value != "" {
			return fmt.Errorf("sets %s, which outbox-relay does not support (%s): use a context without it, or set the relay's nats.* keys instead", s.field, s.instead)
		}
	}
	return nil
}

// contextURLs gives each server a scheme, as nats.go does for a server
// written without one (demo.nats.io:4222).
func contextURLs(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		if p = strings.TrimSpace(p); p != "" && !strings.Contains(p, "://") {
			p = "nats://" + p
		}
		parts[i] = p
	}
	return strings.Join(parts, ",")
}

// contextFilePath resolves a file setting as natscli does: a path or a
// file:// URI, with $VARIABLES and a leading ~ expanded.
func contextFilePath(key, ref string) (string, error) {
	field := map[string]string{"nats.tls.ca": "ca", "nats.tls.cert": "cert", "nats.tls.key": "key", "nats.creds": "creds", "nats.nkey": "nkey"}[key]
	if rest, ok := cutPrefixFold(ref, "file://"); ok {
		ref = rest
	} else if scheme := refScheme(ref); scheme != "" {
		return "", fmt.Errorf("%s %q: outbox-relay reads %s from a file path or a file:// URI, not %s:", field, ref, field, scheme)
	}
	ref = os.ExpandEnv(ref)
	if strings.HasPrefix(ref, "~") {
		home, err := homeDir()
		if err != nil {
			return "", fmt.Errorf("%s %q: %w", field, ref, err)
		}
		ref = home + ref[1:]
	}
	return ref, nil
}

// contextSecret resolves a password or token: the value itself, or
// env://VARIABLE, or file://PATH (the file's text without its final line
// break). The value is never shown.
func contextSecret(field, ref string) (string, error) {
	if name, ok := cutPrefixFold(ref, "env://"); ok {
		val := os.Getenv(name)
		if val == "" {
			return "", fmt.Errorf("%s: env://%s: the variable is not set, or empty", field, name)
		}
		return val, nil
	}
	if path, ok := cutPrefixFold(ref, "file://"); ok {
		data, err := os.ReadFile(os.ExpandEnv(path))
		if err != nil {
			return "", fmt.Errorf("%s: %w", field, err)
		}
		return strings.TrimRight(string(data), "\r\n"), nil
	}
	switch scheme := refScheme(ref); scheme {
	case "op", "nsc", "data":
		return "", fmt.Errorf("%s: outbox-relay does not resolve %s: references; give the value, env://VARIABLE or file://PATH", field, scheme)
	}
	return ref, nil
}

// refScheme is the URI scheme ref starts with ("" for none), counting only
// schemes of two letters or more, so that C:\path is a path.
func refScheme(ref string) string {
	u, err := url.Parse(ref)
	if err != nil || len(u.Scheme) < 2 {
		return ""
	}
	return strings.ToLower(u.Scheme)
}

func cutPrefixFold(s, prefix string) (string, bool) {
	if len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix) {
		return s[len(prefix):], true
	}
	return s, false
}
