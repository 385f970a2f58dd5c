package publish

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func connect(t *testing.T, url string, cfg ConnectOptions) *Conn {
	t.Helper()
	cfg.URLs, cfg.Name = url, "publish-test"
	c, err := Connect(context.Background(), cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func newJS(t *testing.T, c *Conn, ackTimeout time.Duration) *JetStream {
	t.Helper()
	p, err := NewJetStream(c, "EVENTS", 100, ackTimeout)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func row(eventType string, payload []byte) event.Row {
	return event.Row{ID: 1, EventID: event.NewID(), EventType: eventType, Payload: payload, CreatedAt: time.Now().UnixMilli()}
}

func publishOne(p *JetStream, subject string, r event.Row) Result {
	return p.Publish(context.Background(), []Message{{Row: r, Subject: subject}})[0].Wait(context.Background())
}

func createStreams(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	ctx := context.Background()
	for _, cfg := range []jetstream.StreamConfig{
		{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour},
		{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 100},
		{Name: "FULL", Subjects: []string{"full.>"}, MaxMsgs: 1, Discard: jetstream.DiscardNew},
		{Name: "OTHER", Subjects: []string{"other.>"}},
	} {
		if _, err := js.CreateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
	}
}

// TestFirstPublishOnAClosedConnection: a publisher's first publish after
// its connection closed (a fleet file's relay opened late) fails to
// subscribe for its acknowledgements: the connection's fault, an outage,
// not an attempt spent on the row.
func TestFirstPublishOnAClosedConnection(t *testing.T) {
	n := testenv.StartNATS(t)
	createStreams(t, n.JetStream(t))
	c := connect(t, n.URL(), ConnectOptions{})
	p := newJS(t, c, 2*time.Second)
	c.NC.Close()
	if r := publishOne(p, "events.X", row("X", []byte("x"))); r.Kind != Transport {
		t.Fatalf("publish on a closed connection: %+v, want transport", r)
	}
}

// TestClassifyRealOutcomes classifies errors produced by a real server.
func TestClassifyRealOutcomes(t *testing.T) {
	n := testenv.StartNATS(t)
	createStreams(t, n.JetStream(t))
	c := connect(t, n.URL(), ConnectOptions{})
	p := newJS(t, c, 2*time.Second)

	// A subscriber that never answers: the publish is neither stored nor refused.
	if _, err := n.Conn(t).Subscribe("hang.>", func(*nats.Msg) {}); err != nil {
		t.Fatal(err)
	}
	dup := row("Dup", []byte("x"))
	full := row("Full", []byte("x"))
	pFull, err := NewJetStream(c, "FULL", 100, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if r := publishOne(pFull, "full.one", full); r.Kind != Stored {
		t.Fatalf("filling FULL: %+v", r)
	}
	var noStreamErr error
	for _, tc := range []struct {
		name    string
		result  func() Result
		want    Kind
		errText string
	}{
		{"stored", func() Result { return publishOne(p, "events.Dup", dup) }, Stored, ""},
		{"duplicate ack is success", func() Result { return publishOne(p, "events.Dup", dup) }, Duplicate, ""},
		{"message larger than the stream's max_msg_size", func() Result {
			return publishOne(p, "small.big", row("Big", make([]byte, 500)))
		}, Rejected, "message size exceeds maximum"},
		{"payload larger than the server's max_payload: refused before it is sent", func() Result {
			return publishOne(p, "events.Huge", row("Huge", make([]byte, 2<<20)))
		}, Invalid, "more than the server's max_payload of 1048576"},
		// Stored by another stream than the relay's (its subjects given
		// to another): not the relay's record, and no row's fault.
		{"acknowledged by another stream", func() Result { return publishOne(p, "other.x", row("X", []byte("x"))) }, Transport, "stream OTHER acknowledged the message, not EVENTS"},
		{"stream full with discard new (503)", func() Result { return publishOne(p, "full.two", row("Full", []byte("y"))) }, Transport, "maximum messages exceeded"},
		// A stream that does not capture the relay's subjects is wrong for
		// every row: an outage until it is fixed, never a rejection.
		{"subject captured by no stream", func() Result {
			r := publishOne(p, "nostream.x", row("X", []byte("x")))
			noStreamErr = r.Err
			return r
		}, Transport, "no response from stream"},
		{"no stream response on a captured subject", func() Result {
			if noStreamErr == nil || !errors.Is(noStreamErr, jetstream.ErrNoStreamResponse) {
				t.Fatalf("previous case gave %v, not ErrNoStreamResponse", noStreamErr)
			}
			return p.classify("events.captured", time.Now(), noStreamErr)
		}, Transport, "no response from stream"},
		{"no acknowledgement before the ack timeout", func() Result { return publishOne(p, "hang.x", row("X", []byte("x"))) }, Transport, "timeout waiting for ack"},
		{"wrong expected stream (400)", func() Result {
			fut, err := p.js.PublishMsgAsync(NewMsg(Message{Row: row("X", nil), Subject: "events.X"}), jetstream.WithExpectStream("OTHER"))
			if err != nil {
				t.Fatal(err)
			}
			return (&jsAck{p: p, subject: "events.X", fut: fut}).Wait(context.Background())
		}, Rejected, "expected stream does not match"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.result()
			if r.Kind != tc.want {
				t.Fatalf("kind %v (err %v), want %v", r.Kind, r.Err, tc.want)
			}
			if tc.errText != "" && (r.Err == nil || !strings.Contains(r.Err.Error(), tc.errText)) {
				t.Fatalf("error %v does not say %q", r.Err, tc.errText)
			}
		})
	}
}

// TestDeletedStreamIsAnOutage: when the relay's stream disappears, "no
// response" must not spend attempts: it is an outage until the stream is
// recreated.
func TestDeletedStreamIsAnOutage(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	createStreams(t, js)
	p := newJS(t, connect(t, n.URL(), ConnectOptions{}), 2*time.Second)
	if r := publishOne(p, "events.A", row("A", nil)); r.Kind != Stored {
		t.Fatalf("before: %v %v", r.Kind, r.Err)
	}
	if err := js.DeleteStream(context.Background(), "EVENTS"); err != nil {
		t.Fatal(err)
	}
	if r := publishOne(p, "events.A", row("A", nil)); r.Kind != Transport || !errors.Is(r.Err, jetstream.ErrNoStreamResponse) {
		t.Fatalf("after the stream was deleted: %v %v; want a transport failure", r.Kind, r.Err)
	}
}

// TestClassifyConnectionLoss: futures pending when the connection drops fail
// with ErrDisconnected, and publishes while disconnected fail at once; both
// are transport failures.
func TestClassifyConnectionLoss(t *testing.T) {
	n := testenv.StartNATS(t)
	createStreams(t, n.JetStream(t))
	if _, err := n.Conn(t).Subscribe("hang.>", func(*nats.Msg) {}); err != nil {
		t.Fatal(err)
	}
	c := connect(t, n.URL(), ConnectOptions{})
	p := newJS(t, c, time.Minute)
	pending := p.Publish(context.Background(), []Message{{Row: row("X", nil), Subject: "hang.x"}})[0]
	n.Stop()
	r := pending.Wait(context.Background())
	if r.Kind != Transport || !errors.Is(r.Err, nats.ErrDisconnected) {
		t.Fatalf("pending future after the server stopped: %v %v", r.Kind, r.Err)
	}
	start := time.Now()
	r = publishOne(p, "events.X", row("X", nil))
	if r.Kind != Transport || time.Since(start) > time.Second {
		t.Fatalf("publish while disconnected: %v %v after %v; want a fast transport failure", r.Kind, r.Err, time.Since(start))
	}
	if err := p.Ready(context.Background()); err == nil || errors.Is(err, ErrClosed) {
		t.Fatalf("Ready while reconnecting = %v", err)
	}
	n.Restart()
	testenv.Eventually(t, 10*time.Second, "the connection is back", c.NC.IsConnected)
	if r := publishOne(p, "events.X", row("X", nil)); r.Kind != Stored {
		t.Fatalf("after reconnect: %v %v", r.Kind, r.Err)
	}
	core := NewCore(c, time.Second)
	n.Stop()
	for _, a := range core.Publish(context.Background(), []Message{{Row: row("X", nil), Subject: "events.X"}}) {
		if r := a.Wait(context.Background()); r.Kind != Transport {
			t.Fatalf("core publish while disconnected: %v %v", r.Kind, r.Err)
		}
	}
}

func ctxTimeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestPermissionDeniedIsARejection: the server drops a publish the user may
// not make and reports it only to the error handler; the publisher must
// call it a rejection naming the subject, not an outage. Once the subject
// is granted, the next message on it is stored.
func TestPermissionDeniedIsARejection(t *testing.T) {
	n := testenv.StartNATS(t, func(o *server.Options) {
		o.Users = []*server.User{{
			Username: "relay", Password: "s3cret",
			Permissions: &server.Permissions{Publish: &server.SubjectPermission{
				Allow: []string{"events.allowed.>", "$JS.API.>", "_INBOX.>"},
			}},
		}}
	})
	admin, err := nats.Connect(n.URL(), nats.UserInfo("relay", "s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	js, _ := jetstream.New(admin)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	c := connect(t, n.URL(), ConnectOptions{User: "relay", Password: "s3cret"})
	// An ack timeout far longer than the wait below: the refusal is known
	// from the server's answer, not from a timeout.
	p := newJS(t, c, time.Hour)
	if r := publishOne(p, "events.allowed.x", row("allowed.x", nil)); r.Kind != Stored {
		t.Fatalf("allowed subject: %v %v", r.Kind, r.Err)
	}
	// A burst on the denied subject, then nothing after it.
	msgs := make([]Message, 20)
	for i := range msgs {
		msgs[i] = Message{Row: row("denied.x", nil), Subject: "events.denied.x"}
	}
	acks := p.Publish(context.Background(), msgs)
	for i, a := range acks {
		r := a.Wait(ctxTimeout(t, 20*time.Second))
		if r.Kind != Rejected || !strings.Contains(r.Err.Error(), "permission denied on subject events.denied.x") {
			t.Fatalf("denied subject, message %d: %v %v", i, r.Kind, r.Err)
		}
	}
	if got := c.DeniedSubjects(); len(got) != 1 || got[0] != "events.denied.x" {
		t.Fatalf("denied subjects %v", got)
	}
	// The operator grants the subject: the next message on it is sent and
	// stored, not refused from what the server said of the one before.
	n.Reload(func(o *server.Options) {
		o.Users[0].Permissions.Publish.Allow = append(o.Users[0].Permissions.Publish.Allow, "events.denied.>")
	})
	if r := publishOne(p, "events.denied.x", row("denied.x", nil)); r.Kind != Stored {
		t.Fatalf("subject granted since: %v %v, want stored", r.Kind, r.Err)
	}
	if got := c.DeniedSubjects(); len(got) != 0 {
		t.Fatalf("denied subjects %v after a message on the subject was stored", got)
	}
}

func TestReadyOnClosedConnection(t *testing.T) {
	n := testenv.StartNATS(t)
	c := connect(t, n.URL(), ConnectOptions{})
	p := newJS(t, c, time.Second)
	c.Close()
	if err := p.Ready(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Ready on a closed connection = %v, want ErrClosed", err)
	}
}

func TestConnectWrongPasswordFailsFast(t *testing.T) {
	n := testenv.StartNATS(t, func(o *server.Options) { o.Username, o.Password = "relay", "right" })
	start := time.Now()
	_, err := Connect(context.Background(), ConnectOptions{URLs: n.URL(), Name: "test", User: "relay", Password: "wrong"}, zap.NewNop())
	if !errors.Is(err, ErrAuth) || time.Since(start) > 5*time.Second {
		t.Fatalf("Connect with a wrong password = %v after %v", err, time.Since(start))
	}
	if strings.Contains(err.Error(), "wrong") {
		t.Fatalf("error leaks the password: %v", err)
	}
}

func TestConnectWhileBrokerDownStartsPaused(t *testing.T) {
	n := testenv.StartNATS(t)
	url := n.URL()
	n.Stop()
	c, err := Connect(context.Background(), ConnectOptions{URLs: url, Name: "test"}, zap.NewNop())
	if err != nil {
		t.Fatalf("Connect with the broker down = %v; want a connection that keeps trying", err)
	}
	defer c.Close()
	if c.NC.IsConnected() {
		t.Fatal("connected to a stopped server")
	}
	n.Restart()
	testenv.Eventually(t, 15*time.Second, "connected once the server is up", c.NC.IsConnected)
}

func TestNewMsgHeaders(t *testing.T) {
	m := NewMsg(Message{Subject: "events.T", Row: event.Row{ID: 42, EventID: "id-1", EventType: "T", Payload: []byte{0, 1}, CreatedAt: 1700000000123},
		Headers: map[string][]string{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, "X-Tags": {"a", "b"}}})
	if m.Header.Get(HeaderMsgID) != "id-1" || m.Header.Get(HeaderEventType) != "T" || m.Header.Get(HeaderRowID) != "42" ||
		m.Header.Get(HeaderCreatedAt) != "2023-11-14T22:13:20.123Z" || string(m.Data) != "\x00\x01" {
		t.Fatalf("message %+v", m)
	}
	if m.Header.Get("traceparent") != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" || fmt.Sprint(m.Header.Values("X-Tags")) != "[a b]" {
		t.Fatalf("the row's headers: %v", m.Header)
	}
}

// sized returns a message for the EVENTS stream whose Size is size.
func sized(t *testing.T, size int) Message {
	t.Helper()
	m := Message{Row: row("Sized", nil), Subject: "events.Sized", Headers: map[string][]string{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}}
	m.Row.Payload = make([]byte, size-Size(NewMsg(m)))
	if got := Size(NewMsg(m)); got != size {
		t.Fatalf("sized message of %d bytes, want %d", got, size)
	}
	return m
}

// TestSizeGuard: Size is what the client and the server count (a message
// of exactly max_payload is sent, one byte more is refused by the client);
// the publisher refuses a message over the server's max_payload or the
// stream's max_msg_size before sending it, naming the sizes, and sends one
// at the limit.
func TestSizeGuard(t *testing.T) {
	const maxPayload, maxMsgSize = 4096, 2048
	n := testenv.StartNATS(t, func(o *server.Options) { o.MaxPayload = maxPayload })
	if _, err := n.JetStream(t).CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, MaxMsgSize: maxMsgSize}); err != nil {
		t.Fatal(err)
	}
	raw := n.Conn(t)
	if err := raw.PublishMsg(NewMsg(sized(t, maxPayload))); err != nil {
		t.Fatalf("the client refused a message of exactly max_payload by Size: %v", err)
	}
	if err := raw.PublishMsg(NewMsg(sized(t, maxPayload+1))); !errors.Is(err, nats.ErrMaxPayload) {
		t.Fatalf("a message one byte over max_payload by Size: %v, want nats.ErrMaxPayload", err)
	}
	p := newJS(t, connect(t, n.URL(), ConnectOptions{}), 5*time.Second)
	wait := func(m Message) Result {
		return p.Publish(context.Background(), []Message{m})[0].Wait(context.Background())
	}
	if r := wait(sized(t, maxMsgSize)); r.Kind != Stored {
		t.Fatalf("a message of exactly max_msg_size: %v %v", r.Kind, r.Err)
	}
	for size, want := range map[int][]string{
		maxMsgSize + 1: {"the message is 2049 bytes", "more than the stream's max_msg_size of 2048", "max_payload 4096"},
		maxPayload + 1: {"more than the server's max_payload of 4096 and the stream's max_msg_size of 2048"},
	} {
		r := wait(sized(t, size))
		if r.Kind != Invalid || !errors.Is(r.Err, ErrTooLarge) {
			t.Fatalf("a message of %d bytes: %v %v; want Invalid, ErrTooLarge", size, r.Kind, r.Err)
		}
		for _, w := range want {
			if !strings.Contains(r.Err.Error(), w) {
				t.Errorf("error %q does not say %q", r.Err, w)
			}
		}
	}
	info, err := n.JetStream(t).Stream(context.Background(), "EVENTS")
	if err != nil || info.CachedInfo().State.Msgs != 1 {
		t.Fatalf("stream holds %v messages (%v); want only the one at the limit", info.CachedInfo().State.Msgs, err)
	}
}

// TestNewMsgCloudEvents: the cloudevents format adds the binary-mode
// headers from the row and the configuration; the raw format adds none.
func TestNewMsgCloudEvents(t *testing.T) {
	r := event.Row{ID: 7, EventID: "id-7", EventType: "ReviewLogged", Payload: []byte("{}"), CreatedAt: 1700000000123}
	f := Format{CloudEvents: true, Source: "/reviews", ContentType: "application/json"}
	m := NewMsg(Message{Subject: "events.ReviewLogged", Row: r, Format: f})
	for name, want := range map[string]string{"ce-specversion": "1.0", "ce-id": "id-7", "ce-type": "ReviewLogged", "ce-source": "/reviews",
		"ce-time": "2023-11-14T22:13:20.123Z", "content-type": "application/json", HeaderMsgID: "id-7"} {
		if got := m.Header.Get(name); got != want {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	}
	if len(f.Reserved()) != 6 || len(Format{}.Reserved()) != 0 {
		t.Errorf("reserved names %v and %v", f.Reserved(), Format{}.Reserved())
	}
	if raw := NewMsg(Message{Subject: "events.ReviewLogged", Row: r}); raw.Header.Get("ce-id") != "" || raw.Header.Get("content-type") != "" {
		t.Errorf("raw format headers %v", raw.Header)
	}
}

// TestClassifySocketErrors: a write on a connection the peer dropped fails
// with "broken pipe" or "connection reset"; that is the connection, never
// the message, so it must not spend an attempt.
func TestClassifySocketErrors(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Read(make([]byte, 1))       // the client is connected
			c.(*net.TCPConn).SetLinger(0) // close with a reset
			c.Close()
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte{'x'}); err != nil {
		t.Fatal(err)
	}
	var werr error
	buf := make([]byte, 64<<10)
	for i := 0; i < 1000 && werr == nil; i++ {
		_, werr = c.Write(buf)
		time.Sleep(time.Millisecond)
	}
	if werr == nil {
		t.Fatal("writes to a dropped connection kept succeeding")
	}
	for _, err := range []error{werr, fmt.Errorf("publish: %w", werr), io.EOF, syscall.EPIPE} {
		if k := Classify(err); k != Transport {
			t.Errorf("Classify(%v) = %v, want transport", err, k)
		}
	}
	// What the server says about a message stays a rejection.
	if k := Classify(nats.ErrMaxPayload); k != Rejected {
		t.Errorf("Classify(max payload) = %v, want rejected", k)
	}
}

// withHeaders returns a message whose headers count exactly n bytes by
// Size (one header padded to fit).
func withHeaders(t *testing.T, n int) Message {
	t.Helper()
	m := Message{Row: row("Big", []byte("x")), Subject: "events.Big", Headers: map[string][]string{"x-pad": {""}}}
	pad := n - (Size(NewMsg(m)) - len(m.Row.Payload))
	m.Headers["x-pad"] = []string{strings.Repeat("p", pad)}
	if got := Size(NewMsg(m)) - len(m.Row.Payload); got != n {
		t.Fatalf("headers of %d bytes, want %d", got, n)
	}
	return m
}

// TestHeaderLimit: JetStream stores at most MaxHeaderBytes of headers,
// whatever max_payload allows (the server refuses more with 10097). The
// publisher sends a message at the limit and refuses one byte more before
// sending it, as a message no retry can publish.
func TestHeaderLimit(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}}); err != nil {
		t.Fatal(err)
	}
	// The server's own limit, as the guard counts it.
	_, err := js.PublishMsg(context.Background(), NewMsg(withHeaders(t, MaxHeaderBytes+1)))
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != headersTooLarge {
		t.Fatalf("the server took headers one byte over the limit: %v", err)
	}
	p := newJS(t, connect(t, n.URL(), ConnectOptions{}), 5*time.Second)
	wait := func(m Message) Result {
		return p.Publish(context.Background(), []Message{m})[0].Wait(context.Background())
	}
	if r := wait(withHeaders(t, MaxHeaderBytes)); r.Kind != Stored {
		t.Fatalf("headers of exactly %d bytes: %v %v", MaxHeaderBytes, r.Kind, r.Err)
	}
	r := wait(withHeaders(t, MaxHeaderBytes+1))
	if r.Kind != Invalid || !errors.Is(r.Err, ErrTooLarge) || !strings.Contains(r.Err.Error(), "JetStream's limit of 65535 bytes of headers") {
		t.Fatalf("headers one byte over: %v %v; want Invalid naming the header limit", r.Kind, r.Err)
	}
}

// TestSealedStreamIsAnOutage: a sealed stream refuses every message with
// a code 400 like a message's own fault; no message is at fault, so the
// publisher calls it a transport failure (the relay pauses, spending
// nothing) and says what the operator can do.
func TestSealedStreamIsAnOutage(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	cfg.Sealed = true
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	p := newJS(t, connect(t, n.URL(), ConnectOptions{}), 5*time.Second)
	r := publishOne(p, "events.X", row("X", []byte("x")))
	if r.Kind != Transport || !errors.Is(r.Err, ErrStreamRefusesAll) || !strings.Contains(r.Err.Error(), "sealed") {
		t.Fatalf("publish to a sealed stream: %v %v; want Transport saying the stream is sealed", r.Kind, r.Err)
	}
}
