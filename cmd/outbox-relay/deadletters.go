package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

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
	retry := c.deadLettersBulkCommand("retry", "Requeue dead-lettered rows: pending, attempts 0, available now (last_error kept until the next attempt)", "requeued", admin.Requeue)
	discard := c.deadLettersBulkCommand("discard", "Delete dead-lettered rows", "discarded", admin.Discard)
	for _, sub := range []*cobra.Command{c.deadLettersListCommand(), c.deadLettersShowCommand(), retry, discard} {
		cmd.AddCommand(c.withConfig(c.withDB(sub), databaseKeys))
	}
	return cmd
}

func (c *cli) deadLettersListCommand() *cobra.Command {
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
			if consumer && lf != (filterFlags{}) {
				return usagef("dead-letters list --consumer lists what the consumer gave up on, which --type, --since, --until and --error do not filter: drop them, or --consumer")
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
				return c.listExhausted(ctx, s, limit, asJSON)
			}
			dls, err := admin.DeadLetters(ctx, s, f, limit)
			if err != nil {
				return err
			}
			return c.output(asJSON, dls, func(w io.Writer) { admin.PrintDeadLetters(w, dls) })
		},
	}
	list.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	list.Flags().IntVar(&limit, "limit", 50, "at most this many rows")
	list.Flags().BoolVar(&consumer, "consumer", false, "list what the durable consumer gave up on (max-deliveries advisories)")
	lf.bind(list.Flags())
	return list
}

// listExhausted is dead-letters list --consumer.
func (c *cli) listExhausted(ctx context.Context, s *sqlitedb.DB, limit int, asJSON bool) error {
	ex, err := admin.ExhaustedMessages(ctx, s, limit)
	if err != nil {
		return err
	}
	if asJSON {
		return printJSON(c.stdout, ex)
	}
	return admin.PrintExhausted(c.stdout, ex)
}

func (c *cli) deadLettersShowCommand() *cobra.Command {
	var asJSON bool
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
			if maxBytes < -1 {
				return usagef("dead-letters show: --max-bytes must be -1 (all of the payload) or more")
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
			row := admin.ShowRow(r, maxBytes)
			return c.output(asJSON, row, row.Print)
		},
	}
	show.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	show.Flags().IntVar(&maxBytes, "max-bytes", 4096, "show at most this many bytes of the payload (-1: all)")
	return show
}

// deadLettersBulkCommand is retry or discard (name), which apply op to the
// dead letters selected; did is what the output says op did.
func (c *cli) deadLettersBulkCommand(name, short, did string, op func(context.Context, *sqlitedb.DB, admin.Selection, bool) (admin.Bulk, error)) *cobra.Command {
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
			return c.output(asJSON, b, func(w io.Writer) { b.Print(w, name, did, sel, dryRun) })
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "every dead-lettered row the filters take")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "count the rows, change nothing")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	ff.bind(cmd.Flags())
	return cmd
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
		t, ok := admin.ParseWhen(w.val, now)
		if !ok {
			return out, usagef("dead-letters: %s %q is neither a duration (24h) nor an RFC 3339 time", w.name, w.val)
		}
		*w.into = t
	}
	return out, nil
}

// selection reads the ids of retry and discard and --all.
func selection(cmd string, all bool, args []string, f admin.Filter) (admin.Selection, error) {
	if all == (len(args) > 0) {
		return admin.Selection{}, usagef("dead-letters %s: give --all or row ids, not both or neither", cmd)
	}
	ids := make([]int64, len(args))
	for i, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil {
			return admin.Selection{}, usagef("dead-letters %s: %q is not a row id", cmd, a)
		}
		ids[i] = id
	}
	return admin.Select(all, ids, f), nil
}
