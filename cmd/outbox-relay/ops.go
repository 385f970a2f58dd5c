package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// openDB opens database.path for an operator command.
func (c *cli) openDB(ctx context.Context, readOnly bool) (*sqlitedb.DB, config.Config, error) {
	cfg, err := c.loadConfig()
	if err != nil {
		return nil, cfg, err
	}
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout, ReadOnly: readOnly})
	return s, cfg, err
}

// migrate opens database.path, creating the file if it is missing, and
// applies the relay's migrations; it returns the versions it applied.
func migrate(ctx context.Context, cfg config.Config) ([]int, error) {
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout, Create: true})
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return schema.Migrate(ctx, s)
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// parkedListed is how many parked keys status lists, longest parked
// first; it counts them all.
const parkedListed = 100

func (c *cli) statusCommand() *cobra.Command {
	var asJSON bool
	var last int
	cmd := &cobra.Command{
		Use:   "status [--json]",
		Short: "Rows per status, oldest pending age, relays, parked keys, last dead letters (read-only)",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			ctx := context.Background()
			s, cfg, err := c.openDB(ctx, true)
			if err != nil {
				return err
			}
			defer s.Close()
			st, err := admin.ReadStatus(ctx, s, admin.StatusOptions{LastDead: last, ParkedKeys: parkedListed, Parks: cfg.Ordering.Parks()})
			if err != nil {
				return err
			}
			now := time.Now()
			age := 0.0
			if !st.OldestPending.IsZero() {
				age = max(0, now.Sub(st.OldestPending).Seconds())
			}
			if asJSON {
				return printJSON(c.stdout, struct {
					Database      string  `json:"database"`
					Table         string  `json:"table"`
					OldestPending float64 `json:"oldest_pending_age_seconds"`
					OnDeadLetter  string  `json:"ordering_on_dead_letter"`
					admin.Status
				}{cfg.Database.Path, cfg.Database.Table, age, cfg.Ordering.OnDeadLetter, st})
			}
			w := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintf(w, "database\t%s (table %s)\n", cfg.Database.Path, cfg.Database.Table)
			fmt.Fprintf(w, "rows\t%s\n", rowCounts(st.Rows))
			fmt.Fprintf(w, "pending\tdue %d   scheduled %d\n", st.PendingDue, st.PendingScheduled)
			if st.OldestPending.IsZero() {
				fmt.Fprintf(w, "oldest pending\tnone due\n")
			} else {
				fmt.Fprintf(w, "oldest pending\t%s waiting since it became due (%s)\n", roundAge(age), st.OldestPending.UTC().Format(time.RFC3339))
			}
			fmt.Fprintf(w, "relays\t%d\n", len(st.Relays))
			for _, r := range st.Relays {
				role := "standing by"
				if r.Leader {
					role = "leading"
				}
				fmt.Fprintf(w, "\t%s on %s (pid %d, %s), %s, %d in flight, started %s, heartbeat %s ago\n", r.ID, r.Hostname, r.PID, r.Version,
					role, r.InFlight, r.StartedAt.UTC().Format(time.RFC3339), roundAge(now.Sub(r.HeartbeatAt).Seconds()))
			}
			fmt.Fprintf(w, "consumer exhausted\t%d message(s) (dead-letters list --consumer)\n", st.ConsumerExhausted)
			if st.LastStreamSeq > 0 {
				fmt.Fprintf(w, "stream sequence\t%d on the latest done row (audit checks each row's)\n", st.LastStreamSeq)
			}
			switch {
			case !cfg.Ordering.Parks():
				fmt.Fprintf(w, "parked keys\tnone (ordering.on_dead_letter: %s)\n", cfg.Ordering.OnDeadLetter)
			case st.ParkedKeyCount == 0:
				fmt.Fprintf(w, "parked keys\tnone\n")
			default:
				fmt.Fprintf(w, "parked keys\t%d: their rows wait until the dead letter is retried (dead-letters retry ID) or deleted\n", st.ParkedKeyCount)
			}
			w.Flush()
			if len(st.ParkedKeys) > 0 {
				fmt.Fprintf(c.stdout, "parked keys, longest parked first:\n")
				printParkedKeys(c.stdout, st.ParkedKeys)
				if more := st.ParkedKeyCount - int64(len(st.ParkedKeys)); more > 0 {
					fmt.Fprintf(c.stdout, "and %d more parked key(s)\n", more)
				}
			}
			if len(st.LastDeadLetters) > 0 {
				fmt.Fprintf(c.stdout, "last dead letters (dead-letters list for more):\n")
				printDeadLetters(c.stdout, st.LastDeadLetters)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	cmd.Flags().IntVar(&last, "last", 5, "how many recent dead letters to show")
	return cmd
}

// rowCounts lists the rows per status in lifecycle order, then the rows
// whose status the relay does not know (another writer's) as "other", each
// named.
func rowCounts(rows map[event.Status]int64) string {
	var counts, others []string
	var other int64
	for _, status := range event.Statuses {
		counts = append(counts, fmt.Sprintf("%s %d", status, rows[status]))
	}
	for status, n := range rows {
		if !slices.Contains(event.Statuses, status) {
			other += n
			name := strconv.Quote(string(status))
			if status == admin.NullStatus {
				name = "NULL"
			}
			others = append(others, fmt.Sprintf("%s %d", name, n))
		}
	}
	if other > 0 {
		slices.Sort(others)
		counts = append(counts, fmt.Sprintf("other %d (%s)", other, strings.Join(others, ", ")))
	}
	return strings.Join(counts, "   ")
}

func roundAge(seconds float64) string {
	d := time.Duration(seconds * float64(time.Second))
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

func printDeadLetters(w io.Writer, dls []admin.DeadLetter) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tEVENT_ID\tEVENT_TYPE\tATTEMPTS\tPROCESSED_AT\tLAST_ERROR")
	for _, d := range dls {
		fmt.Fprintf(tw, "%d\t%s\t%q\t%d\t%s\t%s\n", d.ID, d.EventID, d.EventType, d.Attempts, d.ProcessedAt.UTC().Format(time.RFC3339), oneLine(d.LastError))
	}
	tw.Flush()
}

// printParkedKeys lists parked keys, each with the dead letter its rows
// wait behind (ROW_ID, dead-lettered at SINCE) and how many rows wait.
func printParkedKeys(w io.Writer, keys []admin.ParkedKey) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ORDERING_KEY\tSINCE\tROW_ID\tWAITING\tEVENT_TYPE\tLAST_ERROR")
	for _, p := range keys {
		fmt.Fprintf(tw, "%q\t%s\t%d\t%d\t%q\t%s\n", p.OrderingKey, p.ProcessedAt.UTC().Format(time.RFC3339), p.ID, p.WaitingRows, p.EventType, oneLine(p.LastError))
	}
	tw.Flush()
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 160 {
		s = s[:157] + "..."
	}
	return s
}

func (c *cli) deadLettersCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dead-letters",
		Short: "Inspect and requeue dead-lettered rows",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usagef("dead-letters needs a subcommand: list or retry")
		},
	}
	var asJSON, consumer bool
	var limit int
	list := &cobra.Command{
		Use:   "list [--json] [--limit N] [--consumer]",
		Short: "List dead-lettered rows, newest first (--consumer: messages the JetStream consumer gave up on)",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if limit < 1 {
				return usagef("--limit must be at least 1")
			}
			ctx := context.Background()
			s, _, err := c.openDB(ctx, true)
			if err != nil {
				return err
			}
			defer s.Close()
			if consumer {
				ex, err := admin.ExhaustedMessages(ctx, s, limit)
				if err != nil {
					return err
				}
				if asJSON {
					return printJSON(c.stdout, ex)
				}
				tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "EVENT_ID\tSTREAM\tCONSUMER\tSTREAM_SEQ\tSUBJECT\tDELIVERIES\tOBSERVED_AT")
				for _, e := range ex {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\n", e.EventID, e.Stream, e.Consumer, e.StreamSeq, e.Subject, e.Deliveries, e.ObservedAt.UTC().Format(time.RFC3339))
				}
				return tw.Flush()
			}
			dls, err := admin.DeadLetters(ctx, s, limit)
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(c.stdout, dls)
			}
			printDeadLetters(c.stdout, dls)
			return nil
		},
	}
	list.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	list.Flags().IntVar(&limit, "limit", 50, "at most this many rows")
	list.Flags().BoolVar(&consumer, "consumer", false, "list what the durable consumer gave up on (max-deliveries advisories)")

	var all bool
	retry := &cobra.Command{
		Use:   "retry (--all | ID...)",
		Short: "Requeue dead-lettered rows: pending, attempts 0, available now (last_error kept until the next attempt)",
		RunE: func(_ *cobra.Command, args []string) error {
			if all == (len(args) > 0) {
				return usagef("dead-letters retry: give --all or row ids, not both or neither")
			}
			// Each id once: a repeated id is one row, requeued at most once.
			var ids []int64
			seen := map[int64]bool{}
			for _, a := range args {
				id, err := strconv.ParseInt(a, 10, 64)
				if err != nil {
					return usagef("dead-letters retry: %q is not a row id", a)
				}
				if !seen[id] {
					seen[id] = true
					ids = append(ids, id)
				}
			}
			ctx := context.Background()
			s, _, err := c.openDB(ctx, false)
			if err != nil {
				return err
			}
			defer s.Close()
			n, err := admin.Requeue(ctx, s, all, ids)
			if err != nil {
				return err
			}
			fmt.Fprintf(c.stdout, "requeued %d dead-lettered row(s)\n", n)
			if !all && int(n) < len(ids) {
				fmt.Fprintf(c.stdout, "%d of the ids given were not dead-lettered and were left alone\n", len(ids)-int(n))
			}
			return nil
		},
	}
	retry.Flags().BoolVar(&all, "all", false, "requeue every dead-lettered row")
	cmd.AddCommand(list, retry)
	return cmd
}
