package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// openDB opens database.path for an operator command, and checks that it
// holds the outbox table and the relay's tables the command reads (so that
// a wrong file or table is named, with what to do). One that writes in
// many short transactions checkpoints between them itself (see
// admin.Requeue), outside the lock.
func (c *cli) openDB(ctx context.Context, readOnly bool, relayTables ...string) (*sqlitedb.DB, config.Config, error) {
	cfg, err := c.loadConfig()
	if err != nil {
		return nil, cfg, err
	}
	// A file held locked against readers (an application in
	// locking_mode=EXCLUSIVE) is waited out, saying on stderr who holds it.
	log, err := reportLogger(cfg.Log, c.stderr)
	if err != nil {
		return nil, cfg, err
	}
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout,
		ReadOnly: readOnly, OwnCheckpoints: !readOnly, LockWait: -1, Log: log.Named("database")})
	if err != nil {
		return nil, cfg, err
	}
	if err := admin.RequireTables(ctx, s, relayTables...); err != nil {
		s.Close()
		return nil, cfg, err
	}
	return s, cfg, nil
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

// showPayload is how a payload is shown: as text when it is printable
// UTF-8 (see printable), else hex; cut at max bytes.
func showPayload(p []byte, maxBytes int) (text, encoding string, truncated bool) {
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

// printable reports whether a payload may be printed as text: UTF-8 whose
// characters are printable (as shown judges them), tabs, and line breaks
// (a carriage return only before a line feed: alone it would let the text
// after it hide the text before).
func printable(p []byte) bool {
	if !utf8.Valid(p) {
		return false
	}
	text := string(p)
	for i, r := range text {
		switch {
		case r == '\n', r == '\t', strconv.IsPrint(r):
		case r == '\r' && strings.HasPrefix(text[i+1:], "\n"):
		default:
			return false
		}
	}
	return true
}

func (c *cli) deadLettersCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dead-letters",
		Short: "Inspect, requeue and discard dead-lettered rows",
		Example: `  outbox-relay dead-letters list --database-path app.db
  outbox-relay dead-letters show 42 --database-path app.db
  outbox-relay dead-letters retry --all --error max_msg_size --dry-run --database-path app.db`,
		Args: cobra.NoArgs,
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
		Example: `  outbox-relay dead-letters list --database-path app.db
  outbox-relay dead-letters list --type OrderPlaced --since 24h --limit 10
  outbox-relay dead-letters list --error 10054 --json
  outbox-relay dead-letters list --consumer`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if limit < 1 {
				return usagef("--limit must be at least 1")
			}
			f, err := lf.filter(time.Now())
			if err != nil {
				return err
			}
			ctx := context.Background()
			var tables []string
			if consumer {
				tables = admin.ExhaustedTables
			}
			s, _, err := c.openDB(ctx, true, tables...)
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
					fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\n", shown(e.EventID), shown(e.Stream), shown(e.Consumer), e.StreamSeq, shown(e.Subject), e.Deliveries, e.ObservedAt.UTC().Format(time.RFC3339))
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
		Example: `  outbox-relay dead-letters show 42 --database-path app.db
  outbox-relay dead-letters show 42 --max-bytes -1 --json`,
		Args: cobra.ExactArgs(1),
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
				{"id", strconv.FormatInt(r.ID, 10)}, {"status", shown(r.Status)}, {"event_id", shown(r.EventID)}, {"event_type", strconv.Quote(r.EventType)},
				{"ordering_key", strconv.Quote(r.OrderingKey)}, {"attempts", strconv.Itoa(r.Attempts)},
				{"created_at", r.CreatedAt.UTC().Format(time.RFC3339Nano)}, {"available_at", r.AvailableAt.UTC().Format(time.RFC3339Nano)},
				{"processed_at", r.ProcessedAt.UTC().Format(time.RFC3339Nano)}, {"last_error", shown(r.LastError)}, {"headers", shown(r.Headers)},
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
			Example: fmt.Sprintf(`  outbox-relay dead-letters %[1]s 42 43 --database-path app.db
  outbox-relay dead-letters %[1]s --all --type OrderPlaced --since 24h --dry-run
  outbox-relay dead-letters %[1]s --all --error "permissions violation"`, name),
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
	for _, sub := range []*cobra.Command{list, show, retry, discard} {
		cmd.AddCommand(c.withConfig(sub, databaseKeys))
	}
	return cmd
}
