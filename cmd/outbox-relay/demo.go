package main

import (
	"context"
	"os"
	"path/filepath"
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
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rate < 1 {
				return usagef("--rate must be at least 1")
			}
			cfg, err := c.loadConfig()
			if err != nil {
				return err
			}
			return c.demo(cmd, cfg, dir, rate, duration)
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory for the demo database and JetStream data (default: a new temporary directory)")
	cmd.Flags().IntVar(&rate, "rate", 200, "events the demo application writes per second")
	cmd.Flags().DurationVar(&duration, "duration", 0, "stop after this long (default: run until Ctrl-C)")
	return cmd
}

func (c *cli) demo(cmd *cobra.Command, cfg config.Config, dir string, rate int, duration time.Duration) error {
	if dir == "" {
		d, err := os.MkdirTemp("", "outbox-relay-demo-")
		if err != nil {
			return err
		}
		dir = d
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	def := config.Default()
	cfg.Database.Path = filepath.Join(dir, "app.db")
	if cfg.NATS.URL == def.NATS.URL {
		cfg.NATS.URL = config.EmbeddedURL
	}
	if cfg.NATS.Embedded.StoreDir == "" {
		cfg.NATS.Embedded.StoreDir = filepath.Join(dir, "nats")
	}
	if cfg.Metrics.Listen == def.Metrics.Listen {
		cfg.Metrics.Listen = "127.0.0.1:0"
	}
	if !cmd.Flags().Changed("log-level") && os.Getenv(config.EnvName("log.level")) == "" {
		cfg.Log.Level = "warn" // keep the progress line readable
	}
	if !cmd.Flags().Changed("log-format") && os.Getenv(config.EnvName("log.format")) == "" {
		cfg.Log.Format = "console"
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
}
