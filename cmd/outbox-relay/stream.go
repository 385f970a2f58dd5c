package main

import (
	"context"
	"errors"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// streamClient loads the configuration and connects to the stream's
// server for a command that works on the stream (cmd names it in errors,
// and what it would do there): not in core mode, nor with the embedded
// server, whose stream only the running relay's process can reach.
func (c *cli) streamClient(ctx context.Context, cmd, does string) (config.Config, *zap.Logger, *publish.JetStream, func(), error) {
	cfg, err := c.loadConfig()
	if err != nil {
		return cfg, nil, nil, nil, err
	}
	if cfg.NATS.Mode == config.ModeCore {
		return cfg, nil, nil, nil, usagef("%s: nats.mode is core: there is no stream to %s", cmd, does)
	}
	if cfg.NATS.URL == config.EmbeddedURL {
		return cfg, nil, nil, nil, usagef("%s: nats.url is embedded: point it at the server to %s", cmd, does)
	}
	// A report on stdout; on stderr only warnings and errors beside it.
	log, err := reportLogger(cfg.Log, c.stderr)
	if err != nil {
		return cfg, nil, nil, nil, err
	}
	conn, err := publish.ConnectOnce(ctx, daemon.ConnectOptions(cfg.NATS, "outbox-relay-"+cmd), log.Named("nats"))
	if err != nil {
		return cfg, nil, nil, nil, err
	}
	js, err := publish.NewJetStream(conn, cfg.Stream.Name, 1, cfg.Relay.AckTimeout)
	if err != nil {
		conn.Close()
		return cfg, nil, nil, nil, err
	}
	return cfg, log, js, conn.Close, nil
}

// errNeedsAttention makes a command exit 1 after printing its report.
var errNeedsAttention = errors.New("needs attention")
