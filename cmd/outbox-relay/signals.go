package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
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
