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

// ClientRun is the standard client publishing alone at the --rate: the
// yardstick for the relay's CPU at a trickle.
type ClientRun struct {
	Messages   int     `json:"messages"`
	CPUPercent float64 `json:"cpu_percent_of_one_core"`
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
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := js.PublishMsg(ctx, msg)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("publish %d: %w", n, err)
		}
		n++
	}
	return &ClientRun{Messages: n, CPUPercent: 100 * (ownCPU() - before).Seconds() / time.Since(start).Seconds()}, nil
}

// ownCPU is this process's CPU time so far.
func ownCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchClient runs bench-client in a child process, as the relay runs.
func (b *bench) benchClient(url, subject string, rate, size int, d time.Duration) (*ClientRun, error) {
	self, err := b.executable()
	if err != nil {
		return nil, err
	}
	args := append(b.configArgs(), "bench-client", "--url", url, "--subject", subject,
		"--rate", strconv.Itoa(rate), "--size", strconv.Itoa(size), "--duration", d.String())
	cmd := exec.Command(self, args...)
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
