package main

import (
	"context"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

func (c *cli) streamsyncCommand() *cobra.Command {
	var dryRun, asJSON bool
	cmd := &cobra.Command{
		Use:   "streamsync [--dry-run] [--json]",
		Short: "Reconcile the stream and consumer now, or print the plan without applying it",
		Long: `streamsync does what the relay does at startup: it creates a missing stream
(stream.create) and consumer (consumer.create), and patches only the fields the
relay manages on existing ones (stream duplicate_window and, with
stream.allow_atomic, allow_atomic; consumer max_deliver and ack_wait), keeping
every other field. With --dry-run it prints the plan
and changes nothing. Exit code 0 when in sync or applied, 1 when the server
rejected an update or the stream does not capture the relay's subjects.`,
		Example: `  outbox-relay streamsync --nats-url nats://nats:4222 --dry-run
  outbox-relay streamsync --config /etc/outbox-relay.yaml
  NATS_URL=nats://nats:4222 outbox-relay streamsync --consumer-durable worker --json`,
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
			sum := streamsync.Summary{Result: res, DryRun: dryRun}
			if err := c.output(asJSON, sum, sum.Print); err != nil || !res.NeedsAttention() {
				return err
			}
			return errNeedsAttention
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "print the plan; change nothing")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}
