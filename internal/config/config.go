// Package config is outbox-relay's configuration: one typed struct with
// defaults, filled from a natscli context, a YAML file, OUTBOX_RELAY_*
// environment variables (plus other programs' names for the same keys, such
// as natscli's NATS_URL and NATS_USER) and command-line flags, then
// validated.
package config

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
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
	Ordering  Ordering  `mapstructure:"ordering"`
	Message   Message   `mapstructure:"message"`
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
	Mode     string   `mapstructure:"mode"`    // jetstream, core
	Context  string   `mapstructure:"context"` // natscli context: a name or a .json file
	Creds    string   `mapstructure:"creds"`
	NKey     string   `mapstructure:"nkey"`
	User     string   `mapstructure:"user"`
	Password string   `mapstructure:"password"`
	Token    string   `mapstructure:"token"`
	TLS      TLS      `mapstructure:"tls"`
	Embedded Embedded `mapstructure:"embedded"`

	// Sources says where each connection setting that is not at its
	// default came from (key -> "NATS_PASSWORD", "--nats-user", "nats.creds
	// in /etc/outbox-relay.yaml", `nats context "prod"`), so that a refused
	// connection can say what was sent and where to change it. It is no
	// configuration key; nil when every such setting is at its default.
	Sources map[string]string `mapstructure:"-"`
}

// From says where the setting key came from: its source when Load recorded
// one, else the key itself.
func (n NATS) From(key string) string {
	if s := n.Sources[key]; s != "" {
		return s
	}
	return key
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

// Ordering says what happens to the rows of an ordering key when one of
// them is dead-lettered.
type Ordering struct {
	OnDeadLetter string `mapstructure:"on_dead_letter"` // hold, skip
}

// What a dead letter does to the later rows of its ordering key.
const (
	OnDeadLetterHold = "hold" // they wait until it is retried or deleted
	OnDeadLetterSkip = "skip" // they go on
)

// Parks reports whether a dead-lettered row parks its ordering key: the
// key's later rows wait until it is retried or deleted (on_dead_letter:
// hold).
func (o Ordering) Parks() bool { return o.OnDeadLetter != OnDeadLetterSkip }

// Message says how a message is laid out besides the relay's headers.
type Message struct {
	Format      string `mapstructure:"format"`       // raw, cloudevents
	Source      string `mapstructure:"source"`       // ce-source (cloudevents)
	ContentType string `mapstructure:"content_type"` // content-type (cloudevents)
}

// Message formats.
const (
	FormatRaw         = "raw"         // the payload and the relay's headers
	FormatCloudEvents = "cloudevents" // also the CloudEvents binary-mode headers
)

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
		Ordering:  Ordering{OnDeadLetter: OnDeadLetterHold},
		Message:   Message{Format: FormatRaw, ContentType: "application/json"},
		Retention: Retention{Done: 7 * 24 * time.Hour, ProcessedEvents: 30 * 24 * time.Hour},
		Metrics:   Metrics{Listen: ":9108"},
		Log:       Log{Level: "info", Format: "json"},
	}
}

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
				Flag:    flagName(name),
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

// flagName returns the flag of a dotted key: relay-batch-size for
// relay.batch_size.
func flagName(key string) string { return strings.NewReplacer(".", "-", "_", "-").Replace(key) }

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

// Load reads the configuration: defaults, then the natscli context named by
// nats.context (if any), then the YAML file (if file is not empty), then the
// process environment, then the flags in fs that were set on the command
// line (fs may be nil). The result is validated. Every error is an *Error
// naming the key.
//
// Each source is a layer of viper's own: defaults, the file (merged as a
// map, see readFile), the environment variables bound to each key and the
// flags bound to each key, which viper only takes when they were set on the
// command line. A few rules viper has no setting for are kept here: an
// unknown OUTBOX_RELAY_* variable is an error, an empty variable sets the
// keys of emptyMeans, and the natscli context fills only what the other
// sources leave empty (see applyContext).
func Load(file string, fs *pflag.FlagSet) (Config, error) {
	v := viper.New()
	keys := Keys()
	known := map[string]bool{}
	for _, k := range keys {
		known[k.Name] = true
		v.SetDefault(k.Name, k.Default)
	}
	if file != "" {
		m, written, err := readFile(file)
		if err != nil {
			return Config{}, err
		}
		if err := v.MergeConfigMap(m); err != nil {
			return Config{}, configErr("read config file %s: %w", file, err)
		}
		// Before the environment and flags are bound: viper lists a bound
		// key in AllKeys and would then hide the file's keys under it
		// (nats.password.x under nats.password).
		if err := checkFileKeys(v, known, written, file); err != nil {
			return Config{}, err
		}
	}
	if err := checkEnv(keys); err != nil {
		return Config{}, err
	}
	changed, err := bindFlags(v, fs, keys)
	if err != nil {
		return Config{}, err
	}
	userIsToken := bindEnv(v, keys, changed)
	// Viper counts empty variables as unset for every key or for none
	// (AllowEmptyEnv), so the keys whose empty value means something get it
	// here. Set is viper's layer above the flags: a flag set on the command
	// line keeps its place above the environment.
	for _, k := range keys {
		if val, set := os.LookupEnv(k.Env); set && val == "" && emptyMeans[k.Name] && !changed[k.Name] {
			v.Set(k.Name, "")
		}
	}
	src := sourcer{v: v, file: file, changed: changed, userIsToken: userIsToken}
	if src.ctx, err = applyContext(v, src.of); err != nil {
		return Config{}, err
	}
	var c Config
	err = v.UnmarshalExact(&c, viper.DecodeHook(mapstructure.ComposeDecodeHookFunc(
		strictDurationHook,
		strictIntHook,
		mapstructure.StringToTimeDurationHookFunc(),
		mapstructure.StringToSliceHookFunc(","),
	)))
	if err != nil {
		return Config{}, configErr("%s", decodeMessage(err))
	}
	c.NATS.Sources = src.sources()
	if err := c.Validate(); err != nil {
		return Config{}, &Error{Err: err}
	}
	return c, nil
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

// readFile reads the YAML file for viper. A section written with nothing
// under it (YAML null) is left out, as if absent: viper would otherwise take
// the null for the whole section and, once the environment or a flag sets
// one of its keys, lose the defaults of the others. An integer key keeps its
// text as written, so that the decoder can refuse 1.5 and report
// 99999999999999999999 as it stands instead of a float's wrapped-around
// conversion. It also returns each dotted key of the file as written, by
// its lowercased form (viper's), so that errors can show the user's own
// spelling (relay.batchSize, not relay.batchsize).
func readFile(file string) (map[string]any, map[string]string, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, nil, configErr("read config file %s: %w", file, err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, nil, configErr("read config file %s: %s", file, oneLine(err.Error()))
	}
	m := map[string]any{}
	if len(doc.Content) == 0 {
		return m, nil, nil // empty file
	}
	root := doc.Content[0]
	if isNull(root) {
		return m, nil, nil
	}
	if root.Kind != yaml.MappingNode {
		return nil, nil, configErr("read config file %s: the top level must be sections such as database: and nats:", file)
	}
	if err := root.Decode(&m); err != nil {
		return nil, nil, configErr("read config file %s: %s", file, oneLine(err.Error()))
	}
	ints := map[string]bool{}
	for _, k := range Keys() {
		if k.Type.Kind() == reflect.Int {
			ints[k.Name] = true
		}
	}
	prepareFile(root, m, "", sections(), ints)
	written := map[string]string{}
	writtenKeys(root, "", written)
	return m, written, nil
}

// prepareFile drops the null sections of the mapping node and its decoded
// form m, and puts back the text of integer keys (see readFile).
func prepareFile(node *yaml.Node, m map[string]any, prefix string, sections, ints map[string]bool) {
	for i := 0; i+1 < len(node.Content); i += 2 {
		key, val := node.Content[i], node.Content[i+1]
		if val.Kind == yaml.AliasNode && val.Alias != nil {
			val = val.Alias
		}
		name := prefix + strings.ToLower(key.Value)
		switch {
		case sections[name] && isNull(val):
			delete(m, key.Value)
		case sections[name] && val.Kind == yaml.MappingNode:
			if sub, ok := m[key.Value].(map[string]any); ok {
				prepareFile(val, sub, name+".", sections, ints)
			}
		case ints[name] && val.Kind == yaml.ScalarNode && !isNull(val):
			m[key.Value] = val.Value
		}
	}
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

// checkFileKeys refuses keys of the file that are not configuration keys,
// each shown as written with the nearest known key when one is close, and
// values of the wrong shape: keys under a key that takes a value (not
// shown: under nats.password they could be the password), a value where a
// section belongs.
func checkFileKeys(v *viper.Viper, known map[string]bool, written map[string]string, file string) error {
	secs := sections()
	var msgs []string
	shape := map[string]string{}
	for _, k := range v.AllKeys() {
		if known[k] || !v.InConfig(k) {
			continue
		}
		if secs[k] {
			shape[k] = fmt.Sprintf("%s: must be a section with keys under it, not a single value (in %s)", k, file)
			continue
		}
		if leaf := knownPrefix(k, known); leaf != "" {
			shape[leaf] = fmt.Sprintf("%s: takes a value, not keys under it (in %s)", leaf, file)
			continue
		}
		name := k
		if w := written[k]; w != "" {
			name = w
		}
		msg := fmt.Sprintf("unknown config key %s in %s", name, file)
		if near := nearestKey(name, known); near != "" {
			msg += fmt.Sprintf(" (did you mean %s?)", near)
		}
		msgs = append(msgs, msg)
	}
	sort.Strings(msgs)
	for _, k := range slices.Sorted(maps.Keys(shape)) {
		msgs = append(msgs, shape[k])
	}
	if len(msgs) > 0 {
		return configErr("%s", strings.Join(msgs, "; "))
	}
	return nil
}

// knownPrefix returns the configuration key that the dotted name k lies
// under (nats.password for nats.password.x), or "".
func knownPrefix(k string, known map[string]bool) string {
	for i := strings.LastIndex(k, "."); i > 0; i = strings.LastIndex(k[:i], ".") {
		if known[k[:i]] {
			return k[:i]
		}
	}
	return ""
}

// serviceLink reports whether name is one of the variables Kubernetes
// injects for a Service named outbox-relay (OUTBOX_RELAY_SERVICE_HOST,
// OUTBOX_RELAY_PORT_9108_TCP, ...), which are not config keys.
func serviceLink(name string) bool {
	rest := strings.TrimPrefix(name, EnvPrefix)
	return strings.HasPrefix(rest, "SERVICE_") || rest == "PORT" || strings.HasPrefix(rest, "PORT_")
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

var intType = reflect.TypeOf(0)

// strictIntHook refuses what is not an integer as written (1.5, 1e3, true)
// and reports a number out of range as it was written: the decoder would
// truncate the one and wrap the other around to a negative number.
func strictIntHook(from, to reflect.Type, data any) (any, error) {
	if to != intType {
		return data, nil
	}
	v := reflect.ValueOf(data)
	switch from.Kind() {
	case reflect.String:
		s := v.String()
		// Base 10 only: "010" is ten to an operator, not eight.
		n, err := strconv.ParseInt(strings.TrimPrefix(s, "+"), 10, strconv.IntSize)
		switch {
		case errors.Is(err, strconv.ErrRange) && strings.HasPrefix(s, "-"):
			return nil, fmt.Errorf("%s is out of range (at least %d)", s, math.MinInt)
		case errors.Is(err, strconv.ErrRange):
			return nil, fmt.Errorf("%s is out of range (at most %d)", s, math.MaxInt)
		case err != nil:
			return nil, fmt.Errorf("%q is not an integer", s)
		}
		return int(n), nil
	case reflect.Float32, reflect.Float64:
		f := v.Float()
		switch {
		case f != math.Trunc(f) || math.IsInf(f, 0):
			return nil, fmt.Errorf("%v is not an integer", data)
		case f < math.MinInt || f >= math.MaxInt:
			return nil, fmt.Errorf("%v is out of range (between %d and %d)", data, math.MinInt, math.MaxInt)
		}
		return int(f), nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		if v.Uint() > math.MaxInt {
			return nil, fmt.Errorf("%d is out of range (at most %d)", v.Uint(), math.MaxInt)
		}
		return int(v.Uint()), nil
	case reflect.Bool:
		return nil, fmt.Errorf("%v is not an integer", data)
	}
	return data, nil
}

// decodeMessage turns mapstructure's errors into one line of
// "key: what is wrong". The value of a key that holds a secret (or a URL,
// which may hold one) is never shown.
func decodeMessage(err error) string {
	var parts []string
	var walk func(err error)
	walk = func(err error) {
		// Descend through joins, nested decode errors and the wrapper
		// mapstructure puts around several errors.
		var inner error
		switch e := err.(type) {
		case interface{ Unwrap() []error }:
			for _, x := range e.Unwrap() {
				walk(x)
			}
			return
		case *mapstructure.DecodeError:
			inner = e.Unwrap()
		default:
			inner = errors.Unwrap(err)
		}
		switch inner.(type) {
		case *mapstructure.DecodeError, interface{ Unwrap() []error }:
			walk(inner)
			return
		}
		de, ok := err.(*mapstructure.DecodeError)
		switch {
		case !ok:
			parts = append(parts, oneLine(err.Error()))
		case de.Name() == "nats.url":
			parts = append(parts, "nats.url: must be a string (servers separated by commas)")
		case Secret(de.Name()):
			parts = append(parts, de.Name()+": must be a string")
		case inner == nil:
			parts = append(parts, oneLine(err.Error()))
		default:
			parts = append(parts, de.Name()+": "+oneLine(inner.Error()))
		}
	}
	walk(err)
	return strings.Join(parts, "; ")
}

// oneLine joins the lines of a message with "; ".
func oneLine(msg string) string {
	var parts []string
	for _, line := range strings.Split(msg, "\n") {
		if line = strings.TrimSpace(line); line != "" {
			parts = append(parts, strings.TrimPrefix(line, "* "))
		}
	}
	return strings.Join(parts, "; ")
}

var (
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
	if !schema.PlainIdentifier(c.Database.Table) {
		bad("database.table", "%q is not a plain SQL identifier (letters, digits, underscore)", c.Database.Table)
	} else if sqlKeyword(c.Database.Table) {
		bad("database.table", "%q is an SQL keyword, and the table name goes into SQL unquoted: choose another name", c.Database.Table)
	}
	if c.Database.BusyTimeout < time.Millisecond {
		bad("database.busy_timeout", "%v: must be at least 1ms (0 fails every write the application's lock delays)", c.Database.BusyTimeout)
	}
	if !slices.Contains([]string{SchemaAuto, SchemaVerify, SchemaOff}, c.Schema.Mode) {
		bad("schema.mode", "%q is not one of auto, verify, off", c.Schema.Mode)
	}
	if !slices.Contains([]string{OnDeadLetterHold, OnDeadLetterSkip}, c.Ordering.OnDeadLetter) {
		bad("ordering.on_dead_letter", "%q is not one of hold, skip", c.Ordering.OnDeadLetter)
	}
	switch c.Message.Format {
	case FormatRaw:
	case FormatCloudEvents:
		if strings.TrimSpace(c.Message.Source) == "" {
			bad("message.source", "must be set with message.format cloudevents: it is every event's ce-source (a URI reference naming the application, such as /reviews)")
		}
	default:
		bad("message.format", "%q is not one of raw, cloudevents", c.Message.Format)
	}
	for key, v := range map[string]string{"message.source": c.Message.Source, "message.content_type": c.Message.ContentType} {
		if v != strings.TrimSpace(v) || strings.ContainsAny(v, "\r\n\x00") {
			bad(key, "%q is not a header value NATS carries as it is (surrounding whitespace or control characters)", v)
		}
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
	// A key named with its source: the value may come from a variable or a
	// natscli context the user did not think of.
	key := func(k string) string { return label(k, n.Sources[k]) }
	if n.URL == "" {
		bad("nats.url", "must not be empty")
	} else if n.URL != EmbeddedURL {
		for _, err := range validateServerURLs(n.URL) {
			bad(key("nats.url"), "%v", err)
		}
	}
	if n.Mode != ModeJetStream && n.Mode != ModeCore {
		bad("nats.mode", "%q is not one of jetstream, core", n.Mode)
	}
	var methods []string
	for k, set := range map[string]bool{"nats.creds": n.Creds != "", "nats.nkey": n.NKey != "", "nats.token": n.Token != "", "nats.user": n.User != ""} {
		if set {
			methods = append(methods, key(k))
		}
	}
	if len(methods) > 1 {
		sort.Strings(methods)
		bad("nats.creds", "set only one of nats.creds, nats.nkey, nats.token, nats.user/nats.password; set now: %s", strings.Join(methods, ", "))
	}
	if n.Password != "" && n.User == "" {
		bad(key("nats.password"), "needs nats.user")
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
