package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/demo"
)

// healthcheckCommand probes a running relay's /healthz, for container
// HEALTHCHECKs in images without a shell or curl.
func (c *cli) healthcheckCommand() *cobra.Command {
	var url string
	var path string
	cmd := &cobra.Command{
		Use:   "healthcheck [--url URL]",
		Short: "Exit 0 if the relay at metrics.listen answers /healthz (for container healthchecks)",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if url == "" {
				cfg, err := c.loadConfig()
				if err != nil {
					return err
				}
				if cfg.Metrics.Listen == "" {
					return usagef("healthcheck: metrics.listen is empty: nothing to probe")
				}
				host, port, err := net.SplitHostPort(cfg.Metrics.Listen)
				if err != nil {
					return usagef("healthcheck: metrics.listen %q: %v", cfg.Metrics.Listen, err)
				}
				if host == "" || host == "0.0.0.0" || host == "::" {
					host = "127.0.0.1"
				}
				url = "http://" + net.JoinHostPort(host, port) + path
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			if err != nil {
				return usagef("healthcheck: %v", err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return fmt.Errorf("healthcheck %s: %w", url, err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("healthcheck %s: %s", url, resp.Status)
			}
			fmt.Fprintf(c.stdout, "%s: %s\n", url, resp.Status)
			return nil
		},
	}
	cmd.Flags().StringVar(&url, "url", "", "URL to probe (default: /healthz on metrics.listen)")
	cmd.Flags().StringVar(&path, "path", "/healthz", "path to probe on metrics.listen (/readyz for readiness)")
	return cmd
}

// demoAppCommand is the example application of the compose file: it
// creates the outbox schema (as the application's own migrations would)
// and writes a row of its own plus an event in one transaction, rate times
// a second, until stopped.
func (c *cli) demoAppCommand() *cobra.Command {
	var rate int
	cmd := &cobra.Command{
		Use:   "demo-app [--rate N]",
		Short: "An example application writing events into database.path (the compose demo's app)",
		Args:  cobra.NoArgs,
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
			log.Info("demo application writing events", zap.String("database", cfg.Database.Path), zap.Int("rate", rate))
			n, err := demo.WriteEvents(ctx, cfg.Database.Path, cfg.Database.Table, rate, func(err error) {
				log.Warn("demo application write failed", zap.Error(err))
			})
			log.Info("demo application stopped", zap.Int64("written", n))
			return err
		},
	}
	cmd.Flags().IntVar(&rate, "rate", 20, "events per second")
	return cmd
}
