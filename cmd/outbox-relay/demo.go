package main

import (
	"context"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/demo"
)

func (c *cli) demoCommand() *cobra.Command {
	var (
		dir      string
		rate     int
		duration time.Duration
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Quickstart: embedded JetStream, a demo database, an application writing events, live progress",
		Long: `demo runs the whole job with no NATS installed: an in-process JetStream server,
a demo SQLite database, a writer that inserts events the way an application
does (its data and the outbox row in one transaction), and the relay, with a
live progress line until Ctrl-C.`,
		Example: `  outbox-relay demo
  outbox-relay demo --rate 1000 --duration 30s
  outbox-relay demo --dir /tmp/outbox-relay-demo --nats-embedded-listen 127.0.0.1:4222 --consumer-durable worker --consumer-create`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rate < 1 {
				return usagef("--rate must be at least 1")
			}
			cfg, err := c.loadConfig()
			if err != nil {
				return err
			}
			userSet := func(key string) bool {
				return cmd.Flags().Changed(config.FlagName(key)) || os.Getenv(config.EnvName(key)) != ""
			}
			cfg, dir, err := demo.Prepare(cfg, dir, userSet)
			if err != nil {
				return err
			}
			log, ctx, stop, err := c.start(cfg)
			if err != nil {
				return err
			}
			defer stop()
			if duration > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, duration)
				defer cancel()
			}
			return demo.Run(ctx, cfg, demo.Options{Rate: rate, Dir: dir, Out: c.stdout, Live: terminal(c.stdout), Log: log, Version: version, Commit: buildCommit()})
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory for the demo database and JetStream data (default: a new temporary directory)")
	cmd.Flags().IntVar(&rate, "rate", 200, "events the demo application writes per second")
	cmd.Flags().DurationVar(&duration, "duration", 0, "stop after this long (default: run until Ctrl-C)")
	return cmd
}

// demoAppCommand is the example application of the compose file: it
// creates the outbox schema (as the application's own migrations would)
// and writes a row of its own plus an event in one transaction, rate times
// a second, until stopped.
func (c *cli) demoAppCommand() *cobra.Command {
	var rate int
	cmd := &cobra.Command{
		Use:     "demo-app [--rate N]",
		Short:   "An example application writing events into database.path (the compose demo's app)",
		Example: `  outbox-relay demo-app --database-path app.db --rate 50`,
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if rate < 1 {
				return usagef("--rate must be at least 1")
			}
			cfg, err := c.loadConfig()
			if err != nil {
				return err
			}
			log, ctx, stop, err := c.start(cfg)
			if err != nil {
				return err
			}
			defer stop()
			if _, err := migrate(ctx, cfg); err != nil {
				return err
			}
			return demo.App(ctx, cfg.Database.Path, cfg.Database.Table, rate, log)
		},
	}
	cmd.Flags().IntVar(&rate, "rate", 20, "events per second")
	return cmd
}
