package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/demo"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
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
// a second, until stopped; with a database.path pattern, into --tenants
// files of its directory.
func (c *cli) demoAppCommand() *cobra.Command {
	var rate, tenants int
	cmd := &cobra.Command{
		Use:   "demo-app [--rate N] [--tenants N]",
		Short: "An example application writing events into database.path (the compose demo's app)",
		Example: `  outbox-relay demo-app --database-path app.db --rate 50
  outbox-relay demo-app --database-path '/data/tenants/*.db' --tenants 5 --rate 50   # tenant-01.db ... tenant-05.db`,
		Args: cobra.NoArgs,
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
			paths, err := demoTenants(cfg.Database.Path, tenants)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			errs := make(chan error, len(paths))
			for _, path := range paths {
				cfg := cfg
				cfg.Database.Path = path
				if _, err := migrate(ctx, cfg); err != nil {
					return err
				}
				go func() { errs <- demo.App(ctx, path, cfg.Database.Table, max(1, rate/len(paths)), log) }()
			}
			for range paths {
				if e := <-errs; e != nil && err == nil {
					err = e
					cancel() // the others stop too
				}
			}
			return err
		},
	}
	cmd.Flags().IntVar(&rate, "rate", 20, "events per second (shared by the tenants)")
	cmd.Flags().IntVar(&tenants, "tenants", 3, "with a database.path pattern: how many tenants' files to write, tenant-01 on")
	return cmd
}

// demoTenants returns the files demo-app writes: database.path, or for a
// pattern n files of its directory named tenant-01 on in its place.
func demoTenants(path string, n int) ([]string, error) {
	if !fleet.IsPattern(path) {
		return []string{path}, nil
	}
	if n < 1 {
		return nil, usagef("--tenants must be at least 1")
	}
	base := filepath.Base(path)
	var paths []string
	for i := 1; i <= n; i++ {
		name := strings.Replace(base, "*", fmt.Sprintf("tenant-%02d", i), 1)
		if ok, _ := filepath.Match(base, name); !ok || name == base {
			return nil, usagef("database.path %s: demo-app names its files by putting tenant-NN in place of the pattern's *, which %s is not", path, name)
		}
		paths = append(paths, filepath.Join(filepath.Dir(path), name))
	}
	return paths, nil
}
