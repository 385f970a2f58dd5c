package main

import (
	"fmt"
	"io"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// newLogger builds the root logger of a long-running command from the log
// section.
func newLogger(cfg config.Log, w io.Writer) (*zap.Logger, error) {
	return buildLogger(cfg, w, zapcore.DebugLevel)
}

// reportLogger is newLogger for a command whose output is a report on
// stdout (audit, streamsync): stderr keeps only warnings and errors beside
// it, whatever log.level says below warn.
func reportLogger(cfg config.Log, w io.Writer) (*zap.Logger, error) {
	return buildLogger(cfg, w, zapcore.WarnLevel)
}

// buildLogger builds a logger from the log section that logs nothing below
// atLeast. Durations are written with their unit ("1.5s", "250ms"): zap's
// default, a bare number of seconds, leaves the reader to guess it.
func buildLogger(cfg config.Log, w io.Writer, atLeast zapcore.Level) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(cfg.Level)
	if err != nil {
		return nil, &config.Error{Err: fmt.Errorf("log.level: %w", err)}
	}
	enc := zap.NewProductionEncoderConfig()
	enc.TimeKey = "ts"
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	enc.EncodeDuration = zapcore.StringDurationEncoder
	var encoder zapcore.Encoder
	if cfg.Format == "console" {
		enc.EncodeLevel = zapcore.CapitalLevelEncoder
		encoder = zapcore.NewConsoleEncoder(enc)
	} else {
		encoder = zapcore.NewJSONEncoder(enc)
	}
	// Locked: NATS callbacks log from their own goroutines.
	core := zapcore.NewCore(encoder, zapcore.Lock(zapcore.AddSync(w)), max(level, atLeast))
	return zap.New(core), nil
}

// reportError writes the error a command ends on to stderr: as a log line
// when the command is a long-running one whose logs are JSON (a log
// collector reads every line of it as JSON), else as a line for people.
func (c *cli) reportError(err error) {
	if c.jsonLog != nil {
		c.jsonLog.Error("exiting on error", zap.Error(err), zap.Int("exit_code", exitCode(err)))
		c.jsonLog.Sync()
		return
	}
	fmt.Fprintf(c.stderr, "outbox-relay: %v\n", err)
}
