package main

import (
	"context"
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
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/event"
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
		Use:   "status [--json] [--last N]",
		Short: "Rows per status, oldest pending age, relays, parked keys, last dead letters (read-only)",
		Example: `  outbox-relay status --database-path /var/lib/app/app.db
  outbox-relay status --config /etc/outbox-relay.yaml --json | jq .relays
  outbox-relay status --last 20`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			ctx := context.Background()
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
			age := 0.0
			if !st.OldestPending.IsZero() {
				age = max(0, now.Sub(st.OldestPending).Seconds())
			}
			var window *streamsync.Window
			if stream {
				if window, err = c.streamWindow(ctx); err != nil {
					return err
				}
			}
			if asJSON {
				return printJSON(c.stdout, struct {
					Database      string             `json:"database"`
					Table         string             `json:"table"`
					OldestPending float64            `json:"oldest_pending_age_seconds"`
					OnDeadLetter  string             `json:"ordering_on_dead_letter"`
					Window        *streamsync.Window `json:"duplicate_window,omitempty"`
					admin.Status
				}{cfg.Database.Path, cfg.Database.Table, age, cfg.Ordering.OnDeadLetter, window, st})
			}
			printStatus(c.stdout, cfg, st, now, age)
			if window != nil {
				printWindow(c.stdout, *window)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	cmd.Flags().BoolVar(&stream, "stream", false, "also ask the server for the stream's duplicate window (connects to nats.url)")
	cmd.Flags().IntVar(&last, "last", 5, "how many recent dead letters to show")
	return cmd
}

// printStatus renders a status for people; age is the oldest due row's,
// in seconds.
func printStatus(out io.Writer, cfg config.Config, st admin.Status, now time.Time, age float64) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "database\t%s (table %s)\n", cfg.Database.Path, cfg.Database.Table)
	fmt.Fprintf(w, "rows\t%s\n", rowCounts(st.Rows))
	fmt.Fprintf(w, "pending\tdue %d   scheduled %d\n", st.PendingDue, st.PendingScheduled)
	if st.OldestPending.IsZero() {
		fmt.Fprintf(w, "oldest pending\tnone due\n")
	} else {
		fmt.Fprintf(w, "oldest pending\t%s waiting since it became due (%s)\n", roundAge(age), st.OldestPending.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(w, "relays\t%d\n", len(st.Relays))
	printRelays(w, st.Relays, now)
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
		fmt.Fprintf(out, "parked keys, longest parked first:\n")
		printParkedKeys(out, st.ParkedKeys)
		if more := st.ParkedKeyCount - int64(len(st.ParkedKeys)); more > 0 {
			fmt.Fprintf(out, "and %d more parked key(s)\n", more)
		}
	}
	if len(st.LastDeadLetters) > 0 {
		fmt.Fprintf(out, "last dead letters (dead-letters list for more):\n")
		printDeadLetters(out, st.LastDeadLetters)
	}
}

// printRelays lists the heartbeat rows, one a line in the second column of
// w. A relay presumed dead is said to be so, with who takes over: a live
// relay heartbeating beside it, or else the next one to start.
func printRelays(w io.Writer, relays []admin.Instance, now time.Time) {
	live := slices.ContainsFunc(relays, func(r admin.Instance) bool { return !r.PresumedDead })
	for _, r := range relays {
		since := roundAge(now.Sub(r.HeartbeatAt).Seconds())
		state := fmt.Sprintf("standing by, %d in flight, heartbeat %s ago", r.InFlight, since)
		switch {
		case r.PresumedDead && live:
			state = fmt.Sprintf("not heartbeating for %s: presumed dead; a live relay takes over (and its %d row(s) in flight)", since, r.InFlight)
		case r.PresumedDead:
			state = fmt.Sprintf("not heartbeating for %s: presumed dead; the next relay to start takes over (and its %d row(s) in flight)", since, r.InFlight)
		case r.Leader:
			state = fmt.Sprintf("leading, %d in flight, heartbeat %s ago", r.InFlight, since)
		}
		fmt.Fprintf(w, "\t%s on %s (pid %d, %s), started %s, %s\n", shown(r.ID), shown(r.Hostname), r.PID, shown(r.Version),
			r.StartedAt.UTC().Format(time.RFC3339), state)
	}
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
		fmt.Fprintf(tw, "%d\t%s\t%q\t%d\t%s\t%s\n", d.ID, shown(d.EventID), d.EventType, d.Attempts, d.ProcessedAt.UTC().Format(time.RFC3339), oneLine(d.LastError))
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

// printWindow says how long the stream deduplicates, with the warning and
// the choice when that is shorter than the relay needs.
func printWindow(out io.Writer, w streamsync.Window) {
	fmt.Fprintf(out, "duplicate window: %s (stream %s, stream.duplicate_window %s)\n", w.Have, w.Stream, w.Want)
	if warning := w.Warning(); warning != "" {
		fmt.Fprintf(out, "warning: %s\n", warning)
	}
}
