// Package event is the relay's vocabulary: the outbox row, its statuses,
// event ids and the retry schedule. It has no dependencies so that every
// other package may import it.
package event

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Status is the value of the status column of an outbox row.
type Status string

// The statuses a row moves through. Every row ends Done or DeadLettered.
const (
	StatusPending      Status = "pending"
	StatusProcessing   Status = "processing"
	StatusDone         Status = "done"
	StatusDeadLettered Status = "dead_lettered"
)

// Statuses lists every status in lifecycle order.
var Statuses = []Status{StatusPending, StatusProcessing, StatusDone, StatusDeadLettered}

// ErrDatabaseReplaced means database.path now names another file than the
// one the relay opened (a restore from backup, say). The relay must stop
// writing to the old file, whose -wal the new one may find beside it.
var ErrDatabaseReplaced = errors.New("database file replaced")

// ErrBusy marks an error that only means another connection held the
// database's write lock for longer than the relay waits: it heals by itself.
var ErrBusy = errors.New("database is locked by another connection")

// ErrNotWritable means this process may not write the database (a
// read-only file, directory or mount): waiting will not heal it.
var ErrNotWritable = errors.New("database not writable")

// Row is one claimed outbox row: what the relay publishes and the claim token
// it must present to settle it.
type Row struct {
	ID        int64
	EventID   string
	EventType string
	Payload   []byte
	// Size is the payload's length in bytes as the row was read (0 where
	// the payload was not read): the relay drops a payload once it is
	// published, and the settle still needs its size (claim.Store sizes
	// its statements by it).
	Size      int
	Attempts  int
	CreatedAt int64 // Unix milliseconds
	// OrderingKey is the row's ordering_key: rows with the same key are
	// published in id order, one at a time. Empty: the row is not ordered.
	OrderingKey string
	// Headers is the row's headers column as stored (JSON text; empty:
	// none), read by ParseHeaders before publishing.
	Headers string
	// Group is the row's atomic_group: rows that share one are published
	// all or none, as one atomic batch. Empty: the row is in no group.
	Group string
	// Problem says why the row could not be read as the relay needs it (a
	// created_at that is no time, say): it is dead-lettered with this reason
	// instead of being published.
	Problem string
}

// Backlog is the part of the outbox that is not finished.
type Backlog struct {
	Pending       int64
	Processing    int64
	DeadLettered  int64
	OldestPending time.Time // when the longest-waiting due row became due (the later of created_at and available_at); zero if none is due
	ParkedKeys    int64     // ordering keys whose later rows wait behind a dead letter (ordering.on_dead_letter: hold)
}

// What retention prunes (also the values of pruned_rows_total's label).
const (
	PruneOutbox          = "outbox"           // done rows of the outbox table
	PruneProcessedEvents = "processed_events" // the consumers' dedup ledger
	PruneDoneRecords     = "done_records"     // records of done rows deleted when settled (retention.done_rows: delete)
)

// PayloadBytes sums the payloads of rows.
func PayloadBytes(rows []Row) (n int64) {
	for _, r := range rows {
		n += int64(len(r.Payload))
	}
	return n
}

// Created returns the row's creation time.
func (r Row) Created() time.Time { return time.UnixMilli(r.CreatedAt) }

// Settlement is what happens to a claimed row.
type Settlement int

// The ways a claim ends.
const (
	// Done: the broker stored the event (or already had it).
	Done Settlement = iota + 1
	// Retry: the broker rejected the event; an attempt is spent.
	Retry
	// DeadLetter: the event can never be delivered, or attempts ran out.
	DeadLetter
	// Release: nothing was decided (outage, shutdown); no attempt is spent.
	Release
)

// String returns the settlement's name as used in logs and metric labels.
func (s Settlement) String() string {
	switch s {
	case Done:
		return "done"
	case Retry:
		return "retry"
	case DeadLetter:
		return "dead_letter"
	case Release:
		return "release"
	}
	return fmt.Sprintf("settlement(%d)", int(s))
}

// Outcome is the settlement of one claimed row, ready to be written.
type Outcome struct {
	Row         Row
	Settlement  Settlement
	Attempts    int       // attempts after this outcome (Retry, DeadLetter)
	AvailableAt time.Time // when the row may be claimed again (Retry, Release)
	Error       string    // last_error (Retry, DeadLetter)
	// Reason is why a row was released (Release) or dead-lettered
	// (DeadLetter), for metrics.
	Reason string
	// StreamSeq is the stream sequence of the row's message (Done; 0 when
	// the broker gives none, in core NATS).
	StreamSeq uint64
}

// Why rows are dead-lettered (the values of dead_lettered_total's label).
const (
	DeadLetterMaxAttempts = "max_attempts"    // rejected relay.max_attempts times
	DeadLetterInvalid     = "invalid"         // can never be published as it is
	DeadLetterTooLarge    = "too_large"       // above the server's or the stream's size limit
	DeadLetterReusedID    = "reused_event_id" // its event id is in the stream for another row
)

// Reject returns the outcome of a broker rejection of r at now: one attempt
// spent, retried after RetryBackoff, dead-lettered once maxAttempts is reached.
func Reject(r Row, reason string, maxAttempts int, now time.Time) Outcome {
	attempts := r.Attempts + 1
	if attempts >= maxAttempts {
		return Outcome{Row: r, Settlement: DeadLetter, Attempts: attempts, Error: reason, Reason: DeadLetterMaxAttempts}
	}
	return Outcome{Row: r, Settlement: Retry, Attempts: attempts, AvailableAt: now.Add(RetryBackoff(attempts)), Error: reason}
}

// Invalid returns the outcome of a row that can never be published: it is
// dead-lettered at once, spending one attempt.
func Invalid(r Row, reason string) Outcome {
	return Outcome{Row: r, Settlement: DeadLetter, Attempts: r.Attempts + 1, Error: reason, Reason: DeadLetterInvalid}
}

// Retry backoff parameters shared by every path that spends an attempt:
// 5 s doubling per attempt, at most 300 s.
const (
	RetryBackoffBase = 5 * time.Second
	RetryBackoffMax  = 300 * time.Second
)

// RetryBackoff returns the delay before the next try of a row that has been
// rejected attempts times: 5 s doubling per attempt, capped at 300 s.
func RetryBackoff(attempts int) time.Duration {
	d := RetryBackoffBase
	for i := 1; i < attempts; i++ {
		d *= 2
		if d >= RetryBackoffMax {
			return RetryBackoffMax
		}
	}
	return d
}

// NewID returns a random (version 4) UUID in its canonical lower-case form.
func NewID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("read random bytes: %v", err)) // crypto/rand never fails on Linux
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var s [36]byte
	hex.Encode(s[0:8], b[0:4])
	s[8] = '-'
	hex.Encode(s[9:13], b[4:6])
	s[13] = '-'
	hex.Encode(s[14:18], b[6:8])
	s[18] = '-'
	hex.Encode(s[19:23], b[8:10])
	s[23] = '-'
	hex.Encode(s[24:], b[10:])
	return string(s[:])
}

// ValidateEventID reports why id cannot be a Nats-Msg-Id as it is stored:
// empty (no dedup), or not a header value NATS carries unchanged (see
// validateHeaderValue).
func ValidateEventID(id string) error {
	if id == "" {
		return fmt.Errorf("event_id is empty: the broker could not deduplicate it")
	}
	return validateHeaderValue("event_id", id, "it would be deduplicated against", 255)
}

// HeaderEventType is the header that carries a row's event_type on every
// message the relay publishes (publish names its other headers); here so
// that the ledger's Worker reads it without importing publish.
const HeaderEventType = "Outbox-Event-Type"

// EventIDNotText says why an event_id column's value v, as go-sqlite3
// reads it (TEXT as a string, a BLOB as bytes), cannot be an event id
// whatever it holds: it is a BLOB or a number, which SQLite never finds
// equal to the TEXT of the same bytes, so the unique index lets X'616263'
// in beside 'abc', or 123 beside '123' (one Nats-Msg-Id). "" for TEXT and
// NULL.
func EventIDNotText(v any) string {
	var kind string
	switch v.(type) {
	case nil, string:
		return ""
	case []byte:
		kind = "a BLOB"
	case int64:
		kind = "an INTEGER"
	case float64:
		kind = "a REAL"
	default:
		kind = fmt.Sprintf("of Go type %T", v)
	}
	return fmt.Sprintf("event_id is %s, not TEXT (write it as TEXT, in a column declared TEXT: CAST(event_id AS TEXT))", kind)
}

// The created_at range an RFC 3339 time can name (Outbox-Created-At,
// ce-time): years 0000 to 9999, UTC.
var (
	minCreatedAt = time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC).UnixMilli()
	maxCreatedAt = time.Date(9999, 12, 31, 23, 59, 59, 999e6, time.UTC).UnixMilli()
)

// ValidateCreatedAt reports why ms, a row's created_at in Unix
// milliseconds, cannot be published as an RFC 3339 time (Outbox-Created-At,
// ce-time): it falls outside the years 0000 to 9999 that RFC 3339 can
// write. A value that is a time of this century in microseconds or
// nanoseconds is named as such.
func ValidateCreatedAt(ms int64) error {
	if ms >= minCreatedAt && ms <= maxCreatedAt {
		return nil
	}
	const y2000, y2100 = 946684800000, 4102444800000 // Unix ms
	hint := ""
	switch {
	case ms/1e3 >= y2000 && ms/1e3 < y2100:
		hint = " (Unix microseconds?)"
	case ms/1e6 >= y2000 && ms/1e6 < y2100:
		hint = " (Unix nanoseconds?)"
	}
	return fmt.Errorf("created_at %d is the year %d%s: Outbox-Created-At is an RFC 3339 time, whose years run from 0000 to 9999; write created_at as Unix milliseconds (such as 1767225600000 for 2026-01-01T00:00:00Z) or as SQLite date-time text",
		ms, time.UnixMilli(ms).UTC().Year(), hint)
}

// ValidateOrderingKey reports why a non-empty ordering key cannot be the
// Outbox-Ordering-Key header as it is stored (see validateHeaderValue).
func ValidateOrderingKey(key string) error {
	return validateHeaderValue("ordering_key", key, "it would arrive as", 255)
}

// validateHeaderValue reports why the value of column cannot be a NATS
// header value as it is stored: invalid UTF-8, surrounding whitespace (a
// header value loses it; trimmed says what that would do), control
// characters (a header value cannot hold them) or longer than maxLen
// bytes (0: no limit).
func validateHeaderValue(column, v, trimmed string, maxLen int) error {
	switch {
	case maxLen > 0 && len(v) > maxLen:
		return fmt.Errorf("%s is %d bytes, more than %d", column, len(v), maxLen)
	case !utf8.ValidString(v):
		return fmt.Errorf("%s is not valid UTF-8 text (a BLOB?)", column)
	case strings.TrimSpace(v) != v:
		// NATS clients trim a header value's surrounding whitespace (nats.go
		// spaces and tabs, others any Unicode space), so "a " would be
		// deduplicated against "a": one of the two events would be lost.
		return fmt.Errorf("%s %q begins or ends with whitespace, which NATS clients trim from header values: %s %q", column, v, trimmed, strings.TrimSpace(v))
	}
	for _, c := range v {
		if unicode.IsControl(c) {
			return fmt.Errorf("%s %q contains a control character", column, v)
		}
	}
	return nil
}
