package publish

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/textproto"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Header names set on every published message (docs/contract.md).
const (
	HeaderMsgID     = "Nats-Msg-Id"
	HeaderEventType = event.HeaderEventType
	HeaderRowID     = "Outbox-Row-Id"
	HeaderCreatedAt = "Outbox-Created-At"
	// HeaderOrderingKey is set when the row has an ordering key.
	HeaderOrderingKey = "Outbox-Ordering-Key"
	// HeaderOrigin is the outbox table's origin (Format.Origin): it tells
	// one database's messages from another's in a shared stream.
	HeaderOrigin = "Outbox-Origin"
	// HeaderTenant is the tenant of the database file the row is in
	// (Format.Tenant), when the relay serves a fleet of files.
	HeaderTenant = "Outbox-Tenant"
)

// createdAtLayout is RFC 3339 in UTC with milliseconds.
const createdAtLayout = "2006-01-02T15:04:05.000Z07:00"

// CreatedAt reads a message's Outbox-Created-At, its row's created_at, as
// Unix milliseconds: 0 when it has none or it cannot be read.
func CreatedAt(h nats.Header) int64 {
	t, err := time.Parse(createdAtLayout, h.Get(HeaderCreatedAt))
	if err != nil {
		return 0
	}
	return t.UnixMilli()
}

// Message is one row to publish on its subject.
type Message struct {
	Row     event.Row
	Subject string
	// Headers are the row's own (its headers column, read by
	// event.ParseHeaders); the relay's are added to them.
	Headers map[string][]string
	// Format adds the headers of a message format (CloudEvents).
	Format Format
}

// Format is how a message is laid out besides the relay's headers.
type Format struct {
	// CloudEvents adds the CloudEvents binary-mode headers (the NATS
	// protocol binding): ce-specversion 1.0, ce-id (the event id), ce-type
	// (the event type), ce-source (Source), ce-time (created_at) and
	// content-type (ContentType).
	CloudEvents         bool
	Source, ContentType string
	// Origin, when set, is sent as HeaderOrigin: the outbox table's
	// origin, which a restored copy of its file keeps (see package
	// reconcile).
	Origin string
	// Tenant, when set, is sent as HeaderTenant.
	Tenant string
}

// NewMsg builds the NATS message for a row: the payload byte for byte, the
// row's headers and the relay's.
func NewMsg(m Message) *nats.Msg {
	h := make(nats.Header, len(m.Headers)+5)
	// The relay's values share one array: one allocation, not one each.
	n := 4
	for _, v := range []string{m.Row.OrderingKey, m.Format.Origin, m.Format.Tenant} {
		if v != "" {
			n++
		}
	}
	if m.Format.CloudEvents {
		n += 5
	}
	vals := make([]string, 0, n)
	one := func(v string) []string {
		vals = append(vals, v)
		return vals[len(vals)-1 : len(vals) : len(vals)]
	}
	for name, v := range m.Headers {
		h[name] = v
	}
	h[HeaderMsgID] = one(m.Row.EventID)
	h[HeaderEventType] = one(m.Row.EventType)
	h[HeaderRowID] = one(strconv.FormatInt(m.Row.ID, 10))
	h[HeaderCreatedAt] = one(time.UnixMilli(m.Row.CreatedAt).UTC().Format(createdAtLayout))
	if m.Row.OrderingKey != "" {
		h[HeaderOrderingKey] = one(m.Row.OrderingKey)
	}
	if m.Format.Origin != "" {
		h[HeaderOrigin] = one(m.Format.Origin)
	}
	if m.Format.Tenant != "" {
		h[HeaderTenant] = one(m.Format.Tenant)
	}
	if f := m.Format; f.CloudEvents {
		h[HeaderCESpecVersion] = one("1.0")
		h[HeaderCEID] = one(m.Row.EventID)
		h[HeaderCEType] = one(m.Row.EventType)
		h[HeaderCESource] = one(f.Source)
		h[HeaderCETime] = h[HeaderCreatedAt]
		if f.ContentType != "" {
			h[HeaderContentType] = one(f.ContentType)
		}
	}
	return &nats.Msg{Subject: m.Subject, Data: m.Row.Payload, Header: h}
}

// ErrTooLarge marks a message that no retry can publish: it is larger
// than the server's max_payload or the stream's max_msg_size.
var ErrTooLarge = errors.New("message too large")

// Size returns the bytes msg counts against the server's max_payload and
// the stream's max_msg_size: its headers as the client sends them, and
// its data.
func Size(msg *nats.Msg) int {
	if len(msg.Header) == 0 {
		return len(msg.Data)
	}
	// As nats.go writes them (through net/http's Header.Write, which trims
	// each value), counted without writing them: this runs for every
	// message.
	n := len("NATS/1.0\r\n") + len("\r\n")
	for k, vals := range msg.Header {
		for _, v := range vals {
			n += len(k) + len(": ") + len(textproto.TrimString(v)) + len("\r\n")
		}
	}
	return n + len(msg.Data)
}

// MaxHeaderBytes is the most header bytes JetStream stores with a message
// (headersTooLarge above it), whatever max_payload allows.
const MaxHeaderBytes = 65535

// headersTooLarge is JetStream's err_code for headers over MaxHeaderBytes.
const headersTooLarge jetstream.ErrorCode = 10097

// tooLarge returns an error wrapping ErrTooLarge when msg is larger than
// maxPayload (the server's) or maxMsgSize (the stream's; 0 or less: no
// limit), or its headers larger than maxHeaders (0: no limit), giving the
// message's size and the limits; nil when it fits.
func tooLarge(msg *nats.Msg, maxPayload, maxMsgSize, maxHeaders int64) error {
	size := int64(Size(msg))
	var over []string
	if headers := size - int64(len(msg.Data)); maxHeaders > 0 && headers > maxHeaders {
		over = append(over, fmt.Sprintf("JetStream's limit of %d bytes of headers", maxHeaders))
	}
	if maxPayload > 0 && size > maxPayload {
		over = append(over, fmt.Sprintf("the server's max_payload of %d", maxPayload))
	}
	if maxMsgSize > 0 && size > maxMsgSize {
		over = append(over, fmt.Sprintf("the stream's max_msg_size of %d", maxMsgSize))
	}
	if len(over) == 0 {
		return nil
	}
	limits := fmt.Sprintf("max_payload %d", maxPayload)
	if maxMsgSize > 0 {
		limits += fmt.Sprintf(", max_msg_size %d", maxMsgSize)
	}
	return fmt.Errorf("%w: the message is %d bytes (payload %d, headers %d), more than %s (%s); raise the limit, then dead-letters retry",
		ErrTooLarge, size, len(msg.Data), size-int64(len(msg.Data)), strings.Join(over, " and "), limits)
}

// Kind is the class of a publish outcome.
type Kind int

// The outcomes of a publish.
const (
	// Stored: the stream acknowledged the message.
	Stored Kind = iota + 1
	// Duplicate: the stream already had this Nats-Msg-Id; also success.
	Duplicate
	// Transport: the broker could not be reached or did not answer; retry
	// later without spending an attempt.
	Transport
	// Rejected: the broker refused this message; an attempt is spent.
	Rejected
	// Withheld: not sent, because the message before it with the same
	// ordering key was not stored; no attempt is spent.
	Withheld
	// Invalid: not sent, because the row can never be published as it is
	// (Result.Err says why; it wraps ErrTooLarge for a message above the
	// server's or the stream's size limit); it is dead-lettered at once.
	Invalid
)

// String names the kind for logs and metric labels.
func (k Kind) String() string {
	switch k {
	case Stored:
		return "stored"
	case Duplicate:
		return "duplicate"
	case Transport:
		return "transport"
	case Rejected:
		return "rejected"
	case Withheld:
		return "withheld"
	case Invalid:
		return "invalid"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Result is the outcome of one publish.
type Result struct {
	Kind Kind
	// Err is why a publish failed; for a Duplicate, set when the stream's
	// message with this Nats-Msg-Id came from another row.
	Err error
	// Seq is the stream sequence of the stored message (Stored, and the
	// original's for a Duplicate); 0 when there is none (core NATS).
	Seq uint64
}

// Ack is the pending outcome of one publish.
type Ack interface {
	// Wait blocks until the outcome is known or ctx ends (then it reports a
	// Transport failure carrying ctx's error).
	Wait(ctx context.Context) Result
}

// resolved is an Ack known at publish time.
type resolved Result

func (r resolved) Wait(context.Context) Result { return Result(r) }

// Classify sorts a publish error into Transport or Rejected (nil is
// Stored). Rejected is what the server said about this message (a
// JetStream API error for it, a subject or payload it refuses); anything
// about the connection (a reset, a broken pipe, a timeout) is Transport and
// spends no attempt. It knows only the error; JetStream.Wait refines errors
// that need the subject (permission denied).
func Classify(err error) Kind {
	if err == nil {
		return Stored
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		// 400: this message is wrong for the stream (too large, wrong
		// expected stream or sequence), unless the stream refuses every
		// message (sealed, say); 503 and other server-side codes: the
		// stream cannot take it now.
		if apiErr.Code == 400 && streamLevel(apiErr.ErrorCode) == "" {
			return Rejected
		}
		return Transport
	}
	switch {
	case errors.Is(err, nats.ErrMaxPayload),
		errors.Is(err, nats.ErrBadSubject),
		errors.Is(err, nats.ErrPermissionViolation),
		errors.Is(err, nats.ErrHeadersNotSupported):
		return Rejected
	case errors.Is(err, ErrStreamRefusesAll),
		errors.Is(err, nats.ErrDisconnected),
		errors.Is(err, nats.ErrConnectionClosed),
		errors.Is(err, nats.ErrConnectionDraining),
		errors.Is(err, nats.ErrConnectionReconnecting),
		errors.Is(err, nats.ErrReconnectBufExceeded),
		errors.Is(err, nats.ErrNoServers),
		errors.Is(err, nats.ErrTimeout),
		errors.Is(err, nats.ErrNoResponders),
		errors.Is(err, nats.ErrStaleConnection),
		errors.Is(err, nats.ErrSlowConsumer),
		errors.Is(err, jetstream.ErrNoStreamResponse),
		errors.Is(err, jetstream.ErrAsyncPublishTimeout),
		errors.Is(err, jetstream.ErrTooManyStalledMsgs),
		errors.Is(err, jetstream.ErrInvalidJSAck),
		errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, context.Canceled),
		errors.Is(err, io.EOF),
		errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, net.ErrClosed),
		errors.Is(err, os.ErrDeadlineExceeded),
		errors.Is(err, syscall.EPIPE),
		errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.ECONNREFUSED),
		errors.Is(err, syscall.ECONNABORTED):
		return Transport
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return Transport // a socket error: the connection, not the message
	}
	if strings.Contains(err.Error(), asyncReplyFailed) {
		return Transport
	}
	// Unknown errors spend an attempt, so the row records why and cannot
	// stall the relay forever.
	return Rejected
}

// asyncReplyFailed begins the error of the first asynchronous publish of a
// publisher whose connection is closed (or draining): nats.go (v1.55)
// formats the cause with %s, so errors.Is cannot find it.
const asyncReplyFailed = "nats: error creating async reply handler"

// The JetStream error codes of a stream or an account that refuses every
// message, whatever the message, with what the operator can do. They come
// with code 400 like a message's own faults, but no row is at fault: the
// relay pauses (an outage) and spends no attempt.
var streamLevelCodes = map[jetstream.ErrorCode]string{
	10109: "it is sealed, and a sealed stream cannot be unsealed: point stream.name at another stream, or delete this one and let the relay create it",
	10002: "the account's JetStream resources are exhausted: raise the account's limits or free space in its streams",
	10120: "the account has no JetStream limits that apply to this stream: give the account JetStream limits",
	10113: "the account requires streams to set max_bytes: set it on the stream (nats stream edit --max-bytes)",
	10169: "the stream counts messages (allow_msg_counter) and takes no other: point stream.name at a stream without counters",
}

// streamLevel returns what an operator can do about a JetStream error code
// that no message can avoid, or "" for a message's own fault.
func streamLevel(code jetstream.ErrorCode) string { return streamLevelCodes[code] }

// ErrSubjectFull marks a publish refused because its subject holds the
// stream's max_msgs_per_subject and the stream discards new messages per
// subject (discard_new_per_subject): it takes the relay's other subjects.
var ErrSubjectFull = errors.New("the stream takes no more messages on this subject")

// storeFailed is JetStream's err_code for a message the stream did not
// store, whose description says why (a limit reached with discard new,
// among others).
const storeFailed = 10077

// atLimit explains a message refused at one of the stream's limits with
// discard new: its subject at max_msgs_per_subject (ErrSubjectFull), or
// the stream at max_msgs or max_bytes (ErrStreamRefusesAll); nil for any
// other error.
func (p *JetStream) atLimit(subject string, err error) error {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != storeFailed {
		return nil
	}
	switch d := apiErr.Description; {
	case strings.Contains(d, "maximum messages per subject exceeded"):
		return fmt.Errorf("%w: stream %s holds its max_msgs_per_subject messages on subject %s and discards new ones there: its rows wait, spending no attempt, while the other subjects go; raise the stream's max_msgs_per_subject, or let its consumers remove messages (%w)",
			ErrSubjectFull, p.stream, subject, err)
	case strings.Contains(d, "maximum messages exceeded"), strings.Contains(d, "maximum bytes exceeded"):
		return fmt.Errorf("%w: stream %s is full (its max_msgs or max_bytes, with discard new): raise its limits, or let its consumers remove messages (%w)",
			ErrStreamRefusesAll, p.stream, err)
	}
	return nil
}

// ErrStreamRefusesAll marks a publish refused by a stream (or account) that
// refuses every message: an outage for the relay, never a row's fault.
var ErrStreamRefusesAll = errors.New("the stream refuses every message")

// explain adds what an operator can do to a stream-level refusal.
func explain(err error) error {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		if what := streamLevel(apiErr.ErrorCode); what != "" {
			return fmt.Errorf("%w: %s (%w)", ErrStreamRefusesAll, what, err)
		}
	}
	return err
}

func deniedErr(subject string) error {
	return fmt.Errorf("permission denied on subject %s: %w", subject, nats.ErrPermissionViolation)
}

// PermissionDenied reports whether a publish failed because the server does
// not let this user publish on the subject.
func PermissionDenied(err error) bool { return errors.Is(err, nats.ErrPermissionViolation) }

// JetStream publishes asynchronously to a JetStream stream, keeping up to
// the configured number of acknowledgements outstanding.
type JetStream struct {
	conn       *Conn
	js         jetstream.JetStream
	stream     string
	ackTimeout time.Duration
	batchState
	// OnFallback, when set before publishing, is told why each atomic
	// batch was published again one message at a time (a
	// metrics.Fallback* reason).
	OnFallback func(reason string)

	mu     sync.Mutex
	handle jetstream.Stream // for reading back a duplicate's original

	// Each message's place in the order it was sent (see answered).
	sendMu   sync.Mutex // held while a message is placed and written
	ackMu    sync.Mutex
	order    map[*nats.Msg]uint64
	sentMsgs uint64
	// answered is the highest place of a message the stream acknowledged:
	// the stream answers one connection's messages in the order it reads
	// them, so every message sent before it has had its answer.
	answered atomic.Uint64

	sizeMu sync.Mutex
	// The stream's max_msg_size (0: none) as last read, if read since the
	// stream last refused a message for its size; after a read that
	// failed, the next waits until nextRead.
	maxMsgSize int64
	sizeKnown  bool
	nextRead   time.Time
}

// sizeReadRetry is how long the publisher waits to read the stream's
// max_msg_size again after a read failed (an outage, no permission).
const sizeReadRetry = 30 * time.Second

// NewJetStream returns a publisher on c for the stream named stream.
// ackTimeout bounds every acknowledgement: without it, futures pending on a
// closed connection never resolve.
func NewJetStream(c *Conn, stream string, maxInFlight int, ackTimeout time.Duration) (*JetStream, error) {
	p := &JetStream{conn: c, stream: stream, ackTimeout: ackTimeout, order: map[*nats.Msg]uint64{}}
	js, err := jetstream.New(c.NC,
		jetstream.WithPublishAsyncMaxPending(maxInFlight),
		jetstream.WithPublishAsyncTimeout(ackTimeout),
		// A duplicate is answered before the messages ahead of it on a
		// clustered stream (at once, without a proposal): it says nothing
		// of their answers.
		jetstream.WithPublishAsyncAckHandler(func(_ jetstream.JetStream, m *nats.Msg, a *jetstream.PubAck) { p.forget(m, !a.Duplicate) }),
		jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, m *nats.Msg, _ error) { p.forget(m, false) }))
	if err != nil {
		return nil, fmt.Errorf("open jetstream: %w", err)
	}
	p.js = js
	return p, nil
}

// Close lets go of what publishing took on the connection: the
// subscription the acknowledgements come on, with its goroutine, and the
// watch of the connection's state, with another. A fleet's files share
// one connection, and each file served left both behind, holding its
// table of acknowledgements awaited and, through the handlers, its
// relay: the heap grew by about 160 KiB a file served, and the garbage
// collector ran without pause once it neared the fleet's memory limit.
// Publishes still unanswered fail (ErrJetStreamPublisherClosed).
func (p *JetStream) Close() { p.js.CleanupPublisher() }

// send publishes msg, the message of m, noting its place in the order
// sent. The claimer and the settler (a key's next row) both publish: the
// place is taken with the message written, so that places follow the
// order on the wire, which is the order the stream answers in.
func (p *JetStream) send(m Message, msg *nats.Msg) *jsAck {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	p.ackMu.Lock()
	p.sentMsgs++
	place := p.sentMsgs
	p.order[msg] = place
	p.ackMu.Unlock()
	sent := time.Now()
	fut, err := p.js.PublishMsgAsync(msg)
	if err != nil {
		p.forget(msg, false)
	}
	return &jsAck{p: p, subject: m.Subject, rowID: m.Row.ID, origin: m.Format.Origin, sent: sent, place: place, fut: fut, err: err}
}

// forget drops msg's place once it is resolved; an acknowledgement raises
// answered to it.
func (p *JetStream) forget(msg *nats.Msg, acked bool) {
	p.ackMu.Lock()
	n, ok := p.order[msg]
	delete(p.order, msg)
	p.ackMu.Unlock()
	for ok && acked {
		old := p.answered.Load()
		if n <= old || p.answered.CompareAndSwap(old, n) {
			return
		}
	}
}

// API returns the JetStream API handle for stream management.
func (p *JetStream) API() jetstream.JetStream { return p.js }

// Publish starts publishing msgs in order and returns one Ack each.
func (p *JetStream) Publish(ctx context.Context, msgs []Message) []Ack {
	acks := make([]Ack, len(msgs))
	for i, m := range msgs {
		msg := NewMsg(m)
		if err := p.fits(ctx, msg); err != nil {
			acks[i] = resolved{Kind: Invalid, Err: err}
			continue
		}
		// Every message is sent, even on a subject the server refused a
		// moment ago: only the server's answer to this message may spend
		// its attempt (a permission granted since takes effect at once).
		acks[i] = p.send(m, msg)
	}
	return acks
}

// fits reports, wrapping ErrTooLarge, when msg is larger than the
// server's max_payload or the stream's max_msg_size. The stream's limit
// is read when first needed, and again before a message over it is
// refused (the limit may have been raised since: such rows are rare, and
// each is refused once); a limit that cannot be read is left to the
// stream to enforce.
func (p *JetStream) fits(ctx context.Context, msg *nats.Msg) error {
	maxPayload := p.conn.NC.MaxPayload()
	p.sizeMu.Lock()
	limit, known, next := p.maxMsgSize, p.sizeKnown, p.nextRead
	p.sizeMu.Unlock()
	err := tooLarge(msg, maxPayload, limit, MaxHeaderBytes)
	// Over the server's own limits, no stream limit changes the answer.
	if (!known || err != nil) && tooLarge(msg, maxPayload, 0, MaxHeaderBytes) == nil && !time.Now().Before(next) {
		err = tooLarge(msg, maxPayload, p.readMaxMsgSize(ctx), MaxHeaderBytes)
	}
	return err
}

// readMaxMsgSize reads the stream's max_msg_size (0 when it has none) and
// remembers it; when it cannot be read, it keeps what it knew and does not
// try again for sizeReadRetry.
func (p *JetStream) readMaxMsgSize(ctx context.Context) int64 {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	info, err := p.streamInfo(ctx)
	p.sizeMu.Lock()
	defer p.sizeMu.Unlock()
	if err != nil {
		p.nextRead = time.Now().Add(sizeReadRetry)
		return p.maxMsgSize
	}
	p.maxMsgSize, p.sizeKnown, p.nextRead = max(0, int64(info.Config.MaxMsgSize)), true, time.Time{}
	return p.maxMsgSize
}

// sizeRefused makes the next message read the stream's max_msg_size again:
// the stream refused a message for its size (it was lowered).
func (p *JetStream) sizeRefused() {
	p.sizeMu.Lock()
	p.sizeKnown, p.nextRead = false, time.Time{}
	p.sizeMu.Unlock()
}

type jsAck struct {
	p       *JetStream
	subject string
	rowID   int64
	origin  string    // Format.Origin
	sent    time.Time // when the message was handed to the connection
	place   uint64    // its place in the order sent (see JetStream.answered)
	fut     jetstream.PubAckFuture
	err     error // the publish call itself failed
}

func (a *jsAck) Wait(ctx context.Context) Result {
	err := a.err
	if a.fut != nil {
		select {
		case ack := <-a.fut.Ok():
			return a.stored(ctx, ack)
		case err = <-a.fut.Err():
		case <-ctx.Done():
			return Result{Kind: Transport, Err: ctx.Err()}
		case <-a.p.conn.refused(a.subject, a.sent):
			return a.afterRefusal(ctx)
		}
	}
	return a.p.classify(a.subject, a.sent, err)
}

// refusalGrace bounds how long, after the latest refusal of its subject,
// a message sent before it waits for its answer when no message sent after
// it has been answered: the refusal is its own unless it was stored just
// before the permission changed (its ack is then on its way). Counted from
// the refusal, it is one wait for a whole burst of refused messages.
const refusalGrace = 250 * time.Millisecond

// afterRefusal resolves a message whose subject the server refused after
// it was sent. The stream answers messages in the order it reads them
// (duplicates aside, see NewJetStream), so once a message sent after this
// one is acknowledged and this one is not, this one was refused; while
// none is, its own answer may still come, until refusalGrace after the
// subject's latest refusal.
func (a *jsAck) afterRefusal(ctx context.Context) Result {
	look := time.NewTicker(2 * time.Millisecond)
	defer look.Stop()
	for {
		select {
		case ack := <-a.fut.Ok():
			return a.stored(ctx, ack)
		case err := <-a.fut.Err():
			return a.p.classify(a.subject, a.sent, err)
		case <-ctx.Done():
			return Result{Kind: Transport, Err: ctx.Err()}
		case <-look.C:
			later := a.p.answered.Load() > a.place
			if !later && time.Since(a.p.conn.refusedAt(a.subject)) < refusalGrace {
				continue
			}
			// Its own answer may have raced in.
			select {
			case ack := <-a.fut.Ok():
				return a.stored(ctx, ack)
			case err := <-a.fut.Err():
				return a.p.classify(a.subject, a.sent, err)
			default:
				return Result{Kind: Rejected, Err: deniedErr(a.subject)}
			}
		}
	}
}

// stored is the result of a message the stream acknowledged.
func (a *jsAck) stored(ctx context.Context, ack *jetstream.PubAck) Result {
	if err := a.p.elsewhere(ack.Stream); err != nil {
		return Result{Kind: Transport, Err: err}
	}
	a.p.conn.stored(a.subject, a.sent)
	if ack.Duplicate {
		return Result{Kind: Duplicate, Err: a.p.conflict(ctx, a.rowID, a.origin, ack.Sequence), Seq: ack.Sequence}
	}
	return Result{Kind: Stored, Seq: ack.Sequence}
}

// elsewhere reports an acknowledgement from a stream other than the
// relay's: another stream captures the subjects now (the relay's stream
// was deleted and its subjects given to another, say). The message is
// stored there, not in the relay's stream, so its row is not done: an
// outage, which the probe names (the stream missing, another one's
// subjects overlapping), not an attempt.
func (p *JetStream) elsewhere(stream string) error {
	if stream == p.stream {
		return nil
	}
	return fmt.Errorf("%w: stream %s acknowledged the message, not %s (stream.name): it captures the relay's subjects; give them back to %s, or point stream.name at %s", ErrStreamRefusesAll, stream, p.stream, p.stream, stream)
}

// classify refines Classify with what only the subject tells: a publish the
// server dropped for lack of permission times out like an outage, and is a
// rejection when the server refused the subject after the message was sent
// (see deniedSince). A subject
// that no stream captures gets "no response" like a stream that is down,
// and is treated the same: the stream's configuration is wrong for every
// row, which the outage probe reports until it is fixed, so no row spends
// an attempt on it.
func (p *JetStream) classify(subject string, sent time.Time, err error) Result {
	kind := Classify(err)
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum {
		p.sizeRefused()
	}
	if errors.As(err, &apiErr) && apiErr.ErrorCode == headersTooLarge {
		// The size guard counts headers as the server does; should the two
		// ever differ, no retry could store the message either.
		return Result{Kind: Invalid, Err: fmt.Errorf("%w: the stream refused the message's headers as larger than %d bytes (%w)", ErrTooLarge, MaxHeaderBytes, err)}
	}
	if kind == Transport && p.conn.deniedSince(subject, sent) {
		return Result{Kind: Rejected, Err: deniedErr(subject)}
	}
	if why := p.atLimit(subject, err); why != nil {
		return Result{Kind: Transport, Err: why}
	}
	return Result{Kind: kind, Err: explain(err)}
}

// ReusedID says that the stream holds a row's event id for another row:
// the row's own event is not in the stream. Gone: the message is no
// longer in the stream (purged, or removed by the stream's limits), so
// whose it was cannot be read.
type ReusedID struct {
	Stream string
	Seq    uint64
	// RowID and Origin are the message's Outbox-Row-Id and Outbox-Origin;
	// Ours: its origin is the row's.
	RowID, Origin string
	Ours, Gone    bool
}

func (e *ReusedID) Error() string {
	whose := "another publisher"
	switch {
	case e.Gone:
		return fmt.Sprintf("event id already in stream %s's duplicate window, for sequence %d, which the stream no longer holds (purged, or removed by its limits): "+
			"this row was written after the relay began to lead, so the message was another row's, and this row's event was not stored; give it a new event_id and retry it", e.Stream, e.Seq)
	case e.Ours:
		whose = "row " + e.RowID + " of this table"
	case e.Origin != "":
		whose = "row " + e.RowID + " of another database (Outbox-Origin " + e.Origin + ")"
	case e.RowID != "":
		whose = "row " + e.RowID + " of another database"
	}
	return fmt.Sprintf("event id already in stream %s at sequence %d, published for %s: this row's event is not in the stream; give it a new event_id and retry it", e.Stream, e.Seq, whose)
}

// conflict looks at the message the stream kept for a Nats-Msg-Id that a
// PubAck reported as a duplicate, and returns a *ReusedID when another
// row published it, or when the stream no longer holds it. A message that
// cannot be read for another reason proves nothing: nil.
func (p *JetStream) conflict(ctx context.Context, rowID int64, origin string, seq uint64) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s, err := p.streamHandle(ctx)
	if err != nil {
		return nil
	}
	m, err := s.GetMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return &ReusedID{Stream: p.stream, Seq: seq, Gone: true}
	}
	if err != nil {
		return nil
	}
	return Reused(p.stream, seq, m.Header.Get(HeaderRowID), m.Header.Get(HeaderOrigin), rowID, origin)
}

// Reused returns a *ReusedID when the message at seq, which carries
// msgRow and msgOrigin (Outbox-Row-Id, Outbox-Origin), is not row rowID's
// of the outbox table of origin; nil when it is. A message without an
// origin (from a relay before Outbox-Origin) is the row's when it names
// it.
func Reused(stream string, seq uint64, msgRow, msgOrigin string, rowID int64, origin string) error {
	ours := msgOrigin == origin
	if (ours || msgOrigin == "") && msgRow == strconv.FormatInt(rowID, 10) {
		return nil
	}
	return &ReusedID{Stream: stream, Seq: seq, RowID: msgRow, Origin: msgOrigin, Ours: ours}
}

// streamHandle returns the relay's stream for reading messages, looked up
// once (a handle reads by the stream's name, so it outlives a re-creation).
func (p *JetStream) streamHandle(ctx context.Context) (jetstream.Stream, error) {
	s, _, err := p.lookUp(ctx)
	return s, err
}

// streamInfo reads the stream's info: the look-up's, when this call
// looked the stream up, which read it just now.
func (p *JetStream) streamInfo(ctx context.Context) (*jetstream.StreamInfo, error) {
	s, fresh, err := p.lookUp(ctx)
	switch {
	case err != nil:
		return nil, err
	case fresh:
		return s.CachedInfo(), nil
	}
	return s.Info(ctx)
}

// lookUp is streamHandle, saying whether it looked the stream up.
func (p *JetStream) lookUp(ctx context.Context) (s jetstream.Stream, fresh bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.handle == nil {
		if s, err = p.js.Stream(ctx, p.stream); err != nil {
			return nil, false, err
		}
		p.handle, fresh = s, true
	}
	return p.handle, fresh, nil
}

// Ready reports whether the connection is up; whether the stream answers
// is streamsync's concern.
func (p *JetStream) Ready(context.Context) error { return p.conn.check() }

// Core publishes fire-and-forget with core NATS; a batch counts as
// delivered once a flush succeeds, which only proves the server read it.
type Core struct {
	conn    *Conn
	timeout time.Duration
}

// NewCore returns a core NATS publisher; timeout bounds each flush.
func NewCore(c *Conn, timeout time.Duration) *Core { return &Core{conn: c, timeout: timeout} }

// Publish publishes msgs, flushes, and returns already-resolved Acks.
func (p *Core) Publish(_ context.Context, msgs []Message) []Ack {
	acks := make([]Ack, len(msgs))
	var connErr error
	for i, m := range msgs {
		if connErr != nil {
			acks[i] = resolved{Kind: Transport, Err: connErr}
			continue
		}
		msg := NewMsg(m)
		if err := tooLarge(msg, p.conn.NC.MaxPayload(), 0, 0); err != nil {
			acks[i] = resolved{Kind: Invalid, Err: err}
			continue
		}
		err := p.conn.NC.PublishMsg(msg)
		if kind := Classify(err); kind != Stored {
			acks[i] = resolved{Kind: kind, Err: err}
			if kind == Transport {
				connErr = err
			}
		}
	}
	flushErr := p.conn.NC.FlushTimeout(p.timeout)
	for i, a := range acks {
		switch {
		case a != nil:
		case flushErr != nil:
			acks[i] = resolved{Kind: Transport, Err: fmt.Errorf("flush: %w", flushErr)}
		default:
			acks[i] = resolved{Kind: Stored}
		}
	}
	return acks
}

// Ready reports whether the connection is up and the server answers.
func (p *Core) Ready(context.Context) error {
	if err := p.conn.check(); err != nil {
		return err
	}
	if err := p.conn.NC.FlushTimeout(p.timeout); err != nil {
		return fmt.Errorf("nats flush: %w", err)
	}
	return nil
}
