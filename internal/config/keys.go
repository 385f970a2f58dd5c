package config

import (
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"github.com/spf13/viper"

	"github.com/outbox-relay/outbox-relay/internal/natsname"
)

// aliases are other programs' environment names for a key, honoured after
// the OUTBOX_RELAY_* name of the same key: natscli's connection variables
// (NATS_URL, NATS_USER, ...) and the design record's short names. NATS_USER
// without a password is a token, as natscli reads it (see bindEnv).
var aliases = map[string]string{
	"nats.url":           "NATS_URL",
	"nats.mode":          "NATS_MODE",
	"nats.context":       "NATS_CONTEXT",
	"nats.creds":         "NATS_CREDS",
	"nats.nkey":          "NATS_NKEY",
	"nats.user":          "NATS_USER",
	"nats.password":      "NATS_PASSWORD",
	"nats.token":         "NATS_TOKEN",
	"nats.tls.ca":        "NATS_CA",
	"nats.tls.cert":      "NATS_CERT",
	"nats.tls.key":       "NATS_KEY",
	"relay.max_attempts": "EVENT_QUEUE_MAX_ATTEMPTS",
}

// emptyMeans lists the keys whose empty value means something other than
// their default, so that their variable set to empty sets them.
var emptyMeans = map[string]bool{
	"metrics.listen": true, // no metrics server
}

// Key describes one configuration key.
type Key struct {
	Name    string       // dotted YAML path, e.g. relay.batch_size
	Env     string       // OUTBOX_RELAY_RELAY_BATCH_SIZE
	Alias   string       // another program's variable for the key (natscli's NATS_URL), if any
	Flag    string       // relay-batch-size
	Type    reflect.Type // Go type of the field
	Default any
}

// Keys lists every configuration key in struct order.
func Keys() []Key {
	var keys []Key
	var walk func(t reflect.Type, v reflect.Value, prefix string)
	walk = func(t reflect.Type, v reflect.Value, prefix string) {
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			if f.Tag.Get("mapstructure") == "-" {
				continue // filled by Load, not a key
			}
			name := prefix + f.Tag.Get("mapstructure")
			if f.Type.Kind() == reflect.Struct {
				walk(f.Type, v.Field(i), name+".")
				continue
			}
			keys = append(keys, Key{
				Name:    name,
				Env:     EnvName(name),
				Alias:   aliases[name],
				Flag:    FlagName(name),
				Type:    f.Type,
				Default: v.Field(i).Interface(),
			})
		}
	}
	d := Default()
	walk(reflect.TypeOf(d), reflect.ValueOf(d), "")
	return keys
}

// sections lists the dotted names of the sections (database, nats.tls, ...).
func sections() map[string]bool {
	out := map[string]bool{}
	var walk func(t reflect.Type, prefix string)
	walk = func(t reflect.Type, prefix string) {
		for i := 0; i < t.NumField(); i++ {
			if f := t.Field(i); f.Type.Kind() == reflect.Struct {
				name := prefix + f.Tag.Get("mapstructure")
				out[name] = true
				walk(f.Type, name+".")
			}
		}
	}
	walk(reflect.TypeOf(Config{}), "")
	return out
}

// FlagName returns the flag of a dotted key: relay-batch-size for
// relay.batch_size.
func FlagName(key string) string { return strings.NewReplacer(".", "-", "_", "-").Replace(key) }

// EnvName returns the environment variable of a dotted key.
func EnvName(key string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(key, ".", "_"))
}

// Secret reports whether a key holds a secret that must never be printed.
func Secret(key string) bool {
	switch key {
	case "nats.password", "nats.token":
		return true
	}
	return false
}

// BindFlags defines one flag per key on fs (e.g. --relay-batch-size), with
// the built-in default as the displayed default.
func BindFlags(fs *pflag.FlagSet) {
	for _, k := range Keys() {
		usage := fmt.Sprintf("%s (env %s)", k.Name, k.Env)
		switch d := k.Default.(type) {
		case string:
			if Secret(k.Name) {
				usage += "; prefer the environment for secrets"
			}
			if k.Name == "stream.subject_template" {
				usage += "; " + natsname.FleetTemplate + " when database.path is a pattern"
			}
			fs.String(k.Flag, d, usage)
		case int:
			fs.Int(k.Flag, d, usage)
		case bool:
			fs.Bool(k.Flag, d, usage)
		case time.Duration:
			fs.Duration(k.Flag, d, usage)
		case []string:
			fs.StringSlice(k.Flag, d, usage)
		default:
			panic(fmt.Sprintf("config key %s: no flag for type %T", k.Name, d))
		}
	}
}

// bindFlags binds each key to its flag in fs, one key at a time
// (BindPFlags would take the flag names, relay-batch-size, for keys), and
// returns the keys whose flag was set on the command line.
func bindFlags(v *viper.Viper, fs *pflag.FlagSet, keys []Key) (map[string]bool, error) {
	changed := map[string]bool{}
	if fs == nil {
		return changed, nil
	}
	for _, k := range keys {
		if f := fs.Lookup(k.Flag); f != nil {
			if err := v.BindPFlag(k.Name, f); err != nil {
				return nil, configErr("%s: %w", k.Name, err)
			}
			changed[k.Name] = f.Changed
		}
	}
	return changed, nil
}

// bindEnv binds each key to OUTBOX_RELAY_ and the key with "_" for "."
// (nats.url: OUTBOX_RELAY_NATS_URL), then to its alias (NATS_URL): the first
// of them that is set and not empty gives the value. An empty variable
// counts as unset, as compose files leave placeholders.
//
// natscli takes NATS_USER for a token when no password is given (its --user
// is "username or token"), and so does the relay, so that a token set for
// natscli neither goes out as a user name nor is shown as one in an error.
// It reports whether NATS_USER is the token.
func bindEnv(v *viper.Viper, keys []Key, changed map[string]bool) (userIsToken bool) {
	v.SetEnvPrefix(strings.TrimSuffix(EnvPrefix, "_"))
	v.SetEnvKeyReplacer(strings.NewReplacer(".", "_"))
	v.AllowEmptyEnv(false)
	for _, k := range keys {
		v.MustBindEnv(k.Name)
		if k.Alias != "" && k.Name != "nats.user" {
			v.MustBindEnv(k.Name, k.Alias)
		}
	}
	// The password's own variables are bound by now: is one set anywhere?
	userIsToken = os.Getenv(aliases["nats.user"]) != "" && os.Getenv(EnvName("nats.user")) == "" &&
		!changed["nats.user"] && v.GetString("nats.password") == ""
	if userIsToken {
		v.MustBindEnv("nats.token", aliases["nats.user"])
	} else {
		v.MustBindEnv("nats.user", aliases["nats.user"])
	}
	return userIsToken
}

// setEmptyEnv gives the keys of emptyMeans the empty value of their
// variable. Viper counts empty variables as unset for every key or for none
// (AllowEmptyEnv). Set is viper's layer above the flags: a flag set on the
// command line keeps its place above the environment.
func setEmptyEnv(v *viper.Viper, keys []Key, changed map[string]bool) {
	for _, k := range keys {
		if val, set := os.LookupEnv(k.Env); set && val == "" && emptyMeans[k.Name] && !changed[k.Name] {
			v.Set(k.Name, "")
		}
	}
}

// checkEnv refuses an OUTBOX_RELAY_* variable that is no key's, which viper
// would silently ignore: a misspelt name must not leave its key at the
// file's value or the default.
func checkEnv(keys []Key) error {
	envs := map[string]bool{}
	for _, k := range keys {
		envs[k.Env] = true
	}
	var unknown []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, EnvPrefix) && !envs[name] && !serviceLink(name) {
			unknown = append(unknown, name)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		msg := fmt.Sprintf("unknown environment variable %s: no config key has that name", unknown[0])
		if near := nearestEnv(unknown[0], keys); near != "" {
			msg += fmt.Sprintf(" (did you mean %s?)", near)
		}
		return configErr("%s", msg)
	}
	return nil
}

// serviceLink reports whether name is one of the variables Kubernetes
// injects for a Service named outbox-relay (OUTBOX_RELAY_SERVICE_HOST,
// OUTBOX_RELAY_PORT_9108_TCP, ...), which are not config keys.
func serviceLink(name string) bool {
	rest := strings.TrimPrefix(name, EnvPrefix)
	return strings.HasPrefix(rest, "SERVICE_") || rest == "PORT" || strings.HasPrefix(rest, "PORT_")
}
