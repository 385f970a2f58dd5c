package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
)

// signalContext is cancelled by the first SIGTERM, SIGINT or SIGHUP (the
// relay has no configuration reload: a hang-up stops it cleanly, and its
// supervisor starts it again with the new file); a second one exits at once
// (claims are then recovered by the next relay).
func signalContext(log *zap.Logger) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	go func() {
		sig, ok := <-ch
		if !ok {
			return
		}
		log.Info("shutting down; a second signal exits at once", zap.String("signal", sig.String()))
		cancel()
		if sig, ok = <-ch; ok {
			log.Warn("second signal; exiting now", zap.String("signal", sig.String()))
			log.Sync()
			os.Exit(exitRuntime)
		}
	}()
	return ctx, func() { signal.Stop(ch); close(ch); cancel() }
}

// start builds the logger and the signal context of a long-running command;
// stop flushes and releases both. With JSON logs, the error the command
// ends on is logged too (reportError).
func (c *cli) start(cfg config.Config) (log *zap.Logger, ctx context.Context, stop func(), err error) {
	if log, err = newLogger(cfg.Log, c.stderr); err != nil {
		return nil, nil, nil, err
	}
	if cfg.Log.Format != "console" {
		c.jsonLog = log
	}
	ctx, stopSignals := signalContext(log)
	return log, ctx, func() { stopSignals(); log.Sync() }, nil
}

// tuneGC trades a little memory for much less GC work. The relay's live
// heap is small (the rows in flight) but churns through every row, so at
// the default GOGC=100 it collects hundreds of times a second. A larger
// GOGC with a soft limit collects far less often and still keeps the heap
// small; GOGC and GOMEMLIMIT in the environment win.
func tuneGC() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(400)
	}
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(24 << 20)
	}
}

// runDaemon is the run command.
func (c *cli) runDaemon(*cobra.Command) error {
	cfg, err := c.loadConfig()
	if err != nil {
		return err
	}
	tuneGC()
	log, ctx, stop, err := c.start(cfg)
	if err != nil {
		return err
	}
	defer stop()
	a, err := daemon.Open(ctx, cfg, log, daemon.Options{Version: version, Commit: buildCommit()})
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
			ctx := context.Background()
			applied, err := migrate(ctx, cfg)
			if err != nil {
				return err
			}
			if len(applied) == 0 {
				fmt.Fprintf(c.stdout, "%s: schema of %s is up to date\n", cfg.Database.Path, cfg.Database.Table)
				return nil
			}
			fmt.Fprintf(c.stdout, "%s: applied migrations %v to %s\n", cfg.Database.Path, applied, cfg.Database.Table)
			return nil
		},
	}
}
