package main

import (
	"context"
	"encoding/json"
	"io"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/bench"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

func (c *cli) benchCommand() *cobra.Command {
	var o bench.Options
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure the relay against the raw JetStream publish ceiling on the same server",
		Long: `bench measures, in one run on one server (an embedded one unless --nats-url):
  the ceiling: async JetStream publishing of the messages the relay would
    publish for --rows rows of --size bytes (Nats-Msg-Id and the other
    headers), the best of several in-flight limits;
  drain: the relay (this binary's "run", a child process, default
    configuration) draining a fresh table of --rows pending rows to done:
    rows/s, ratio to the ceiling, lag percentiles, CPU seconds, peak RSS;
  with --keys K: the same drain again, on a fresh table and stream, with K
    ordering keys round robin (row i gets key i mod K): rows/s and the
    ratio to the unordered drain; the stream is read back, and the bench
    fails unless each key's messages are in row id order; then the
    standard client (nats.go) publishing min(--rows, 20000) such messages
    alone, one at a time, awaiting each PubAck, in a process of its own:
    msgs/s, and the keyed drain's rate over it;
  with --group N: the same drain again, on a fresh table and stream, with
    every N consecutive rows in one atomic group (seeded by one INSERT):
    rows/s and the ratio to the unordered drain; the stream is read back,
    and the bench fails unless each group is whole in it, in consecutive
    sequences of one atomic batch (one Nats-Batch-Id);
  settle writes: the same drain of min(--rows, 2000) rows, on a fresh table
    and stream, while the bench holds a read transaction open on the file
    (so that no checkpoint can copy or restart the WAL): the bytes the WAL
    grew by per row settled;
  with --done-rows N: the same drain with N done rows in the table too;
  with --rate R: a writer inserting R rows/s for --duration while the relay
    runs: commit-to-PubAck and commit-to-done lag percentiles (the writer
    checkpoints as an application does by default, every 1000 WAL pages;
    --writer-autocheckpoint changes that), the relay's CPU, and two
    baselines: the writer with no relay, and the standard client (nats.go)
    publishing R messages/s alone, awaiting each PubAck, in a process of its
    own: its CPU is the floor of any relay's at that rate;
  with --idle D: the relay's CPU over D on an empty table, connected;
  with --fleet N, instead of all the above: one relay serving N database
    files (database.path a glob, subjects {tenant}.{event_type}), each
    figure beside a single-file relay of the same run: its CPU over --idle
    (30s unless set) with every file idle, and its peak RSS; 50 of the
    files each written 20 single-row transactions a second for --duration:
    commit-to-PubAck lag and CPU, against one file written at the total
    rate; a backlog of --rows rows in one file, and --rows spread over 100
    files (each file's time to done, max over mean), against one file's
    relay draining --rows (each backlog seeded with the relay stopped, so
    that it appears at once); new files moved into and created in the
    directory, each with one row: commit to PubAck.
With --config, the bench's connection and every process it starts read the
same file (credentials, TLS, and the children's relay settings). With
--delete-done, every relay child runs with retention.done_rows: delete, and
the --done-rows are seeded as records in the table's records table.`,
		Example: `  outbox-relay bench --rows 50000 --ceiling-in-flight 1000
  outbox-relay bench --done-rows 1000000 --rate 1000 --duration 30s --idle 60s
  outbox-relay bench --rows 20000 --group 10 --json
  outbox-relay bench --keys 1000 --nats-url nats://nats:4222 --config /etc/outbox-relay.yaml --json
  outbox-relay bench --rows 3000 --size 65536 --delete-done
  outbox-relay bench --fleet 1000 --rows 200000 --duration 30s --idle 30s`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if o.Rows < 1 || o.Size < 0 || o.Rate < 0 || o.DoneRows < 0 || o.Keys < 0 || o.WriterCheckpoint < 0 || o.Fleet < 0 {
				return usagef("bench: --rows must be positive; --size, --rate, --done-rows, --keys, --writer-autocheckpoint, --fleet not negative")
			}
			if o.Group < 0 || o.Group > publish.MaxBatch {
				return usagef("bench: --group must be between 0 and %d (the most rows an atomic batch holds)", publish.MaxBatch)
			}
			cfg, err := c.loadConfig()
			if err != nil {
				return err
			}
			o.NATS, o.ConfigFile = daemon.ConnectOptions(cfg.NATS, "outbox-relay-bench"), c.configFile
			if !asJSON {
				o.Progress = c.stderr
			}
			rep, err := bench.Run(o)
			if err != nil {
				return err
			}
			return c.output(asJSON, rep, func(w io.Writer) { bench.Print(w, rep) })
		},
	}
	benchFlags(cmd.Flags(), &o)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

// benchFlags binds bench's flags to o.
func benchFlags(f *pflag.FlagSet, o *bench.Options) {
	f.IntVar(&o.Rows, "rows", 200_000, "rows (and ceiling messages) per measurement")
	f.IntVar(&o.Size, "size", 256, "payload bytes")
	f.IntVar(&o.DoneRows, "done-rows", 0, "also drain with this many done rows in the table, and compare")
	f.BoolVar(&o.DeleteDone, "delete-done", false, "run the relay children with retention.done_rows: delete (settled rows deleted, recorded in the table's records table)")
	f.IntVar(&o.Keys, "keys", 0, "also drain with this many ordering keys round robin, check each key's order, and compare (0: not)")
	f.IntVar(&o.Group, "group", 0, "also drain with every this many consecutive rows in one atomic group, check each group is stored whole, and compare (0: not)")
	f.IntVar(&o.Rate, "rate", 0, "also measure lag with a writer inserting this many rows/s")
	f.DurationVar(&o.Duration, "duration", 30*time.Second, "how long the --rate writer writes")
	f.IntVar(&o.WriterCheckpoint, "writer-autocheckpoint", 1000, "the --rate writer's PRAGMA wal_autocheckpoint (SQLite's default 1000; 0 leaves checkpoints to the relay)")
	f.IntVar(&o.Reconcile, "reconcile", 0, "also start a relay on a backup taken before this many rows were published, and measure how fast it finds them in the stream (0: not)")
	f.DurationVar(&o.Idle, "idle", 0, "also measure the relay's CPU while idle for this long (e.g. 60s)")
	f.IntVar(&o.Fleet, "fleet", 0, "measure a fleet of this many database files (e.g. 1000) against single-file relays instead (0: not)")
	f.StringVar(&o.NATSURL, "nats-url", "", "use this server instead of an embedded one")
	f.StringVar(&o.Dir, "dir", "", "work directory (default: a new temporary directory, removed after)")
	f.IntSliceVar(&o.CeilingBatches, "ceiling-in-flight", []int{500, 1000, 2000, 4000}, "in-flight limits the ceiling is measured with")
}

// benchClientCommand is the hidden child of bench that measures the
// standard client's cost at a trickle (bench.Client), or with --messages
// its rate one PubAck at a time (bench.SyncClient), and prints a
// bench.ClientRun as JSON.
func (c *cli) benchClientCommand() *cobra.Command {
	var url, subject string
	var rate, size, messages int
	var d time.Duration
	cmd := &cobra.Command{
		Use:    "bench-client",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if messages < 0 {
				return usagef("bench-client: --messages must not be negative")
			}
			cfg, err := c.loadConfig() // credentials and TLS, as the relay gets them
			if err != nil {
				return err
			}
			natsOpts := daemon.ConnectOptions(cfg.NATS, "outbox-relay-bench-client")
			natsOpts.URLs = url
			conn, err := publish.ConnectOnce(context.Background(), natsOpts, zap.NewNop())
			if err != nil {
				return err
			}
			defer conn.Close()
			var run *bench.ClientRun
			if messages > 0 {
				run, err = bench.SyncClient(conn.NC, subject, messages, size)
			} else {
				run, err = bench.Client(conn.NC, subject, rate, size, d)
			}
			if err != nil {
				return err
			}
			return json.NewEncoder(c.stdout).Encode(run)
		},
	}
	f := cmd.Flags()
	f.StringVar(&url, "url", "", "server")
	f.StringVar(&subject, "subject", "", "subject a stream captures")
	f.IntVar(&rate, "rate", 100, "messages per second")
	f.IntVar(&size, "size", 256, "payload bytes")
	f.DurationVar(&d, "duration", 10*time.Second, "how long to publish")
	f.IntVar(&messages, "messages", 0, "publish this many messages as fast as one PubAck at a time allows, instead of --rate for --duration (0: not)")
	return cmd
}
