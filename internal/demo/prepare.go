package demo

import (
	"os"
	"path/filepath"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// Prepare makes cfg the demo's and returns it with the demo's directory:
// dir, created when missing, or a new temporary directory when dir is
// empty. The database is app.db there; unless cfg names them otherwise,
// the relay publishes to an embedded server storing under dir and serves
// its metrics on a free local port. Logs are warn and console, to keep the
// progress line readable, except where the user set log.level or
// log.format (userSet reports whether a flag or the environment set a
// key).
func Prepare(cfg config.Config, dir string, userSet func(key string) bool) (config.Config, string, error) {
	if dir == "" {
		d, err := os.MkdirTemp("", "outbox-relay-demo-")
		if err != nil {
			return cfg, "", err
		}
		dir = d
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return cfg, "", err
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
	if !userSet("log.level") {
		cfg.Log.Level = "warn"
	}
	if !userSet("log.format") {
		cfg.Log.Format = "console"
	}
	return cfg, dir, nil
}
