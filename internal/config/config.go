// Package config is outbox-relay's configuration: one typed struct with
// defaults, filled from a natscli context, a YAML file, OUTBOX_RELAY_*
// environment variables (plus other programs' names for the same keys, such
// as natscli's NATS_URL and NATS_USER) and command-line flags, then
// validated.
package config

import (
	"time"

	"github.com/outbox-relay/outbox-relay/internal/natsname"
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
// A Path whose file name holds a glob pattern names a fleet: every
// matching file, each a tenant's (see package fleet).
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
	Name          string   `mapstructure:"name"`
	Subjects      []string `mapstructure:"subjects"`
	SubjectPrefix string   `mapstructure:"subject_prefix"`
	// SubjectTemplate is the subject's tokens after SubjectPrefix
	// (natsname.Template): {event_type}, and {tenant} for a fleet.
	SubjectTemplate string        `mapstructure:"subject_template"`
	DuplicateWindow time.Duration `mapstructure:"duplicate_window"`
	Create          bool          `mapstructure:"create"`
	Replicas        int           `mapstructure:"replicas"`
	// AllowAtomic lets the relay turn on the stream's allow_atomic and
	// publish an ordering key's due rows in atomic batches; false: one
	// row at a time, and the stream's allow_atomic is left as it is.
	AllowAtomic bool `mapstructure:"allow_atomic"`
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
	// BatchMax is how many due rows of one key the relay sends as one
	// atomic batch at most (MinBatchMax to MaxBatchMax; the server's lower
	// limit wins).
	BatchMax int `mapstructure:"batch_max"`
}

// The range of ordering.batch_max: a batch costs the server a few ms
// whatever its size, so fewer rows than MinBatchMax go one at a time
// anyway; MaxBatchMax is JetStream's default limit.
const (
	MinBatchMax = 32
	MaxBatchMax = 1000
)

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
	Done time.Duration `mapstructure:"done"`
	// DoneRows says what settling a row as done does to it: keep it in the
	// outbox table, marked done (DoneRowsKeep), or delete it and keep a
	// compact record of it in the table's records table (DoneRowsDelete).
	DoneRows        string        `mapstructure:"done_rows"`
	ProcessedEvents time.Duration `mapstructure:"processed_events"`
}

// What settling a row as done does to it (retention.done_rows).
const (
	DoneRowsKeep   = "keep"   // marked done in the outbox table
	DoneRowsDelete = "delete" // deleted; its record goes to the records table
)

// Metrics is the HTTP listener for /metrics, /healthz and /readyz.
type Metrics struct {
	Listen string `mapstructure:"listen"` // empty disables it
	// TenantLabel adds gauges with a tenant label for a fleet's files
	// (a series per tenant).
	TenantLabel bool `mapstructure:"tenant_label"`
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
			SubjectTemplate: natsname.EventTypeToken,
			DuplicateWindow: time.Hour,
			Create:          true,
			Replicas:        1,
			AllowAtomic:     true,
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
		Ordering:  Ordering{OnDeadLetter: OnDeadLetterHold, BatchMax: MaxBatchMax},
		Message:   Message{Format: FormatRaw, ContentType: "application/json"},
		Retention: Retention{Done: 7 * 24 * time.Hour, DoneRows: DoneRowsKeep, ProcessedEvents: 30 * 24 * time.Hour},
		Metrics:   Metrics{Listen: ":9108"},
		Log:       Log{Level: "info", Format: "json"},
	}
}
