package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// streamClient loads the configuration and connects to the stream's
// server for a command that works on the stream (cmd names it in errors,
// and what it would do there): not in core mode, nor with the embedded
// server, whose stream only the running relay's process can reach.
func (c *cli) streamClient(ctx context.Context, cmd, does string) (config.Config, *zap.Logger, *publish.JetStream, func(), error) {
	cfg, err := c.loadConfig()
	if err != nil {
		return cfg, nil, nil, nil, err
	}
	if cfg.NATS.Mode == config.ModeCore {
		return cfg, nil, nil, nil, usagef("%s: nats.mode is core: there is no stream to %s", cmd, does)
	}
	if cfg.NATS.URL == config.EmbeddedURL {
		return cfg, nil, nil, nil, usagef("%s: nats.url is embedded: point it at the server to %s", cmd, does)
	}
	// A report on stdout; on stderr only warnings and errors beside it.
	log, err := reportLogger(cfg.Log, c.stderr)
	if err != nil {
		return cfg, nil, nil, nil, err
	}
	conn, err := publish.ConnectOnce(ctx, daemon.ConnectOptions(cfg.NATS, "outbox-relay-"+cmd), log.Named("nats"))
	if err != nil {
		return cfg, nil, nil, nil, err
	}
	js, err := publish.NewJetStream(conn, cfg.Stream.Name, 1, cfg.Relay.AckTimeout)
	if err != nil {
		conn.Close()
		return cfg, nil, nil, nil, err
	}
	return cfg, log, js, conn.Close, nil
}

// errNeedsAttention makes a command exit 1 after printing its report.
var errNeedsAttention = errors.New("needs attention")

func (c *cli) streamsyncCommand() *cobra.Command {
	var dryRun, asJSON bool
	cmd := &cobra.Command{
		Use:   "streamsync [--dry-run] [--json]",
		Short: "Reconcile the stream and consumer now, or print the plan without applying it",
		Long: `streamsync does what the relay does at startup: it creates a missing stream
(stream.create) and consumer (consumer.create), and patches only the fields the
relay manages on existing ones (stream duplicate_window; consumer max_deliver
and ack_wait), keeping every other field. With --dry-run it prints the plan
and changes nothing. Exit code 0 when in sync or applied, 1 when the server
rejected an update or the stream does not capture the relay's subjects.`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cfg, log, js, closeJS, err := c.streamClient(ctx, "streamsync", "reconcile")
			if err != nil {
				return err
			}
			defer closeJS()
			// The report says what Sync did and what it could not: its
			// warnings would only repeat it.
			syncLog := log.Named("streamsync").WithOptions(zap.IncreaseLevel(zapcore.ErrorLevel))
			res, err := streamsync.Sync(ctx, js.API(), daemon.Want(cfg), streamsync.Options{DryRun: dryRun, Log: syncLog})
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(c.stdout)
				enc.SetIndent("", "  ")
				if err := enc.Encode(struct {
					streamsync.Result
					DryRun bool `json:"dry_run"`
				}{res, dryRun}); err != nil {
					return err
				}
			} else {
				printSync(c.stdout, res, dryRun)
			}
			if len(res.Rejected) > 0 || res.NotCaptured != "" {
				return errNeedsAttention
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "print the plan; change nothing")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

// printSync renders a sync result for people.
func printSync(w io.Writer, res streamsync.Result, dryRun bool) {
	would := func(did, will string) string {
		if dryRun {
			return will
		}
		return did
	}
	fmt.Fprintf(w, "stream %s", res.Stream)
	if res.StreamCreated {
		fmt.Fprintf(w, ": %s", would("created", "missing; would be created"))
	}
	fmt.Fprintln(w)
	for _, ch := range res.Changes.Stream {
		fmt.Fprintf(w, "  %-18s %s -> %s\n", ch.Field, ch.Old, ch.New)
	}
	if res.Consumer != "" {
		fmt.Fprintf(w, "consumer %s/%s", res.Stream, res.Consumer)
		switch {
		case res.ConsumerCreated:
			fmt.Fprintf(w, ": %s", would("created", "missing; would be created"))
		case res.ConsumerMissing:
			fmt.Fprint(w, ": missing; not managed (set consumer.create to create it)")
		}
		fmt.Fprintln(w)
		for _, ch := range res.Changes.Consumer {
			fmt.Fprintf(w, "  %-18s %s -> %s\n", ch.Field, ch.Old, ch.New)
		}
	}
	if res.NotCaptured != "" {
		fmt.Fprintf(w, "problem: %s\n", res.NotCaptured)
	}
	n := len(res.Changes.Stream) + len(res.Changes.Consumer)
	if res.Window != nil && res.Window.Short() && len(res.Rejected) == 0 {
		// A dry run whose window patch the server would refuse.
		fmt.Fprintf(w, "warning: %s\n", res.Window.Warning())
	}
	switch {
	case len(res.Rejected) > 0:
		for _, r := range res.Rejected {
			fmt.Fprintf(w, "rejected: the server refused the %s update: %s\n  fix it by hand: %s\n", r.Part, r.Error, r.Command)
			if r.Hint != "" {
				fmt.Fprintf(w, "  %s\n", r.Hint)
			}
		}
	case n == 0:
		fmt.Fprintln(w, "in sync: nothing to change")
	case dryRun:
		fmt.Fprintf(w, "dry run: %d change(s) planned, nothing applied (run without --dry-run to apply)\n", n)
	default:
		fmt.Fprintf(w, "applied %d change(s)\n", n)
	}
}
