package main

import (
	"context"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
	"github.com/outbox-relay/outbox-relay/ledger"
)

// parkedListed is how many parked keys status lists, longest parked
// first; it counts them all.
const parkedListed = 100

// relayStaleAfter is how long a relay may go without a heartbeat before
// the relays take it for dead and the next one takes its lead: the
// relay's own staleness window, which the ledger package exports for its
// workers.
const relayStaleAfter = ledger.RelayStaleAfter

func (c *cli) statusCommand() *cobra.Command {
	var asJSON, stream bool
	var last int
	cmd := &cobra.Command{
		Use:   "status [--json] [--last N] [--db TENANT]",
		Short: "Rows per status, oldest pending age, relays, parked keys, last dead letters (read-only)",
		Long: `status shows one database file at a glance: rows per status, the oldest due
row's age, the relays and which one leads, parked ordering keys and the last
dead letters. It only reads the file, and is safe while relays run.

When database.path is a fleet's pattern (/data/tenants/*.db), status without
--db prints one line a file, worst first: files that could not be read, with
why, then the largest backlogs. --db TENANT shows that tenant's file in full.`,
		Example: `  outbox-relay status --database-path /var/lib/app/app.db
  outbox-relay status --config /etc/outbox-relay.yaml --json | jq .relays
  outbox-relay status --last 20
  outbox-relay status --database-path '/data/tenants/*.db'
  outbox-relay status --database-path '/data/tenants/*.db' --db acme`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if last < 0 {
				return usagef("status: --last must be 0 or more")
			}
			ctx := context.Background()
			cfg, err := c.loadConfig()
			if err != nil {
				return err
			}
			if fleet.IsPattern(cfg.Database.Path) && c.db == "" {
				return c.fleetStatus(ctx, cfg, stream, asJSON)
			}
			s, cfg, err := c.openDB(ctx, true, admin.StatusTables...)
			if err != nil {
				return err
			}
			defer s.Close()
			st, err := admin.ReadStatus(ctx, s, admin.StatusOptions{LastDead: last, ParkedKeys: parkedListed, Parks: cfg.Ordering.Parks(),
				StaleAfter: relayStaleAfter})
			if err != nil {
				return err
			}
			now := time.Now()
			r := admin.StatusReport{Database: cfg.Database.Path, Table: cfg.Database.Table, OldestPendingAge: st.OldestPendingAge(now),
				OnDeadLetter: cfg.Ordering.OnDeadLetter, Status: st, Parks: cfg.Ordering.Parks()}
			if stream {
				if r.Window, err = c.streamWindow(ctx); err != nil {
					return err
				}
			}
			return c.output(asJSON, r, func(w io.Writer) { r.Print(w, now) })
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	cmd.Flags().BoolVar(&stream, "stream", false, "also ask the server for the stream's duplicate window (connects to nats.url)")
	cmd.Flags().IntVar(&last, "last", 5, "how many recent dead letters to show")
	return cmd
}

// streamWindow asks the server for the stream's duplicate window against
// the one the relay needs (status --stream).
func (c *cli) streamWindow(ctx context.Context) (*streamsync.Window, error) {
	cfg, _, js, closeConn, err := c.streamClient(ctx, "status", "examine")
	if err != nil {
		return nil, err
	}
	defer closeConn()
	w, err := streamsync.Examine(ctx, js.API(), daemon.Want(cfg))
	if err != nil {
		return nil, err
	}
	return &w, nil
}
