package config

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/spf13/pflag"
)

func writeFile(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// fileOf writes text as a configuration file, when there is any.
func fileOf(t *testing.T, text string) string {
	t.Helper()
	if text == "" {
		return ""
	}
	return writeFile(t, text)
}

func flags(t *testing.T, args ...string) *pflag.FlagSet {
	t.Helper()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return fs
}

// load makes env the configuration's environment (see setEnv) and loads.
func load(t *testing.T, file string, fs *pflag.FlagSet, env []string) (Config, error) {
	t.Helper()
	setEnv(t, env)
	return Load(file, fs)
}

// setEnv makes env the only configuration variables of the process
// environment, which is what Load reads, until the test ends (see
// testenv.ReplaceEnv).
func setEnv(t *testing.T, env []string) {
	t.Helper()
	var aliases []string
	for _, k := range Keys() {
		aliases = append(aliases, k.Alias)
	}
	testenv.ReplaceEnv(t, EnvPrefix, aliases, env)
}

func TestDefaultsValidate(t *testing.T) {
	c, err := load(t, "", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, Default()) {
		t.Fatalf("Load with nothing set = %+v, want defaults", c)
	}
}

func TestPrecedenceFileEnvFlag(t *testing.T) {
	file := writeFile(t, `
database:
  path: /file.db
  busy_timeout: 2s
relay:
  batch_size: 10
  max_in_flight: 20
  poll_interval: 3s
stream:
  subjects: [a.>, events.>]
`)
	env := []string{
		"OUTBOX_RELAY_RELAY_BATCH_SIZE=30",
		"OUTBOX_RELAY_RELAY_MAX_IN_FLIGHT=40",
		"OUTBOX_RELAY_DATABASE_BUSY_TIMEOUT=250ms",
		"UNRELATED=1",
	}
	c, err := load(t, file, flags(t, "--relay-max-in-flight=50", "--stream-subjects=x.>,events.>"), env)
	if err != nil {
		t.Fatal(err)
	}
	if c.Database.Path != "/file.db" {
		t.Errorf("file value lost: path %q", c.Database.Path)
	}
	if c.Relay.PollInterval != 3*time.Second {
		t.Errorf("file duration: %v", c.Relay.PollInterval)
	}
	if c.Relay.BatchSize != 30 || c.Database.BusyTimeout != 250*time.Millisecond {
		t.Errorf("env must beat file: batch %d busy %v", c.Relay.BatchSize, c.Database.BusyTimeout)
	}
	if c.Relay.MaxInFlight != 50 {
		t.Errorf("flag must beat env: max_in_flight %d", c.Relay.MaxInFlight)
	}
	if !reflect.DeepEqual(c.Stream.Subjects, []string{"x.>", "events.>"}) {
		t.Errorf("flag list: %q", c.Stream.Subjects)
	}
}

func TestEnvList(t *testing.T) {
	c, err := load(t, "", nil, []string{"OUTBOX_RELAY_STREAM_SUBJECTS=a.>,events.>", "OUTBOX_RELAY_STREAM_CREATE=false", "OUTBOX_RELAY_STREAM_ALLOW_ATOMIC=false"})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c.Stream.Subjects, []string{"a.>", "events.>"}) || c.Stream.Create || c.Stream.AllowAtomic {
		t.Fatalf("subjects %q create %v allow_atomic %v", c.Stream.Subjects, c.Stream.Create, c.Stream.AllowAtomic)
	}
}

func TestAliases(t *testing.T) {
	c, err := load(t, "", nil, []string{"NATS_URL=nats://a:4222,nats://b:4222", "NATS_MODE=core", "EVENT_QUEUE_MAX_ATTEMPTS=3"})
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.URL != "nats://a:4222,nats://b:4222" || c.NATS.Mode != "core" || c.Relay.MaxAttempts != 3 {
		t.Fatalf("aliases not honoured: %+v %+v", c.NATS, c.Relay)
	}
	// The relay's own name wins over the alias.
	c, err = load(t, "", nil, []string{"NATS_URL=nats://alias:4222", "OUTBOX_RELAY_NATS_URL=nats://own:4222"})
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.URL != "nats://own:4222" {
		t.Fatalf("OUTBOX_RELAY_NATS_URL must beat NATS_URL, got %q", c.NATS.URL)
	}
}

// TestEmptyEnvironmentVariable: OUTBOX_RELAY_METRICS_LISTEN set to empty
// turns metrics off, as "empty disables" says, also over a file's value;
// other variables set to empty count as unset (compose placeholders), and a
// flag still beats the environment.
func TestEmptyEnvironmentVariable(t *testing.T) {
	file := writeFile(t, "metrics:\n  listen: 127.0.0.1:9999\nnats:\n  user: u\n  password: from-file\n")
	empty := []string{"OUTBOX_RELAY_METRICS_LISTEN=", "OUTBOX_RELAY_RELAY_BATCH_SIZE=", "OUTBOX_RELAY_NATS_PASSWORD=", "OUTBOX_RELAY_NATS_URL=", "NATS_URL=nats://alias:4222"}
	c, err := load(t, file, nil, empty)
	if err != nil {
		t.Fatal(err)
	}
	if c.Metrics.Listen != "" {
		t.Fatalf("metrics.listen = %q with OUTBOX_RELAY_METRICS_LISTEN empty; want it off", c.Metrics.Listen)
	}
	if c.Relay.BatchSize != Default().Relay.BatchSize || c.NATS.Password != "from-file" || c.NATS.URL != "nats://alias:4222" {
		t.Fatalf("empty variables must count as unset: batch %d, password %q, url %q", c.Relay.BatchSize, c.NATS.Password, c.NATS.URL)
	}
	if c, err = load(t, file, flags(t, "--metrics-listen=127.0.0.1:7777"), empty); err != nil || c.Metrics.Listen != "127.0.0.1:7777" {
		t.Fatalf("the flag must beat the empty variable: %q, %v", c.Metrics.Listen, err)
	}
	if c, err = load(t, file, nil, nil); err != nil || c.Metrics.Listen != "127.0.0.1:9999" {
		t.Fatalf("without the variable: %q, %v", c.Metrics.Listen, err)
	}
}

func TestErrorsNameTheKey(t *testing.T) {
	for _, tc := range []struct {
		name, file string
		env        []string
		args       []string
		want       string
	}{
		{name: "unknown file key", file: "nats:\n  urll: x\n", want: "nats.urll"},
		{name: "unknown section", file: "natz:\n  url: x\n", want: "natz.url"},
		{name: "unknown env", env: []string{"OUTBOX_RELAY_NATS_URLL=x"}, want: "OUTBOX_RELAY_NATS_URLL"},
		{name: "bad duration file", file: "relay:\n  lease: soon\n", want: "relay.lease"},
		{name: "bad duration env", env: []string{"OUTBOX_RELAY_RELAY_LEASE=10 minutes"}, want: "relay.lease"},
		{name: "duration without unit", file: "relay:\n  lease: 600\n", want: "relay.lease"},
		{name: "bad int", env: []string{"OUTBOX_RELAY_RELAY_BATCH_SIZE=many"}, want: "relay.batch_size"},
		{name: "bad mode alias", env: []string{"NATS_MODE=kafka"}, want: "nats.mode"},
		{name: "bad table", file: "database:\n  table: \"x; drop\"\n", want: "database.table"},
		{name: "bad schema mode", env: []string{"OUTBOX_RELAY_SCHEMA_MODE=yolo"}, want: "schema.mode"},
		{name: "zero batch", args: []string{"--relay-batch-size=0"}, want: "relay.batch_size"},
		{name: "atomic batch too small", env: []string{"OUTBOX_RELAY_ORDERING_BATCH_MAX=10"}, want: "ordering.batch_max"},
		{name: "atomic batch too large", args: []string{"--ordering-batch-max=1001"}, want: "ordering.batch_max"},
		{name: "bad url", env: []string{"NATS_URL=http://x:1"}, want: "nats.url"},
		{name: "embedded not loopback", env: []string{"OUTBOX_RELAY_NATS_EMBEDDED_LISTEN=0.0.0.0:4222"}, want: "nats.embedded.listen"},
		{name: "bad prefix", env: []string{"OUTBOX_RELAY_STREAM_SUBJECT_PREFIX=a.*"}, want: "stream.subject_prefix"},
		{name: "template without the event type", env: []string{"OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE={tenant}.events"}, want: "stream.subject_template"},
		{name: "template with the tenant twice", env: []string{"OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE={tenant}.{tenant}.{event_type}"}, want: "stream.subject_template"},
		{name: "template with an unknown placeholder", env: []string{"OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE={customer}.{event_type}"}, want: "stream.subject_template"},
		{name: "template with a wildcard", env: []string{"OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE=*.{event_type}"}, want: "stream.subject_template"},
		{name: "small dupe window", env: []string{"OUTBOX_RELAY_STREAM_DUPLICATE_WINDOW=10ms"}, want: "stream.duplicate_window"},
		{name: "log level", env: []string{"OUTBOX_RELAY_LOG_LEVEL=loud"}, want: "log.level"},
		{name: "in flight below batch", env: []string{"OUTBOX_RELAY_RELAY_BATCH_SIZE=500", "OUTBOX_RELAY_RELAY_MAX_IN_FLIGHT=100"}, want: "relay.max_in_flight"},
		{name: "lease too short", env: []string{"OUTBOX_RELAY_RELAY_LEASE=15s"}, want: "relay.lease"},
		{name: "subjects miss the prefix", env: []string{"OUTBOX_RELAY_STREAM_SUBJECT_PREFIX=app"}, want: "stream.subjects"},
		{name: "zero busy timeout", env: []string{"OUTBOX_RELAY_DATABASE_BUSY_TIMEOUT=0s"}, want: "database.busy_timeout"},
		{name: "bad message format", env: []string{"OUTBOX_RELAY_MESSAGE_FORMAT=avro"}, want: "message.format"},
		{name: "cloudevents without a source", file: "message:\n  format: cloudevents\n", want: "message.source: must be set with message.format cloudevents"},
		{name: "source not a URI reference", file: "message:\n  format: cloudevents\n  source: \"http://[::1\"\n", want: `message.source: "http://[::1" is not a URI reference`},
		{name: "source with a bad escape", file: "message:\n  format: cloudevents\n  source: \"/a%zz\"\n", want: `message.source: "/a%zz" is not a URI reference`},
		{name: "source with a control character", file: "message:\n  format: cloudevents\n  source: \"/a\\x01b\"\n", want: "message.source"},
		{name: "content type with a newline", file: "message:\n  content_type: \"a\\nb\"\n", want: "message.content_type"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := fileOf(t, tc.file)
			var fs *pflag.FlagSet
			if tc.args != nil {
				fs = flags(t, tc.args...)
			}
			_, err := load(t, file, fs, tc.env)
			if err == nil {
				t.Fatalf("no error; want one naming %s", tc.want)
			}
			var ce *Error
			if !errors.As(err, &ce) {
				t.Fatalf("error %v is not a config.Error", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not name %s", err, tc.want)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("error %q spans lines", err)
			}
		})
	}
}

func TestPasswordInURLNotEchoed(t *testing.T) {
	_, err := load(t, "", nil, []string{"NATS_URL=http://user:hunter2@x:1"})
	if err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("error %v must reject the URL without echoing its password", err)
	}
}

func TestKeysHaveFlagsAndEnv(t *testing.T) {
	fs := pflag.NewFlagSet("x", pflag.ContinueOnError)
	BindFlags(fs)
	for _, k := range Keys() {
		if fs.Lookup(k.Flag) == nil {
			t.Errorf("key %s has no flag", k.Name)
		}
		if !strings.HasPrefix(k.Env, EnvPrefix) {
			t.Errorf("key %s env %s", k.Name, k.Env)
		}
	}
	if EnvName("nats.tls.ca") != "OUTBOX_RELAY_NATS_TLS_CA" {
		t.Fatal(EnvName("nats.tls.ca"))
	}
}

func TestKubernetesServiceLinksIgnored(t *testing.T) {
	_, err := load(t, "", nil, []string{"OUTBOX_RELAY_SERVICE_HOST=10.0.0.1", "OUTBOX_RELAY_SERVICE_PORT=9108",
		"OUTBOX_RELAY_PORT=tcp://10.0.0.1:9108", "OUTBOX_RELAY_PORT_9108_TCP_ADDR=10.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
}

// TestAliasPrecedence: the alias environment names (NATS_URL, ...) sit at
// the environment level: above the file, below flags.
func TestAliasPrecedence(t *testing.T) {
	file := writeFile(t, "nats:\n  url: nats://file:4222\nrelay:\n  max_attempts: 4\n")
	c, err := load(t, file, nil, []string{"NATS_URL=nats://alias:4222", "EVENT_QUEUE_MAX_ATTEMPTS=5"})
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.URL != "nats://alias:4222" || c.Relay.MaxAttempts != 5 {
		t.Fatalf("alias must beat the file: %q %d", c.NATS.URL, c.Relay.MaxAttempts)
	}
	c, err = load(t, file, flags(t, "--nats-url=nats://flag:4222", "--relay-max-attempts=6"), []string{"NATS_URL=nats://alias:4222", "EVENT_QUEUE_MAX_ATTEMPTS=5"})
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.URL != "nats://flag:4222" || c.Relay.MaxAttempts != 6 {
		t.Fatalf("flag must beat the alias: %q %d", c.NATS.URL, c.Relay.MaxAttempts)
	}
}

// TestAFleetsSubjectsNameTheTenantByDefault: a database.path pattern makes
// the default template put the tenant first; a template set anywhere is
// kept, an empty one is the default, and a single file's is {event_type}.
// The flag's help says so.
func TestAFleetsSubjectsNameTheTenantByDefault(t *testing.T) {
	if usage := flags(t).Lookup("stream-subject-template").Usage; !strings.Contains(usage, "{tenant}.{event_type} when database.path is a pattern") {
		t.Errorf("--stream-subject-template's help does not give a fleet's default: %q", usage)
	}
	fleet := "OUTBOX_RELAY_DATABASE_PATH=/data/tenants/*.db"
	shared := "stream:\n  subject_template: \"{event_type}\"\n"
	for _, tc := range []struct {
		name string
		file string
		fs   []string
		env  []string
		want string
	}{
		{name: "one file", want: "{event_type}"},
		{name: "a fleet", env: []string{fleet}, want: "{tenant}.{event_type}"},
		{name: "a fleet, the variable empty", env: []string{fleet, "OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE="}, want: "{tenant}.{event_type}"},
		{name: "a fleet, the template in the file", env: []string{fleet}, file: shared, want: "{event_type}"},
		{name: "a fleet, the template in the environment", env: []string{fleet, "OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE=x.{event_type}"}, want: "x.{event_type}"},
		{name: "a fleet, the template a flag", env: []string{fleet}, fs: []string{"--stream-subject-template={event_type}.{tenant}"}, want: "{event_type}.{tenant}"},
		{name: "a fleet in the file", file: "database:\n  path: /data/*.db\n", want: "{tenant}.{event_type}"},
		{name: "a fleet, the template empty in the file", file: "database:\n  path: /data/*.db\nstream:\n  subject_template: \"\"\n", want: "{tenant}.{event_type}"},
		{name: "one file, the template empty in the file", file: "stream:\n  subject_template: \"\"\n", want: "{event_type}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := fileOf(t, tc.file)
			c, err := load(t, file, flags(t, tc.fs...), tc.env)
			if err != nil {
				t.Fatal(err)
			}
			if c.Stream.SubjectTemplate != tc.want {
				t.Fatalf("stream.subject_template = %q, want %q", c.Stream.SubjectTemplate, tc.want)
			}
		})
	}
}
