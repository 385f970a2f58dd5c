package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// openDB opens database.path for an operator command. One that writes in
// many short transactions checkpoints between them itself (see
// admin.Requeue), outside the lock.
func (c *cli) openDB(ctx context.Context, readOnly bool) (*sqlitedb.DB, config.Config, error) {
	cfg, err := c.loadConfig()
	if err != nil {
		return nil, cfg, err
	}
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout,
		ReadOnly: readOnly, OwnCheckpoints: !readOnly})
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

// filterFlags are the dead-letter filters of list, retry and discard.
type filterFlags struct {
	typ, since, until, errText string
}

func (f *filterFlags) bind(fs *pflag.FlagSet) {
	fs.StringVar(&f.typ, "type", "", "only rows of this event_type")
	fs.StringVar(&f.since, "since", "", "only rows dead-lettered since then: a duration ago (24h) or an RFC 3339 time")
	fs.StringVar(&f.until, "until", "", "only rows dead-lettered before then: a duration ago (1h) or an RFC 3339 time")
	fs.StringVar(&f.errText, "error", "", "only rows whose last_error contains this text")
}

// filter returns the flags as an admin.Filter, or a usage error naming
// the flag.
func (f *filterFlags) filter(now time.Time) (admin.Filter, error) {
	out := admin.Filter{Type: f.typ, Error: f.errText}
	for _, w := range []struct {
		name, val string
		into      *time.Time
	}{{"--since", f.since, &out.Since}, {"--until", f.until, &out.Until}} {
		if w.val == "" {
			continue
		}
		if d, err := time.ParseDuration(w.val); err == nil && d >= 0 {
			*w.into = now.Add(-d)
		} else if t, err := time.Parse(time.RFC3339, w.val); err == nil {
			*w.into = t
		} else {
			return out, usagef("dead-letters: %s %q is neither a duration (24h) nor an RFC 3339 time", w.name, w.val)
		}
	}
	return out, nil
}

// selection reads the ids of retry and discard (each once) and --all.
func selection(cmd string, all bool, args []string, f admin.Filter) (admin.Selection, error) {
	if all == (len(args) > 0) {
		return admin.Selection{}, usagef("dead-letters %s: give --all or row ids, not both or neither", cmd)
	}
	sel := admin.Selection{All: all, Filter: f}
	seen := map[int64]bool{}
	for _, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil {
			return sel, usagef("dead-letters %s: %q is not a row id", cmd, a)
		}
		if !seen[id] {
			seen[id] = true
			sel.IDs = append(sel.IDs, id)
		}
	}
	return sel, nil
}

// showPayload is how a payload is shown: as text when it is UTF-8 without
// control characters other than whitespace, else hex; cut at max bytes.
func showPayload(p []byte, maxBytes int) (shown, encoding string, truncated bool) {
	if maxBytes >= 0 && len(p) > maxBytes {
		cut := maxBytes
		if utf8.Valid(p) {
			for cut > 0 && !utf8.RuneStart(p[cut]) {
				cut-- // text is cut between characters
			}
		}
		p, truncated = p[:cut], true
	}
	if printable(p) {
		return string(p), "text", truncated
	}
	return hex.EncodeToString(p), "hex", truncated
}

func printable(p []byte) bool {
	if !utf8.Valid(p) {
		return false
	}
	for _, r := range string(p) {
		if unicode.IsControl(r) && r != '\n' && r != '\r' && r != '\t' {
			return false
		}
	}
	return true
}

func (c *cli) deadLettersCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dead-letters",
		Short: "Inspect, requeue and discard dead-lettered rows",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usagef("dead-letters needs a subcommand: list, show, retry or discard")
		},
	}
	var asJSON, consumer bool
	var limit int
	var lf filterFlags
	list := &cobra.Command{
		Use:   "list [--json] [--limit N] [--consumer] [--type T] [--since WHEN] [--until WHEN] [--error TEXT]",
		Short: "List dead-lettered rows, newest first (--consumer: messages the JetStream consumer gave up on)",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if limit < 1 {
				return usagef("--limit must be at least 1")
			}
			f, err := lf.filter(time.Now())
			if err != nil {
				return err
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
			dls, err := admin.DeadLetters(ctx, s, f, limit)
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
	lf.bind(list.Flags())

	var showJSON bool
	var maxBytes int
	show := &cobra.Command{
		Use:   "show ID [--json] [--max-bytes N]",
		Short: "Show one row whole: its columns, and its payload as text when it is UTF-8, else as hex",
		Args:  cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			id, err := strconv.ParseInt(args[0], 10, 64)
			if err != nil {
				return usagef("dead-letters show: %q is not a row id", args[0])
			}
			ctx := context.Background()
			s, _, err := c.openDB(ctx, true)
			if err != nil {
				return err
			}
			defer s.Close()
			r, err := admin.ReadRow(ctx, s, id)
			if err != nil {
				return err
			}
			payload, encoding, cut := showPayload(r.Payload, maxBytes)
			if showJSON {
				return printJSON(c.stdout, struct {
					admin.Row
					Payload          string `json:"payload"`
					PayloadEncoding  string `json:"payload_encoding"`
					PayloadBytes     int    `json:"payload_bytes"`
					PayloadTruncated bool   `json:"payload_truncated"`
				}{r, payload, encoding, len(r.Payload), cut})
			}
			tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
			for _, kv := range [][2]string{
				{"id", strconv.FormatInt(r.ID, 10)}, {"status", r.Status}, {"event_id", r.EventID}, {"event_type", strconv.Quote(r.EventType)},
				{"ordering_key", strconv.Quote(r.OrderingKey)}, {"attempts", strconv.Itoa(r.Attempts)},
				{"created_at", r.CreatedAt.UTC().Format(time.RFC3339Nano)}, {"available_at", r.AvailableAt.UTC().Format(time.RFC3339Nano)},
				{"processed_at", r.ProcessedAt.UTC().Format(time.RFC3339Nano)}, {"last_error", r.LastError}, {"headers", r.Headers},
			} {
				fmt.Fprintf(tw, "%s\t%s\n", kv[0], kv[1])
			}
			tw.Flush()
			more := ""
			if cut {
				more = fmt.Sprintf(", the first %d shown (--max-bytes)", maxBytes)
			}
			fmt.Fprintf(c.stdout, "payload (%d bytes, %s%s):\n%s\n", len(r.Payload), encoding, more, payload)
			return nil
		},
	}
	show.Flags().BoolVar(&showJSON, "json", false, "print as JSON")
	show.Flags().IntVar(&maxBytes, "max-bytes", 4096, "show at most this many bytes of the payload (-1: all)")

	bulkCommand := func(name, short, did string, op func(context.Context, *sqlitedb.DB, admin.Selection, bool) (admin.Bulk, error)) *cobra.Command {
		var all, dryRun, asJSON bool
		var ff filterFlags
		cmd := &cobra.Command{
			Use:   name + " (--all | ID...) [--type T] [--since WHEN] [--until WHEN] [--error TEXT] [--dry-run] [--json]",
			Short: short,
			RunE: func(_ *cobra.Command, args []string) error {
				f, err := ff.filter(time.Now())
				if err != nil {
					return err
				}
				sel, err := selection(name, all, args, f)
				if err != nil {
					return err
				}
				ctx := context.Background()
				s, _, err := c.openDB(ctx, dryRun)
				if err != nil {
					return err
				}
				defer s.Close()
				b, err := op(ctx, s, sel, dryRun)
				if err != nil {
					return err
				}
				if asJSON {
					return printJSON(c.stdout, b)
				}
				if dryRun {
					fmt.Fprintf(c.stdout, "would %s %d dead-lettered row(s) (dry run: nothing changed)\n", name, b.Matched)
				} else {
					fmt.Fprintf(c.stdout, "%s %d dead-lettered row(s) in %d transaction(s), the longest holding the write lock %.1f ms\n", did, b.Changed, b.Transactions, b.LongestLockMs)
				}
				if !all && int(b.Matched) < len(sel.IDs) {
					why := "were not dead-lettered"
					if f != (admin.Filter{}) {
						why = "were not dead-lettered, or not taken by the filters,"
					}
					fmt.Fprintf(c.stdout, "%d of the ids given %s and were left alone\n", len(sel.IDs)-int(b.Matched), why)
				}
				return nil
			},
		}
		cmd.Flags().BoolVar(&all, "all", false, "every dead-lettered row the filters take")
		cmd.Flags().BoolVar(&dryRun, "dry-run", false, "count the rows, change nothing")
		cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
		ff.bind(cmd.Flags())
		return cmd
	}
	retry := bulkCommand("retry", "Requeue dead-lettered rows: pending, attempts 0, available now (last_error kept until the next attempt)", "requeued", admin.Requeue)
	discard := bulkCommand("discard", "Delete dead-lettered rows", "discarded", admin.Discard)
	cmd.AddCommand(list, show, retry, discard)
	return cmd
}
