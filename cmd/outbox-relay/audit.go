package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/audit"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// mismatchesShown is how many mismatches audit prints; --json has all.
const mismatchesShown = 20

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
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if limit < 0 || since < 0 {
				return usagef("audit: --since and --limit must not be negative")
			}
			ctx := context.Background()
			db, _, err := c.openDB(ctx, true) // first: a missing table needs no server to report
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
			if asJSON {
				if err := printJSON(c.stdout, struct {
					Database string  `json:"database"`
					Stream   string  `json:"stream"`
					Since    float64 `json:"since_seconds,omitempty"`
					audit.Report
				}{cfg.Database.Path, cfg.Stream.Name, since.Seconds(), r}); err != nil {
					return err
				}
			} else {
				printAudit(c.stdout, cfg, since, r)
			}
			if len(r.Mismatches) > 0 {
				return errNeedsAttention
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	cmd.Flags().DurationVar(&since, "since", 0, "only rows done within this long (default: all)")
	cmd.Flags().IntVar(&limit, "limit", 0, "at most this many rows, newest first (default: all)")
	return cmd
}

func printAudit(w io.Writer, cfg config.Config, since time.Duration, r audit.Report) {
	which := "all done rows"
	if since > 0 {
		which = fmt.Sprintf("done rows of the last %s", since)
	}
	fmt.Fprintf(w, "audit of %s (table %s) against stream %s: %s, %d audited\n", cfg.Database.Path, cfg.Database.Table, cfg.Stream.Name, which, r.Audited)
	fmt.Fprintf(w, "  matched     %d (the message at the row's stream sequence carries its event id)\n", r.Matched)
	fmt.Fprintf(w, "  removed     %d (no longer in the stream: its limits, a purge or a delete; first sequence now %d)\n", r.Removed, r.FirstSeq)
	fmt.Fprintf(w, "  unrecorded  %d (no stream sequence on the row: done before it was recorded, or core NATS)\n", r.Unrecorded)
	if r.EarlierStream > 0 {
		fmt.Fprintf(w, "  earlier     %d (published to an earlier stream %s, since deleted: done before this one was created at %s)\n",
			r.EarlierStream, cfg.Stream.Name, r.Created.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(w, "  mismatched  %d\n", len(r.Mismatches))
	for i, m := range r.Mismatches {
		if i == mismatchesShown {
			fmt.Fprintf(w, "  and %d more (--json lists them all)\n", len(r.Mismatches)-mismatchesShown)
			break
		}
		fmt.Fprintf(w, "  row %d (event_id %s): stream sequence %d holds event %q (row %q)\n", m.RowID, shown(m.EventID), m.StreamSeq, m.MsgID, m.MsgRowID)
	}
}

// terminal reports whether w is a terminal (for progress lines).
func terminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
