package config

import (
	"fmt"
	"os"

	"github.com/spf13/viper"
)

// sourceKeys are the connection settings whose source NATS.Sources
// records: what a refused connection names, with where to change it.
var sourceKeys = []string{
	"nats.url", "nats.context", "nats.creds", "nats.nkey", "nats.user", "nats.password", "nats.token",
	"nats.tls.ca", "nats.tls.cert", "nats.tls.key",
}

// sourcer tells where a key's value comes from, in the order of Load's
// precedence.
type sourcer struct {
	v           *viper.Viper
	file        string
	changed     map[string]bool // keys whose flag was set on the command line
	userIsToken bool            // NATS_USER is the token (see bindEnv)
	ctx         *natsContext    // the context Load read, or nil
}

// of returns where the value of key comes from without the context: its
// flag, its variable, the file, or "" for the default.
func (s sourcer) of(key string) string {
	env, alias := EnvName(key), aliases[key]
	switch {
	case s.changed[key]:
		return "--" + FlagName(key)
	case os.Getenv(env) != "":
		return env
	case key == "nats.user" && s.userIsToken:
	case alias != "" && os.Getenv(alias) != "":
		return alias
	case key == "nats.token" && s.userIsToken:
		return aliases["nats.user"]
	}
	if s.file != "" && s.v.InConfig(key) {
		return key + " in " + s.file
	}
	return ""
}

// sources returns the source of each of sourceKeys whose value is not its
// default, or nil when none is: a configuration that sets nothing, or only
// the defaults, equals Default().
func (s sourcer) sources() map[string]string {
	defaults := map[string]string{}
	for _, k := range Keys() {
		defaults[k.Name] = fmt.Sprint(k.Default)
	}
	var out map[string]string
	for _, key := range sourceKeys {
		if val := s.v.GetString(key); val == "" || val == defaults[key] {
			continue
		}
		src := s.of(key)
		if s.ctx != nil && s.ctx.applied[key] {
			src = s.ctx.String()
		}
		if src == "" {
			continue // the default
		}
		if out == nil {
			out = map[string]string{}
		}
		out[key] = src
	}
	return out
}
