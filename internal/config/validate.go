package config

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"sort"
	"strings"
	"time"
	"unicode"

	"github.com/outbox-relay/outbox-relay/internal/natsname"
	"github.com/outbox-relay/outbox-relay/internal/schema"
)

// problems collects what Validate finds, each as "key: what is wrong".
type problems []error

func (p *problems) add(key, format string, args ...any) {
	*p = append(*p, fmt.Errorf("%s: %s", key, fmt.Sprintf(format, args...)))
}

// oneOf adds a problem when v is not one of allowed.
func (p *problems) oneOf(key, v string, allowed ...string) {
	if !slices.Contains(allowed, v) {
		p.add(key, "%q is not one of %s", v, strings.Join(allowed, ", "))
	}
}

// atLeastOne adds a problem when n is below 1.
func (p *problems) atLeastOne(key string, n int) {
	if n < 1 {
		p.add(key, "%d must be at least 1", n)
	}
}

// Validate checks every value and returns all problems, each naming its key.
func (c *Config) Validate() error {
	var p problems
	validateDatabase(&p, c.Database)
	p.oneOf("schema.mode", c.Schema.Mode, SchemaAuto, SchemaVerify, SchemaOff)
	p.oneOf("ordering.on_dead_letter", c.Ordering.OnDeadLetter, OnDeadLetterHold, OnDeadLetterSkip)
	if b := c.Ordering.BatchMax; b < MinBatchMax || b > MaxBatchMax {
		p.add("ordering.batch_max", "%d is not between %d and %d (rows of a key go one at a time below %d waiting; stream.allow_atomic: false turns batches off)",
			b, MinBatchMax, MaxBatchMax, MinBatchMax)
	}
	validateMessage(&p, c.Message)
	validateNATS(&p, c.NATS)
	validateStream(&p, c.Stream)
	validateConsumer(&p, c.Consumer)
	validateRelay(&p, c.Relay)
	validateRetention(&p, c.Retention)
	validateMetrics(&p, c.Metrics)
	p.oneOf("log.level", c.Log.Level, "debug", "info", "warn", "error")
	p.oneOf("log.format", c.Log.Format, "json", "console")
	return errors.Join(p...)
}

func validateDatabase(p *problems, d Database) {
	if d.Path == "" {
		p.add("database.path", "must not be empty")
	}
	if !schema.PlainIdentifier(d.Table) {
		p.add("database.table", "%q is not a plain SQL identifier (letters, digits, underscore)", d.Table)
	} else if sqlKeyword(d.Table) {
		p.add("database.table", "%q is an SQL keyword, and the table name goes into SQL unquoted: choose another name", d.Table)
	}
	if d.BusyTimeout < time.Millisecond {
		p.add("database.busy_timeout", "%v: must be at least 1ms (0 fails every write the application's lock delays)", d.BusyTimeout)
	}
}

func validateMessage(p *problems, m Message) {
	if m.Format == FormatCloudEvents && strings.TrimSpace(m.Source) == "" {
		p.add("message.source", "must be set with message.format cloudevents: it is every event's ce-source (a URI reference naming the application, such as /reviews)")
	}
	p.oneOf("message.format", m.Format, FormatRaw, FormatCloudEvents)
	for key, v := range map[string]string{"message.source": m.Source, "message.content_type": m.ContentType} {
		if v != strings.TrimSpace(v) || strings.ContainsFunc(v, unicode.IsControl) {
			p.add(key, "%q is not a header value NATS carries as it is (surrounding whitespace or control characters)", v)
		}
	}
	// CloudEvents SDKs parse ce-source as a URI reference, and refuse the
	// whole message when it is not one.
	if _, err := url.Parse(m.Source); err != nil && m.Format == FormatCloudEvents && !strings.ContainsFunc(m.Source, unicode.IsControl) {
		p.add("message.source", "%q is not a URI reference (%v): CloudEvents SDKs could not read the events; use a path such as /reviews or a URI such as https://example.com/reviews", m.Source, errors.Unwrap(err))
	}
}

func validateNATS(p *problems, n NATS) {
	// A key named with its source: the value may come from a variable or a
	// natscli context the user did not think of.
	key := func(k string) string { return label(k, n.Sources[k]) }
	if n.URL == "" {
		p.add("nats.url", "must not be empty")
	} else if n.URL != EmbeddedURL {
		for _, err := range natsname.ValidateServerURLs(n.URL) {
			p.add(key("nats.url"), "%v", err)
		}
	}
	p.oneOf("nats.mode", n.Mode, ModeJetStream, ModeCore)
	var methods []string
	for k, set := range map[string]bool{"nats.creds": n.Creds != "", "nats.nkey": n.NKey != "", "nats.token": n.Token != "", "nats.user": n.User != ""} {
		if set {
			methods = append(methods, key(k))
		}
	}
	if len(methods) > 1 {
		sort.Strings(methods)
		p.add("nats.creds", "set only one of nats.creds, nats.nkey, nats.token, nats.user/nats.password; set now: %s", strings.Join(methods, ", "))
	}
	if n.Password != "" && n.User == "" {
		p.add(key("nats.password"), "needs nats.user")
	}
	if (n.TLS.Cert == "") != (n.TLS.Key == "") {
		p.add("nats.tls.cert", "nats.tls.cert and nats.tls.key go together")
	}
	if host, _, err := net.SplitHostPort(n.Embedded.Listen); err != nil {
		p.add("nats.embedded.listen", "%q is not host:port: %v", n.Embedded.Listen, err)
	} else if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		p.add("nats.embedded.listen", "%q is not a loopback address: the embedded server is for local use only", n.Embedded.Listen)
	}
}

func validateStream(p *problems, s Stream) {
	if !natsname.ValidName(s.Name) {
		p.add("stream.name", "%q is not a valid stream name (no spaces, '.', '*', '>', '/')", s.Name)
	}
	if len(s.Subjects) == 0 {
		p.add("stream.subjects", "must list at least one subject")
	}
	for _, f := range s.Subjects {
		if err := natsname.ValidateFilter(f); err != nil {
			p.add("stream.subjects", "%q: %v", f, err)
		}
	}
	if err := natsname.ValidateSubjectPart(s.SubjectPrefix); err != nil {
		p.add("stream.subject_prefix", "%q: %v", s.SubjectPrefix, err)
	} else if s.Create && len(s.Subjects) > 0 && !natsname.Covers(s.Subjects, s.SubjectPrefix) {
		p.add("stream.subjects", "%q do not capture %s.> (stream.subject_prefix): a stream created with them could not take the relay's messages", s.Subjects, s.SubjectPrefix)
	}
	if _, err := natsname.ParseTemplate(s.SubjectTemplate); err != nil {
		p.add("stream.subject_template", "%q: %v", s.SubjectTemplate, err)
	}
	if s.DuplicateWindow < 100*time.Millisecond {
		p.add("stream.duplicate_window", "%v is below JetStream's minimum of 100ms", s.DuplicateWindow)
	}
	if s.Replicas < 1 || s.Replicas > 5 {
		p.add("stream.replicas", "%d is not between 1 and 5", s.Replicas)
	}
}

func validateConsumer(p *problems, c Consumer) {
	if c.Durable != "" && !natsname.ValidName(c.Durable) {
		p.add("consumer.durable", "%q is not a valid consumer name", c.Durable)
	}
	if c.AckWait <= 0 {
		p.add("consumer.ack_wait", "must be positive")
	}
	if c.Create && c.Durable == "" {
		p.add("consumer.create", "needs consumer.durable")
	}
}

func validateRelay(p *problems, r Relay) {
	p.atLeastOne("relay.batch_size", r.BatchSize)
	p.atLeastOne("relay.max_in_flight", r.MaxInFlight)
	p.atLeastOne("relay.max_attempts", r.MaxAttempts)
	if r.MaxInFlight < r.BatchSize {
		p.add("relay.max_in_flight", "%d is smaller than relay.batch_size %d", r.MaxInFlight, r.BatchSize)
	}
	if r.PollInterval <= 0 {
		p.add("relay.poll_interval", "must be positive")
	}
	if min := r.AckTimeout + r.ShutdownTimeout; r.Lease <= min {
		p.add("relay.lease", "%v must be longer than relay.ack_timeout + relay.shutdown_timeout (%v), or a relay could lose rows it is still waiting for", r.Lease, min)
	}
	if r.ShutdownTimeout < 0 {
		p.add("relay.shutdown_timeout", "must not be negative")
	}
	if r.AckTimeout <= 0 {
		p.add("relay.ack_timeout", "must be positive")
	}
}

func validateRetention(p *problems, r Retention) {
	if r.Done < 0 {
		p.add("retention.done", "must not be negative (0 keeps rows forever)")
	}
	p.oneOf("retention.done_rows", r.DoneRows, DoneRowsKeep, DoneRowsDelete)
	if r.ProcessedEvents < 0 {
		p.add("retention.processed_events", "must not be negative (0 keeps rows forever)")
	}
}

func validateMetrics(p *problems, m Metrics) {
	if m.Listen != "" {
		if _, _, err := net.SplitHostPort(m.Listen); err != nil {
			p.add("metrics.listen", "%q is not host:port: %v", m.Listen, err)
		}
	}
}
