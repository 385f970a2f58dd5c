package main

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/audit"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

func (c *cli) auditCommand() *cobra.Command {
	var asJSON bool
	var since time.Duration
	var limit int
	cmd := &cobra.Command{
		Use:   "audit [--since DURATION] [--limit N] [--json]",
		Short: "Check that each done row's message is in the stream, by the sequence recorded on the row",
		Long: `audit reads the done rows (newest first) and, for each, the message at the
stream sequence JetStream gave it, and reports how many carry the row's event id
(Nats-Msg-Id), how many the stream no longer holds (removed by its limits, a
purge or a delete), how many rows have no sequence recorded (done before the
relay recorded them, or published with core NATS), how many were published to
an earlier stream of the name (done before the stream was created: it was
deleted and created again), and every mismatch: a sequence that holds another
event. Exit code 1 when there is a mismatch.
Read-only on the database and safe while the relay runs.`,
		Example: `  outbox-relay audit --database-path app.db --nats-url nats://nats:4222
  outbox-relay audit --config /etc/outbox-relay.yaml --since 24h
  outbox-relay audit --config /etc/outbox-relay.yaml --limit 10000 --json`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error { return c.audit(since, limit, asJSON) },
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	cmd.Flags().DurationVar(&since, "since", 0, "only rows done within this long (default: all)")
	cmd.Flags().IntVar(&limit, "limit", 0, "at most this many rows, newest first (default: all)")
	return cmd
}

// audit is the audit command: it audits the done rows (since, limit) and
// prints the summary (asJSON: as JSON); errNeedsAttention on a mismatch.
func (c *cli) audit(since time.Duration, limit int, asJSON bool) error {
	if limit < 0 || since < 0 {
		return usagef("audit: --since and --limit must not be negative")
	}
	ctx := context.Background()
	db, dbCfg, err := c.openDB(ctx, true) // first: a missing table needs no server to report
	if err != nil {
		return err
	}
	defer db.Close()
	cfg, _, js, closeJS, err := c.streamClient(ctx, "audit", "audit")
	if err != nil {
		return err
	}
	defer closeJS()
	read := func(ctx context.Context, seqs []uint64) ([]streamsync.Stored, streamsync.StreamState, error) {
		return streamsync.ReadStored(ctx, js.API(), cfg.Stream.Name, seqs, 32)
	}
	o := audit.Options{Since: since, Limit: limit}
	if tty := terminal(c.stderr); tty && !asJSON {
		o.Progress = func(n int) { fmt.Fprintf(c.stderr, "\raudited %d done rows", n) }
		defer fmt.Fprint(c.stderr, "\r\033[K")
	}
	r, err := audit.Run(ctx, db, read, o)
	if err != nil {
		return err
	}
	// dbCfg names the file audited: on a fleet, the one --db chose.
	sum := audit.Summary{Database: dbCfg.Database.Path, Table: cfg.Database.Table, Stream: cfg.Stream.Name, Since: since, SinceSeconds: since.Seconds(), Report: r}
	if err := c.output(asJSON, sum, sum.Print); err != nil || len(r.Mismatches) == 0 {
		return err
	}
	return errNeedsAttention
}
