package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/child"
)

// ClientRun is the standard client publishing alone: at the --rate, the
// yardstick for the relay's CPU at a trickle (Client); or a number of
// messages as fast as one PubAck at a time allows, the yardstick for a
// drain with one ordering key (SyncClient).
type ClientRun struct {
	Messages   int     `json:"messages"`
	CPUPercent float64 `json:"cpu_percent_of_one_core"`
	// SyncClient's: how long the messages took, from the first publish to
	// the last PubAck, and their rate.
	Seconds    float64 `json:"seconds,omitempty"`
	MsgsPerSec float64 `json:"msgs_per_second,omitempty"`
}

// Client publishes rate messages of size bytes a second to subject for d
// on nc with the standard client (nats.go's jetstream package), one at a
// time, each PubAck awaited before the next, and measures its own CPU: the
// floor of any relay at that rate. It shares no code with the relay.
func Client(nc *nats.Conn, subject string, rate, size int, d time.Duration) (*ClientRun, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	payload := make([]byte, size)
	tick := time.NewTicker(time.Second / time.Duration(max(1, rate)))
	defer tick.Stop()
	start, before := time.Now(), ownCPU()
	n := 0
	for time.Since(start) < d {
		<-tick.C
		msg := nats.NewMsg(subject)
		msg.Data = payload
		msg.Header.Set(jetstream.MsgIDHeader, "bench-client-"+strconv.Itoa(n))
		if err := publishAwait(js, msg); err != nil {
			return nil, fmt.Errorf("publish %d: %w", n, err)
		}
		n++
	}
	return &ClientRun{Messages: n, CPUPercent: 100 * (ownCPU() - before).Seconds() / time.Since(start).Seconds()}, nil
}

// SyncClient publishes n messages of size bytes to subject on nc with the
// standard client (nats.go's jetstream package) as fast as it can, one at
// a time, each PubAck awaited before the next, and measures their rate
// and its own CPU. One message in flight is what the relay may have of one
// ordering key, so this is the rate a drain with one key is held against;
// like the ceiling (benchkit.Ceiling) each message carries the headers the
// relay sets, and like it this shares no code with the relay.
func SyncClient(nc *nats.Conn, subject string, n, size int) (*ClientRun, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	payload := make([]byte, size)
	start, before := time.Now(), ownCPU()
	for i := range n {
		if err := publishAwait(js, relayLikeMsg(subject, payload, i)); err != nil {
			return nil, fmt.Errorf("publish %d: %w", i, err)
		}
	}
	elapsed := time.Since(start).Seconds()
	return &ClientRun{
		Messages:   n,
		CPUPercent: 100 * (ownCPU() - before).Seconds() / elapsed,
		Seconds:    elapsed,
		MsgsPerSec: float64(n) / elapsed,
	}, nil
}

// relayLikeMsg is the i-th message of SyncClient: the payload with the
// headers the ceiling sets (written out here, not taken from the relay),
// so that it costs the server what a relay's message does.
func relayLikeMsg(subject string, payload []byte, i int) *nats.Msg {
	m := nats.NewMsg(subject)
	m.Data = payload
	m.Header.Set(jetstream.MsgIDHeader, "bench-sync-client-"+strconv.Itoa(i))
	m.Header.Set("Outbox-Event-Type", "BenchEvent")
	m.Header.Set("Outbox-Row-Id", strconv.Itoa(i+1))
	m.Header.Set("Outbox-Created-At", time.Now().UTC().Format("2006-01-02T15:04:05.000Z07:00"))
	return m
}

// publishAwait publishes msg and waits for its PubAck, giving up after
// 5 s: a yardstick that stalls is an error, not a slow figure.
func publishAwait(js jetstream.JetStream, msg *nats.Msg) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := js.PublishMsg(ctx, msg)
	return err
}

// ownCPU is this process's CPU time so far.
func ownCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchClient runs bench-client at rate for d in a child process, as the
// relay runs.
func (b *bench) benchClient(url, subject string, rate, size int, d time.Duration) (*ClientRun, error) {
	return b.runClient(url, subject, size, "--rate", strconv.Itoa(rate), "--duration", d.String())
}

// benchSyncClient runs bench-client --messages n (SyncClient) in a child
// process, as the relay runs: neither shares the other's CPU or
// scheduler.
func (b *bench) benchSyncClient(url, subject string, n, size int) (*ClientRun, error) {
	return b.runClient(url, subject, size, "--messages", strconv.Itoa(n))
}

// runClient runs bench-client with mode's flags and reads the ClientRun
// it prints.
func (b *bench) runClient(url, subject string, size int, mode ...string) (*ClientRun, error) {
	self, err := b.executable()
	if err != nil {
		return nil, err
	}
	args := append(b.configArgs(), "bench-client", "--url", url, "--subject", subject, "--size", strconv.Itoa(size))
	cmd := exec.Command(self, append(args, mode...)...)
	var out bytes.Buffer
	cmd.Stdout = &out
	ch, err := child.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("bench-client: %w", err)
	}
	if err := ch.Wait(); err != nil {
		return nil, fmt.Errorf("bench-client: %w", err)
	}
	var run ClientRun
	if err := json.Unmarshal(out.Bytes(), &run); err != nil {
		return nil, fmt.Errorf("bench-client: %w", err)
	}
	return &run, nil
}
