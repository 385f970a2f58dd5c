package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	neturl "net/url"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// healthcheckCommand probes a running relay's /healthz, for container
// HEALTHCHECKs in images without a shell or curl.
func (c *cli) healthcheckCommand() *cobra.Command {
	var base, path string
	cmd := &cobra.Command{
		Use:   "healthcheck [--url URL] [--path /readyz]",
		Short: "Exit 0 if the relay at metrics.listen answers /healthz (for container healthchecks)",
		Example: `  outbox-relay healthcheck                                   # /healthz on metrics.listen
  outbox-relay healthcheck --path /readyz                    # readiness: leading and the broker answering
  outbox-relay healthcheck --url http://relay:9108 --path /readyz`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			url, err := c.probeURL(base, path, cmd.Flags().Changed("path"))
			if err != nil {
				return err
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
	cmd.Flags().StringVar(&base, "url", "", "URL to probe (default: http://metrics.listen); --path, when given, replaces its path")
	cmd.Flags().StringVar(&path, "path", "/healthz", "path to probe (/readyz for readiness)")
	return cmd
}

// probeURL is what healthcheck probes: path on metrics.listen, or the URL
// given, with path in place of its own when one was given (pathSet) or it
// has none.
func (c *cli) probeURL(base, path string, pathSet bool) (string, error) {
	if !strings.HasPrefix(path, "/") {
		return "", usagef("healthcheck: --path %q must start with /", path)
	}
	if base == "" {
		cfg, err := c.loadConfig()
		if err != nil {
			return "", err
		}
		if cfg.Metrics.Listen == "" {
			return "", usagef("healthcheck: metrics.listen is empty: nothing to probe")
		}
		host, port, err := net.SplitHostPort(cfg.Metrics.Listen)
		if err != nil {
			return "", usagef("healthcheck: metrics.listen %q: %v", cfg.Metrics.Listen, err)
		}
		if host == "" || host == "0.0.0.0" || host == "::" {
			host = "127.0.0.1"
		}
		return "http://" + net.JoinHostPort(host, port) + path, nil
	}
	u, err := neturl.Parse(base)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return "", usagef("healthcheck: --url %q is not an absolute URL such as http://127.0.0.1:9108", base)
	}
	if pathSet || u.Path == "" || u.Path == "/" {
		u.Path, u.RawPath = path, ""
	}
	return u.String(), nil
}
