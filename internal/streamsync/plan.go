package streamsync

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Server defaults the plan normalises before comparing, so that a stream or
// consumer that already matches (whatever the server filled in) yields no
// change.
const (
	defaultDuplicateWindow = 2 * time.Minute
	defaultAckWait         = 30 * time.Second
)

// The managed fields, the values of Change.Field.
const (
	FieldDuplicateWindow = "duplicate_window"
	FieldAllowAtomic     = "allow_atomic"
	FieldMaxDeliver      = "max_deliver"
	FieldAckWait         = "ack_wait"
)

// ManagedFields lists every field a sync may change (for metrics whose
// series start at 0).
var ManagedFields = []string{FieldDuplicateWindow, FieldAllowAtomic, FieldMaxDeliver, FieldAckWait}

// Change is one managed field that differs between the live configuration
// and what the relay needs.
type Change struct {
	Field string `json:"field"` // JSON name of the field: duplicate_window, allow_atomic, max_deliver, ack_wait
	Old   string `json:"old"`
	New   string `json:"new"`
}

// Live is what the server has; nil means absent.
type Live struct {
	Stream   *jetstream.StreamConfig
	Consumer *jetstream.ConsumerConfig
}

// Changes is a plan: the changes to the stream and to the consumer.
type Changes struct {
	Stream   []Change `json:"stream"`
	Consumer []Change `json:"consumer"`
}

// Empty reports whether nothing needs to change.
func (c Changes) Empty() bool { return len(c.Stream) == 0 && len(c.Consumer) == 0 }

// Plan compares the live stream and consumer with want and returns the
// managed fields that differ. Absent parts yield no changes (creating them
// is not a patch). It is pure: no server calls.
func Plan(live Live, want Want) Changes {
	var c Changes
	if s := live.Stream; s != nil {
		if have := effectiveDuplicateWindow(*s); have != want.DuplicateWindow {
			c.Stream = append(c.Stream, Change{Field: FieldDuplicateWindow, Old: fmtDuration(have), New: fmtDuration(want.DuplicateWindow)})
		}
		// The relay only ever turns allow_atomic on: an operator's true is
		// kept when the relay does not want it, since other publishers of
		// the stream may batch.
		if want.AllowAtomic && !s.AllowAtomicPublish {
			c.Stream = append(c.Stream, Change{Field: FieldAllowAtomic, Old: "false", New: "true"})
		}
	}
	if cc := live.Consumer; cc != nil && want.Durable != "" {
		if have := effectiveMaxDeliver(*cc); have != want.MaxDeliver {
			c.Consumer = append(c.Consumer, Change{Field: FieldMaxDeliver, Old: fmtMaxDeliver(have), New: fmtMaxDeliver(want.MaxDeliver)})
		}
		// With backoff set, the server derives the ack wait from it; the
		// operator's backoff is theirs to keep.
		if len(cc.BackOff) == 0 {
			if have := effectiveAckWait(*cc); have != want.AckWait {
				c.Consumer = append(c.Consumer, Change{Field: FieldAckWait, Old: fmtDuration(have), New: fmtDuration(want.AckWait)})
			}
		}
	}
	return c
}

// patchStream returns a copy of live with the stream fields of changes set
// as want has them. Everything else, operator-set or immutable, is kept as
// the server had it. Taking the changes lets a sync send a field in an
// update of its own, so that the server refusing one field does not cost
// the others.
func patchStream(live jetstream.StreamConfig, want Want, changes []Change) jetstream.StreamConfig {
	cfg := live
	for _, c := range changes {
		switch c.Field {
		case FieldDuplicateWindow:
			cfg.Duplicates = want.DuplicateWindow
		case FieldAllowAtomic:
			cfg.AllowAtomicPublish = true
		}
	}
	return cfg
}

// patchConsumer returns a copy of live with the managed consumer fields set.
func patchConsumer(live jetstream.ConsumerConfig, want Want) jetstream.ConsumerConfig {
	cfg := live
	cfg.MaxDeliver = want.MaxDeliver
	if len(cfg.BackOff) == 0 {
		cfg.AckWait = want.AckWait
	}
	return cfg
}

func effectiveDuplicateWindow(s jetstream.StreamConfig) time.Duration {
	if s.Duplicates > 0 {
		return s.Duplicates
	}
	if s.MaxAge > 0 && s.MaxAge < defaultDuplicateWindow {
		return s.MaxAge
	}
	return defaultDuplicateWindow
}

func effectiveMaxDeliver(c jetstream.ConsumerConfig) int {
	if c.MaxDeliver <= 0 {
		return -1 // unlimited; the server reads back an unset value as -1
	}
	return c.MaxDeliver
}

func effectiveAckWait(c jetstream.ConsumerConfig) time.Duration {
	if c.AckWait > 0 {
		return c.AckWait
	}
	return defaultAckWait
}

func fmtMaxDeliver(n int) string {
	if n < 0 {
		return "unlimited"
	}
	return strconv.Itoa(n)
}

// fmtDuration prints durations as operators write them: 1h, 2m, 30s, 1h30m.
func fmtDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// StreamEditCommand is the natscli (v0.5.0) command that makes the stream
// what the relay needs.
func StreamEditCommand(stream string, changes []Change) string {
	args := []string{"nats", "stream", "edit", shellQuote(stream)}
	for _, c := range changes {
		switch c.Field {
		case FieldDuplicateWindow:
			args = append(args, "--dupe-window", c.New)
		case FieldAllowAtomic:
			// natscli's --allow-batch is allow_atomic; its --allow-fast
			// is the other batch mode (allow_batched).
			args = append(args, "--allow-batch")
		}
	}
	return strings.Join(append(args, "-f"), " ")
}

// ConsumerEditCommand is the natscli (v0.5.0) command that makes the
// consumer what the relay needs.
func ConsumerEditCommand(stream, consumer string, changes []Change) string {
	args := []string{"nats", "consumer", "edit", shellQuote(stream), shellQuote(consumer)}
	for _, c := range changes {
		switch c.Field {
		case FieldMaxDeliver:
			args = append(args, "--max-deliver", c.New)
		case FieldAckWait:
			args = append(args, "--wait", c.New)
		}
	}
	return strings.Join(append(args, "-f"), " ")
}

// ConsumerAddCommand is the natscli (v0.5.0) command that creates the
// consumer the relay would create.
func ConsumerAddCommand(want Want, filters []string) string {
	args := []string{"nats", "consumer", "add", shellQuote(want.Stream), shellQuote(want.Durable), "--pull", "--ack", "explicit", "--deliver", "all",
		"--max-deliver", strconv.Itoa(want.MaxDeliver), "--wait", fmtDuration(want.AckWait)}
	for _, f := range filters {
		args = append(args, "--filter", shellQuote(f))
	}
	return strings.Join(append(args, "--defaults"), " ")
}

// shellQuote quotes s for a POSIX shell when it needs it (subjects hold '>').
func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.,/:=", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// String renders the plan for people.
func (c Changes) String() string {
	if c.Empty() {
		return "in sync: nothing to change"
	}
	var b strings.Builder
	for _, part := range []struct {
		name    string
		changes []Change
	}{{"stream", c.Stream}, {"consumer", c.Consumer}} {
		for _, ch := range part.changes {
			fmt.Fprintf(&b, "%s %s: %s -> %s\n", part.name, ch.Field, ch.Old, ch.New)
		}
	}
	return strings.TrimSuffix(b.String(), "\n")
}
