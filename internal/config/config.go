// Package config is outbox-relay's configuration: one typed struct with
// defaults, filled from a YAML file, OUTBOX_RELAY_* environment variables
// (plus the design record's aliases) and command-line flags, then validated.
package config

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// EnvPrefix starts the environment variable of every key.
const EnvPrefix = "OUTBOX_RELAY_"

// EmbeddedURL is the nats.url value that starts an in-process JetStream server.
const EmbeddedURL = "embedded"

// Config is the whole configuration. Field tags are the YAML keys.
type Config struct {
	Database  Database  `mapstructure:"database"`
	Schema    Schema    `mapstructure:"schema"`
	NATS      NATS      `mapstructure:"nats"`
	Stream    Stream    `mapstructure:"stream"`
	Consumer  Consumer  `mapstructure:"consumer"`
	Relay     Relay     `mapstructure:"relay"`
	Retention Retention `mapstructure:"retention"`
	Metrics   Metrics   `mapstructure:"metrics"`
	Log       Log       `mapstructure:"log"`
}

// Database locates the application's SQLite file and outbox table.
type Database struct {
	Path        string        `mapstructure:"path"`
	Table       string        `mapstructure:"table"`
	BusyTimeout time.Duration `mapstructure:"busy_timeout"`
}

// Schema says what the relay does about the outbox schema at startup.
type Schema struct {
	Mode string `mapstructure:"mode"` // auto, verify, off
}

// Schema modes.
const (
	SchemaAuto   = "auto"
	SchemaVerify = "verify"
	SchemaOff    = "off"
)

// NATS is the broker connection.
type NATS struct {
	URL      string   `mapstructure:"url"`
	Mode     string   `mapstructure:"mode"` // jetstream, core
	Creds    string   `mapstructure:"creds"`
	NKey     string   `mapstructure:"nkey"`
	User     string   `mapstructure:"user"`
	Password string   `mapstructure:"password"`
	Token    string   `mapstructure:"token"`
	TLS      TLS      `mapstructure:"tls"`
	Embedded Embedded `mapstructure:"embedded"`
}

// NATS modes.
const (
	ModeJetStream = "jetstream"
	ModeCore      = "core"
)

// TLS configures the client side of a TLS connection to NATS.
type TLS struct {
	CA                 string `mapstructure:"ca"`
	Cert               string `mapstructure:"cert"`
	Key                string `mapstructure:"key"`
	InsecureSkipVerify bool   `mapstructure:"insecure_skip_verify"`
	HandshakeFirst     bool   `mapstructure:"handshake_first"`
}

// Embedded configures the in-process server started when nats.url is "embedded".
type Embedded struct {
	Listen   string `mapstructure:"listen"`    // loopback host:port; port 0 picks a free one
	StoreDir string `mapstructure:"store_dir"` // empty: <database.path>.nats
}

// Stream is the JetStream stream the relay publishes into.
type Stream struct {
	Name            string        `mapstructure:"name"`
	Subjects        []string      `mapstructure:"subjects"`
	SubjectPrefix   string        `mapstructure:"subject_prefix"`
	DuplicateWindow time.Duration `mapstructure:"duplicate_window"`
	Create          bool          `mapstructure:"create"`
	Replicas        int           `mapstructure:"replicas"`
}

// Consumer is the (optional) durable consumer whose delivery limits the relay manages.
type Consumer struct {
	Durable string        `mapstructure:"durable"`
	AckWait time.Duration `mapstructure:"ack_wait"`
	Create  bool          `mapstructure:"create"`
}

// Relay tunes the claim/publish/settle loop.
type Relay struct {
	BatchSize       int           `mapstructure:"batch_size"`
	MaxInFlight     int           `mapstructure:"max_in_flight"`
	PollInterval    time.Duration `mapstructure:"poll_interval"`
	Lease           time.Duration `mapstructure:"lease"`
	MaxAttempts     int           `mapstructure:"max_attempts"`
	ShutdownTimeout time.Duration `mapstructure:"shutdown_timeout"`
	AckTimeout      time.Duration `mapstructure:"ack_timeout"`
}

// Retention says how long finished rows are kept.
type Retention struct {
	Done            time.Duration `mapstructure:"done"`
	ProcessedEvents time.Duration `mapstructure:"processed_events"`
}

// Metrics is the HTTP listener for /metrics, /healthz and /readyz.
type Metrics struct {
	Listen string `mapstructure:"listen"` // empty disables it
}

// Log configures the zap logger.
type Log struct {
	Level  string `mapstructure:"level"`  // debug, info, warn, error
	Format string `mapstructure:"format"` // json, console
}

// Default returns the built-in defaults.
func Default() Config {
	return Config{
		Database: Database{Path: "app.db", Table: "event_queue", BusyTimeout: 5 * time.Second},
		Schema:   Schema{Mode: SchemaAuto},
		NATS: NATS{
			URL:      "nats://127.0.0.1:4222",
			Mode:     ModeJetStream,
			Embedded: Embedded{Listen: "127.0.0.1:0"},
		},
		Stream: Stream{
			Name:            "EVENTS",
			Subjects:        []string{"events.>"},
			SubjectPrefix:   "events",
			DuplicateWindow: time.Hour,
			Create:          true,
			Replicas:        1,
		},
		Consumer: Consumer{AckWait: 30 * time.Second},
		Relay: Relay{
			BatchSize:       1000,
			MaxInFlight:     4000,
			PollInterval:    time.Second,
			Lease:           600 * time.Second,
			MaxAttempts:     10,
			ShutdownTimeout: 10 * time.Second,
			AckTimeout:      10 * time.Second,
		},
		Retention: Retention{Done: 7 * 24 * time.Hour, ProcessedEvents: 30 * 24 * time.Hour},
		Metrics:   Metrics{Listen: ":9108"},
		Log:       Log{Level: "info", Format: "json"},
	}
}

// aliases are the design record's environment names, honoured after the
// OUTBOX_RELAY_* name of the same key.
var aliases = map[string]string{
	"nats.url":           "NATS_URL",
	"nats.mode":          "NATS_MODE",
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
	Alias   string       // design-record alias, if any
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
			name := prefix + f.Tag.Get("mapstructure")
			if f.Type.Kind() == reflect.Struct {
				walk(f.Type, v.Field(i), name+".")
				continue
			}
			keys = append(keys, Key{
				Name:    name,
				Env:     EnvName(name),
				Alias:   aliases[name],
				Flag:    strings.NewReplacer(".", "-", "_", "-").Replace(name),
				Type:    f.Type,
				Default: v.Field(i).Interface(),
			})
		}
	}
	d := Default()
	walk(reflect.TypeOf(d), reflect.ValueOf(d), "")
	return keys
}

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

// Error is a configuration error; the command line turns it into exit code 2.
type Error struct{ Err error }

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

func configErr(format string, args ...any) error {
	return &Error{Err: fmt.Errorf(format, args...)}
}

// Load reads the configuration: defaults, then the YAML file (if file is not
// empty), then the environment, then the flags in fs that were set on the
// command line (fs may be nil). The result is validated. Every error is an
// *Error naming the key.
func Load(file string, fs *pflag.FlagSet, environ []string) (Config, error) {
	v := viper.New()
	keys := Keys()
	known := map[string]bool{}
	envs := map[string]bool{}
	for _, k := range keys {
		known[k.Name] = true
		v.SetDefault(k.Name, k.Default)
	}
	if file != "" {
		v.SetConfigFile(file)
		v.SetConfigType("yaml")
		if err := v.ReadInConfig(); err != nil {
			return Config{}, configErr("read config file %s: %w", file, err)
		}
		var unknown []string
		for _, k := range v.AllKeys() {
			if !known[k] && v.InConfig(k) {
				unknown = append(unknown, k)
			}
		}
		if len(unknown) > 0 {
			sort.Strings(unknown)
			return Config{}, configErr("unknown config key %s in %s", strings.Join(unknown, ", "), file)
		}
	}
	env := map[string]string{}
	for _, kv := range environ {
		if name, val, ok := strings.Cut(kv, "="); ok {
			env[name] = val
		}
	}
	for _, k := range keys {
		envs[k.Env] = true
		// Values come from environ rather than the process environment so
		// that tests are hermetic; the first non-empty name wins (an empty
		// variable counts as unset, as compose files leave placeholders),
		// except where empty means something of its own.
		if val, set := env[k.Env]; set && val == "" && emptyMeans[k.Name] {
			v.Set(k.Name, "")
			continue
		}
		for _, name := range []string{k.Env, k.Alias} {
			if val := env[name]; name != "" && val != "" {
				v.Set(k.Name, val)
				break
			}
		}
	}
	for name := range env {
		if strings.HasPrefix(name, EnvPrefix) && !envs[name] && !serviceLink(name) {
			return Config{}, configErr("unknown environment variable %s: no config key has that name", name)
		}
	}
	if fs != nil {
		for _, k := range keys {
			if f := fs.Lookup(k.Flag); f != nil && f.Changed {
				v.Set(k.Name, flagValue(f))
			}
		}
	}
	var c Config
	err := v.UnmarshalExact(&c, viper.DecodeHook(mapstructure.ComposeDecodeHookFunc(
		strictDurationHook,
		mapstructure.StringToTimeDurationHookFunc(),
		mapstructure.StringToSliceHookFunc(","),
	)))
	if err != nil {
		return Config{}, configErr("invalid configuration: %s", decodeMessage(err))
	}
	if err := c.Validate(); err != nil {
		return Config{}, &Error{Err: err}
	}
	return c, nil
}

// serviceLink reports whether name is one of the variables Kubernetes
// injects for a Service named outbox-relay (OUTBOX_RELAY_SERVICE_HOST,
// OUTBOX_RELAY_PORT_9108_TCP, ...), which are not config keys.
func serviceLink(name string) bool {
	rest := strings.TrimPrefix(name, EnvPrefix)
	return strings.HasPrefix(rest, "SERVICE_") || rest == "PORT" || strings.HasPrefix(rest, "PORT_")
}

// flagValue returns a set flag's value in a form the decoder takes.
func flagValue(f *pflag.Flag) any {
	if sv, ok := f.Value.(pflag.SliceValue); ok {
		return sv.GetSlice()
	}
	return f.Value.String()
}

var durationType = reflect.TypeOf(time.Duration(0))

// strictDurationHook refuses bare numbers for durations: YAML "lease: 600"
// would otherwise decode as 600 nanoseconds.
func strictDurationHook(from, to reflect.Type, data any) (any, error) {
	if to != durationType {
		return data, nil
	}
	switch from.Kind() {
	case reflect.String:
		s := data.(string)
		if _, err := time.ParseDuration(s); err != nil {
			return nil, fmt.Errorf("%q is not a duration (use a unit: 250ms, 30s, 1h)", s)
		}
		return data, nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		if from == durationType {
			return data, nil
		}
		return nil, fmt.Errorf("%v has no unit (use a duration such as 250ms, 30s, 1h)", data)
	}
	return data, nil
}

// decodeMessage flattens mapstructure's multi-line error into one line.
func decodeMessage(err error) string {
	msg := err.Error()
	msg = strings.TrimPrefix(msg, "decoding failed due to the following error(s):")
	var parts []string
	for _, line := range strings.Split(msg, "\n") {
		if line = strings.TrimSpace(line); line != "" {
			parts = append(parts, strings.TrimPrefix(line, "* "))
		}
	}
	return strings.Join(parts, "; ")
}

var (
	identRe      = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	streamNameRe = regexp.MustCompile(`^[^\s.*>/\\]+$`)
)

// Validate checks every value and returns all problems, each naming its key.
func (c *Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", key, fmt.Sprintf(format, args...)))
	}
	if c.Database.Path == "" {
		bad("database.path", "must not be empty")
	}
	if !identRe.MatchString(c.Database.Table) {
		bad("database.table", "%q is not a plain SQL identifier (letters, digits, underscore)", c.Database.Table)
	}
	if c.Database.BusyTimeout < time.Millisecond {
		bad("database.busy_timeout", "%v: must be at least 1ms (0 fails every write the application's lock delays)", c.Database.BusyTimeout)
	}
	if !slices.Contains([]string{SchemaAuto, SchemaVerify, SchemaOff}, c.Schema.Mode) {
		bad("schema.mode", "%q is not one of auto, verify, off", c.Schema.Mode)
	}
	c.validateNATS(bad)
	if !streamNameRe.MatchString(c.Stream.Name) {
		bad("stream.name", "%q is not a valid stream name (no spaces, '.', '*', '>', '/')", c.Stream.Name)
	}
	if len(c.Stream.Subjects) == 0 {
		bad("stream.subjects", "must list at least one subject")
	}
	for _, s := range c.Stream.Subjects {
		if err := validateFilter(s); err != nil {
			bad("stream.subjects", "%q: %v", s, err)
		}
	}
	if err := event.ValidateSubjectPart(c.Stream.SubjectPrefix); err != nil {
		bad("stream.subject_prefix", "%q: %v", c.Stream.SubjectPrefix, err)
	} else if c.Stream.Create && len(c.Stream.Subjects) > 0 && !event.Covers(c.Stream.Subjects, c.Stream.SubjectPrefix) {
		bad("stream.subjects", "%q do not capture %s.> (stream.subject_prefix): a stream created with them could not take the relay's messages", c.Stream.Subjects, c.Stream.SubjectPrefix)
	}
	if c.Stream.DuplicateWindow < 100*time.Millisecond {
		bad("stream.duplicate_window", "%v is below JetStream's minimum of 100ms", c.Stream.DuplicateWindow)
	}
	if c.Stream.Replicas < 1 || c.Stream.Replicas > 5 {
		bad("stream.replicas", "%d is not between 1 and 5", c.Stream.Replicas)
	}
	if c.Consumer.Durable != "" && !streamNameRe.MatchString(c.Consumer.Durable) {
		bad("consumer.durable", "%q is not a valid consumer name", c.Consumer.Durable)
	}
	if c.Consumer.AckWait <= 0 {
		bad("consumer.ack_wait", "must be positive")
	}
	if c.Consumer.Create && c.Consumer.Durable == "" {
		bad("consumer.create", "needs consumer.durable")
	}
	positive := func(key string, n int) {
		if n < 1 {
			bad(key, "%d must be at least 1", n)
		}
	}
	positive("relay.batch_size", c.Relay.BatchSize)
	positive("relay.max_in_flight", c.Relay.MaxInFlight)
	positive("relay.max_attempts", c.Relay.MaxAttempts)
	if c.Relay.MaxInFlight < c.Relay.BatchSize {
		bad("relay.max_in_flight", "%d is smaller than relay.batch_size %d", c.Relay.MaxInFlight, c.Relay.BatchSize)
	}
	if c.Relay.PollInterval <= 0 {
		bad("relay.poll_interval", "must be positive")
	}
	if min := c.Relay.AckTimeout + c.Relay.ShutdownTimeout; c.Relay.Lease <= min {
		bad("relay.lease", "%v must be longer than relay.ack_timeout + relay.shutdown_timeout (%v), or a relay could lose rows it is still waiting for", c.Relay.Lease, min)
	}
	if c.Relay.ShutdownTimeout < 0 {
		bad("relay.shutdown_timeout", "must not be negative")
	}
	if c.Relay.AckTimeout <= 0 {
		bad("relay.ack_timeout", "must be positive")
	}
	if c.Retention.Done < 0 {
		bad("retention.done", "must not be negative (0 keeps rows forever)")
	}
	if c.Retention.ProcessedEvents < 0 {
		bad("retention.processed_events", "must not be negative (0 keeps rows forever)")
	}
	if c.Metrics.Listen != "" {
		if _, _, err := net.SplitHostPort(c.Metrics.Listen); err != nil {
			bad("metrics.listen", "%q is not host:port: %v", c.Metrics.Listen, err)
		}
	}
	if !slices.Contains([]string{"debug", "info", "warn", "error"}, c.Log.Level) {
		bad("log.level", "%q is not one of debug, info, warn, error", c.Log.Level)
	}
	if !slices.Contains([]string{"json", "console"}, c.Log.Format) {
		bad("log.format", "%q is not one of json, console", c.Log.Format)
	}
	return errors.Join(errs...)
}

func (c *Config) validateNATS(bad func(key, format string, args ...any)) {
	n := c.NATS
	if n.URL == "" {
		bad("nats.url", "must not be empty")
	} else if n.URL != EmbeddedURL {
		for _, u := range strings.Split(n.URL, ",") {
			if err := validateServerURL(strings.TrimSpace(u)); err != nil {
				bad("nats.url", "%v", err)
			}
		}
	}
	if n.Mode != ModeJetStream && n.Mode != ModeCore {
		bad("nats.mode", "%q is not one of jetstream, core", n.Mode)
	}
	methods := 0
	for _, set := range []bool{n.Creds != "", n.NKey != "", n.Token != "", n.User != ""} {
		if set {
			methods++
		}
	}
	if methods > 1 {
		bad("nats.creds", "set only one of nats.creds, nats.nkey, nats.token, nats.user/nats.password")
	}
	if n.Password != "" && n.User == "" {
		bad("nats.password", "needs nats.user")
	}
	if (n.TLS.Cert == "") != (n.TLS.Key == "") {
		bad("nats.tls.cert", "nats.tls.cert and nats.tls.key go together")
	}
	if host, _, err := net.SplitHostPort(n.Embedded.Listen); err != nil {
		bad("nats.embedded.listen", "%q is not host:port: %v", n.Embedded.Listen, err)
	} else if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		bad("nats.embedded.listen", "%q is not a loopback address: the embedded server is for local use only", n.Embedded.Listen)
	}
}

func validateServerURL(s string) error {
	u, err := url.Parse(s)
	if err != nil || u.Host == "" {
		return fmt.Errorf("%q is not a server URL such as nats://host:4222", RedactURLs(s))
	}
	switch u.Scheme {
	case "nats", "tls", "ws", "wss":
		return nil
	}
	return fmt.Errorf("%q: scheme %q is not one of nats, tls, ws, wss", RedactURLs(s), u.Scheme)
}

// RedactURLs hides passwords and tokens embedded in (comma-separated)
// server URLs, for logs and errors.
func RedactURLs(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		u, err := url.Parse(strings.TrimSpace(p))
		if err != nil {
			if j := strings.LastIndex(p, "@"); j >= 0 {
				parts[i] = "xxxxx@" + p[j+1:]
			}
			continue
		}
		if u.User == nil {
			continue
		}
		if _, hasPass := u.User.Password(); hasPass {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else {
			u.User = url.User("xxxxx") // a bare user part is a token
		}
		parts[i] = u.String()
	}
	return strings.Join(parts, ",")
}

// validateFilter checks a stream subject, where wildcards are allowed.
func validateFilter(s string) error {
	if s == "" {
		return fmt.Errorf("empty subject")
	}
	toks := strings.Split(s, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return fmt.Errorf("empty token")
		case t == ">" && i != len(toks)-1:
			return fmt.Errorf("'>' must be the last token")
		case t != "*" && t != ">" && strings.ContainsAny(t, "*> \t\r\n"):
			return fmt.Errorf("invalid token %q", t)
		}
	}
	return nil
}
