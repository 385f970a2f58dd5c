package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/procs"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// tuneGC trades a little memory for much less GC work. The relay's live
// heap is small (the rows in flight) but churns through every row, so at
// the default GOGC=100 it collects hundreds of times a second. A larger
// GOGC with a soft limit collects far less often and still keeps the heap
// small; GOGC and GOMEMLIMIT in the environment win.
func tuneGC(fleet bool) {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(400)
	}
	if os.Getenv("GOMEMLIMIT") == "" {
		limit := int64(24 << 20)
		if fleet {
			// Files open at once each hold their pipeline and page
			// cache: with one file's limit the GC ran without pause.
			limit = 96 << 20
		}
		debug.SetMemoryLimit(limit)
	}
}

// runCommand is run, which the root command runs too.
func (c *cli) runCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "run",
		Short: "Run the relay daemon (the default)",
		Example: `  outbox-relay run --config /etc/outbox-relay.yaml
  outbox-relay run --database-path /var/lib/app/app.db --nats-url nats://nats:4222
  NATS_URL=embedded outbox-relay run --database-path app.db   # an in-process JetStream server`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return c.runDaemon(cmd) },
	}
}

// runDaemon is the run command.
func (c *cli) runDaemon(*cobra.Command) error {
	cfg, err := c.loadConfig()
	if err != nil {
		return err
	}
	tuneGC(fleet.IsPattern(cfg.Database.Path))
	log, ctx, stop, err := c.start(cfg)
	if err != nil {
		return err
	}
	defer stop()
	oo := daemon.Options{Version: version, Commit: buildCommit(), Procs: procs.New()}
	go oo.Procs.Run(ctx, time.Second, log)
	if fleet.IsPattern(cfg.Database.Path) {
		f, err := daemon.OpenFleet(ctx, cfg, log, oo)
		if err == nil {
			defer f.Close()
			err = f.Run(ctx)
		}
		return err
	}
	a, err := daemon.Open(ctx, cfg, log, oo)
	if err == nil {
		defer a.Close()
		err = a.Run(ctx)
	}
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return nil // stopped by a signal while starting
	}
	return err
}

func (c *cli) migrateCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Apply the outbox schema to database.path (creating the file) and exit",
		Example: `  outbox-relay migrate --database-path /var/lib/app/app.db
  outbox-relay migrate --config /etc/outbox-relay.yaml
  OUTBOX_RELAY_DATABASE_TABLE=orders_outbox outbox-relay migrate --database-path app.db`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			cfg, err := c.loadConfig()
			if err != nil {
				return err
			}
			paths := []string{cfg.Database.Path}
			if fleet.IsPattern(cfg.Database.Path) {
				// Every file of the fleet; none is created.
				if paths, err = fleet.Files(cfg.Database.Path); err != nil {
					return err
				}
			}
			for _, path := range paths {
				cfg.Database.Path = path
				applied, err := migrate(context.Background(), cfg)
				if err != nil {
					return err
				}
				if len(applied) == 0 {
					fmt.Fprintf(c.stdout, "%s: schema of %s is up to date\n", path, cfg.Database.Table)
					continue
				}
				fmt.Fprintf(c.stdout, "%s: applied migrations %v to %s\n", path, applied, cfg.Database.Table)
			}
			return nil
		},
	}
}

// migrate opens database.path, creating the file if it is missing, and
// applies the relay's migrations; it returns the versions it applied.
func migrate(ctx context.Context, cfg config.Config) ([]int, error) {
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout, Create: true})
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return schema.Migrate(ctx, s)
}
