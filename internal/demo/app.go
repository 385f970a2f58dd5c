package demo

import (
	"context"

	"go.uber.org/zap"
)

// App is the compose file's example application: it writes events into
// table in the database at path, rate a second, until ctx ends
// (WriteEvents), logging when it starts, each write that fails, and how
// many it wrote.
func App(ctx context.Context, path, table string, rate int, log *zap.Logger) error {
	log.Info("demo application writing events", zap.String("database", path), zap.Int("rate", rate))
	n, err := WriteEvents(ctx, path, table, rate, func(err error) {
		log.Warn("demo application write failed", zap.Error(err))
	})
	log.Info("demo application stopped", zap.Int64("written", n))
	return err
}
