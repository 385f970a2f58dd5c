package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// clientRun is the standard client publishing alone at the --rate: the
// yardstick for the relay's CPU at a trickle.
type clientRun struct {
	Messages   int     `json:"messages"`
	CPUPercent float64 `json:"cpu_percent_of_one_core"`
}

// benchClientCommand is the hidden child of bench that measures the
// standard client's cost at a trickle: nats.go's jetstream package, one
// message of --size bytes with a fresh Nats-Msg-Id every 1/--rate s, each
// PubAck awaited before the next. It shares no code with the relay. It
// prints a clientRun as JSON.
func (c *cli) benchClientCommand() *cobra.Command {
	var url, subject string
	var rate, size int
	var d time.Duration
	cmd := &cobra.Command{
		Use:    "bench-client",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			cfg, err := c.loadConfig() // credentials and TLS, as the relay gets them
			if err != nil {
				return err
			}
			conn, err := publish.ConnectOnce(context.Background(), url, cfg.NATS, "outbox-relay-bench-client", zap.NewNop())
			if err != nil {
				return err
			}
			defer conn.Close()
			run, err := trickleClient(conn.NC, subject, rate, size, d)
			if err != nil {
				return err
			}
			return json.NewEncoder(c.stdout).Encode(run)
		},
	}
	f := cmd.Flags()
	f.StringVar(&url, "url", "", "server")
	f.StringVar(&subject, "subject", "", "subject a stream captures")
	f.IntVar(&rate, "rate", 100, "messages per second")
	f.IntVar(&size, "size", 256, "payload bytes")
	f.DurationVar(&d, "duration", 10*time.Second, "how long to publish")
	return cmd
}

func trickleClient(nc *nats.Conn, subject string, rate, size int, d time.Duration) (*clientRun, error) {
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
	return &clientRun{Messages: n, CPUPercent: 100 * (ownCPU() - before).Seconds() / time.Since(start).Seconds()}, nil
}

// ownCPU is this process's CPU time so far.
func ownCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchClient runs bench-client in a child process, as the relay runs.
func (c *cli) benchClient(url, subject string, rate, size int, d time.Duration) (*clientRun, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := append(c.configArgs(), "bench-client", "--url", url, "--subject", subject,
		"--rate", strconv.Itoa(rate), "--size", strconv.Itoa(size), "--duration", d.String())
	cmd := exec.Command(self, args...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("bench-client: %w", err)
	}
	var run clientRun
	if err := json.Unmarshal(out, &run); err != nil {
		return nil, fmt.Errorf("bench-client: %w", err)
	}
	return &run, nil
}
