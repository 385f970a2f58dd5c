// Package bench measures the relay the way its users run it: the relay
// (this binary's run command) as a child process against a JetStream
// server, beside the standard client's ceiling, a writer that commits as
// an application does, and the standard client publishing alone, at the
// same rate or one PubAck at a time. It is the bench command's engine;
// nothing in the relay depends on it.
package bench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Options are the bench command's flags.
type Options struct {
	Rows, Size, DoneRows, Rate int
	// Keys > 0 drains the --rows again with that many ordering keys, round
	// robin, and checks each key's order in the stream.
	Keys int
	// Group > 0 drains the --rows again with every Group consecutive rows
	// in one atomic group, and checks that each group is stored whole.
	Group            int
	WriterCheckpoint int // the rate writer's PRAGMA wal_autocheckpoint
	Duration, Idle   time.Duration
	NATSURL, Dir     string
	CeilingBatches   []int
	// NATS holds the name, credentials and TLS settings of the bench's own
	// connection (its URLs are the bench's server); ConfigFile (when set)
	// is passed to every child process, which reads the same settings from
	// it.
	NATS       publish.ConnectOptions
	ConfigFile string
	// DeleteDone runs every relay child with retention.done_rows: delete
	// (settling a row deletes it and records it in the outbox table's
	// records table), and seeds the --done-rows as such records.
	DeleteDone bool
	// Reconcile > 0 measures a relay started on a backup taken before that
	// many rows were published: it finds them in the stream.
	Reconcile int
	// Fleet > 0 measures a fleet of that many database files (one relay
	// serving a glob) instead, each figure against a single-file relay
	// measured in the same run (see benchFleet).
	Fleet int
	// Progress receives a line per measurement as it completes.
	Progress io.Writer
}

// RelayRun is what one run of the relay (a child process) measured.
type RelayRun struct {
	Rows       int     `json:"rows"`
	DoneRows   int     `json:"done_rows_before"`
	Seconds    float64 `json:"seconds"`
	RowsPerSec float64 `json:"rows_per_second"`
	LagP50Ms   float64 `json:"lag_p50_ms"`
	LagP99Ms   float64 `json:"lag_p99_ms"`
	LagMaxMs   float64 `json:"lag_max_ms"`
	CPUSeconds float64 `json:"cpu_seconds"`
	Memory
	OfferedRate int `json:"offered_rate,omitempty"`
	// The --rate writer's PRAGMA wal_autocheckpoint.
	WriterAutocheckpoint *int `json:"writer_autocheckpoint,omitempty"`
	// Commit-to-PubAck lag (--rate runs): each message's store time in the
	// stream (the server acknowledges right after storing) minus its
	// Outbox-Created-At; the lag above runs to processed_at, after the
	// settlement's transaction.
	AckLagRows  int     `json:"ack_lag_rows,omitempty"` // messages read from the stream
	AckLagP50Ms float64 `json:"ack_lag_p50_ms,omitempty"`
	AckLagP99Ms float64 `json:"ack_lag_p99_ms,omitempty"`
	AckLagMaxMs float64 `json:"ack_lag_max_ms,omitempty"`
	// The --rate writer's rows, from when each was due to the end of its
	// COMMIT (lock waits, its own checkpoints and catching up after them
	// included), in µs: what the application feels of the relay.
	WriterP50Us float64 `json:"writer_tx_p50_us,omitempty"`
	WriterP99Us float64 `json:"writer_tx_p99_us,omitempty"`
	WriterMaxUs float64 `json:"writer_tx_max_us,omitempty"`
	// The relay's CPU while the --rate writer wrote, in % of one core.
	CPUPercent float64 `json:"cpu_percent_of_one_core,omitempty"`
	// The check of a drain with ordering keys: how many messages the
	// stream held, of how many keys, each key's in row id order.
	OrderCheckedMessages int `json:"order_checked_messages,omitempty"`
	OrderCheckedKeys     int `json:"order_checked_keys,omitempty"`
	// The check of a drain with atomic groups: how many messages the
	// stream held, of how many groups, each group's in consecutive
	// sequences of one atomic batch.
	GroupCheckedMessages int `json:"group_checked_messages,omitempty"`
	GroupCheckedGroups   int `json:"group_checked_groups,omitempty"`
	// The drain with the WAL pinned (see drain.pinWAL): how many bytes
	// the WAL grew by, in frames of the page size + 24 bytes.
	WALBytes    int64 `json:"wal_bytes,omitempty"`
	WALPageSize int   `json:"wal_page_size,omitempty"`

	// groups is the atomic_group of each seeded row, by id, read before
	// the relay started (the records of deleted rows keep none).
	groups map[int64]string
}

// WriterRun is the --rate writer alone, with no relay running: the
// baseline of what the application feels.
type WriterRun struct {
	Rows        int     `json:"rows"`
	WriterP50Us float64 `json:"writer_tx_p50_us"`
	WriterP99Us float64 `json:"writer_tx_p99_us"`
	WriterMaxUs float64 `json:"writer_tx_max_us"`
}

// Report is the bench command's result.
type Report struct {
	Machine      string `json:"machine"`
	Rows         int    `json:"rows"`
	PayloadBytes int    `json:"payload_bytes"`
	// DoneRowsMode is the relay children's retention.done_rows when
	// --delete-done set it ("delete"); empty for the default.
	DoneRowsMode   string             `json:"retention_done_rows,omitempty"`
	CeilingByBatch map[string]float64 `json:"ceiling_by_batch,omitempty"`
	Ceiling        float64            `json:"ceiling_rows_per_second,omitempty"`
	Drain          *RelayRun          `json:"drain,omitempty"`
	DrainRatio     float64            `json:"drain_to_ceiling,omitempty"`
	// With --keys: the same drain with that many ordering keys, and its
	// rate over the unordered drain's.
	Keys       int       `json:"keys,omitempty"`
	KeyedDrain *RelayRun `json:"keyed_drain,omitempty"`
	KeyedRatio float64   `json:"keyed_to_unordered,omitempty"`
	// With --keys, right after the keyed drain: the standard client
	// publishing min(--rows, syncMessages) messages one at a time, each
	// PubAck awaited (SyncClient), its msgs/s, and the keyed drain's rate
	// over it.
	SyncClientRun *ClientRun `json:"sync_client,omitempty"`
	SyncClient    float64    `json:"sync_client_msgs_per_second,omitempty"`
	KeyedToSync   float64    `json:"keyed_to_sync_publish,omitempty"`
	// With --group N: the same drain with every N consecutive rows in one
	// atomic group, and its rate over the unordered drain's.
	Group        int       `json:"group,omitempty"`
	GroupedDrain *RelayRun `json:"grouped_drain,omitempty"`
	GroupedRatio float64   `json:"grouped_to_unordered,omitempty"`
	// What the relay's writes add to the WAL per settled row, measured
	// on a drain of min(--rows, walRows) rows with a reader pinning the
	// WAL (SettleWAL, whose rate and lag are not comparable to the
	// drain's).
	WALBytesPerRow float64    `json:"wal_bytes_per_row,omitempty"`
	SettleWAL      *RelayRun  `json:"settle_wal,omitempty"`
	DrainWithDone  *RelayRun  `json:"drain_with_done,omitempty"`
	DoneRatio      float64    `json:"with_done_to_empty,omitempty"`
	Rate           *RelayRun  `json:"rate,omitempty"`
	WriterAlone    *WriterRun `json:"writer_alone,omitempty"`
	// The writer's lateness p99 with the relay over the same without it.
	WriterP99Ratio float64 `json:"writer_p99_with_relay_to_alone,omitempty"`
	// The standard client publishing --rate messages/s alone, awaiting
	// each PubAck, and the relay's CPU at that rate over the client's.
	Client         *ClientRun `json:"standard_client,omitempty"`
	CPUToClient    float64    `json:"relay_cpu_to_standard_client,omitempty"`
	IdleCPUPercent *float64   `json:"idle_cpu_percent_of_one_core,omitempty"`
	// With --reconcile N: the relay on a restored backup.
	Reconcile   *ReconcileRun `json:"reconcile,omitempty"`
	IdleSeconds float64       `json:"idle_seconds,omitempty"`
	// With --fleet N: a fleet of N files and its single-file yardsticks;
	// nothing else is measured then.
	Fleet *FleetReport `json:"fleet,omitempty"`
}

// Run measures what o asks for and returns the report.
func Run(o Options) (*Report, error) {
	return (&bench{o: o}).run()
}

// run measures what b.o asks for and returns the report.
func (b *bench) run() (*Report, error) {
	o := b.o
	ctx := context.Background()
	log := zap.NewNop()
	dir := o.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "outbox-relay-bench-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	url := o.NATSURL
	if url == "" {
		srv, err := publish.StartEmbedded("127.0.0.1:0", filepath.Join(dir, "nats"))
		if err != nil {
			return nil, err
		}
		defer srv.Shutdown()
		url = srv.URL()
	}
	// Credentials and TLS come from the configuration (file, environment,
	// flags), as the relay children get them.
	natsOpts := o.NATS
	natsOpts.URLs = url
	conn, err := publish.ConnectOnce(ctx, natsOpts, log)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	js, err := publish.NewJetStream(conn, "EVENTS", 1, time.Minute)
	if err != nil {
		return nil, err
	}
	// Streams and subjects of the bench's own, so that a bench against a
	// real server (--nats-url) never touches its streams; removed after.
	tag := strings.ToUpper(strings.ReplaceAll(event.NewID()[:8], "-", ""))
	prefix := "outbox_relay_bench_" + strings.ToLower(tag)
	// Every measurement gets a stream of its own, and the one before it is
	// deleted first (their subjects may overlap).
	var current string
	stream := func(name, subjects string) (benchNames, error) {
		next := "OUTBOX_RELAY_BENCH_" + tag + "_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
		if err := benchkit.ReplaceStream(ctx, js.API(), current, next, []string{subjects}, time.Hour); err != nil {
			return benchNames{}, err
		}
		current = next
		return benchNames{stream: next, prefix: prefix}, nil
	}
	defer func() {
		if current != "" {
			js.API().DeleteStream(context.Background(), current)
		}
	}()
	rep := &Report{Machine: machine(), Rows: o.Rows, PayloadBytes: o.Size, CeilingByBatch: map[string]float64{}}
	if o.DeleteDone {
		rep.DoneRowsMode = config.DoneRowsDelete
	}
	progress := func(format string, args ...any) {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, format+"\n", args...)
		}
	}

	if o.Fleet > 0 {
		// The fleet's yardsticks are single-file relays of its own run:
		// the ceiling and the drains above would only add minutes.
		rep.CeilingByBatch = nil
		if rep.Fleet, err = b.benchFleet(ctx, dir, url, js.API(), prefix, stream, progress); err != nil {
			return nil, err
		}
		return rep, nil
	}
	for _, inFlight := range o.CeilingBatches {
		if _, err := stream(fmt.Sprintf("ceiling-%d", inFlight), prefix+"_ceiling.>"); err != nil {
			return nil, err
		}
		d, err := benchkit.Ceiling(ctx, conn.NC, prefix+"_ceiling.BenchEvent", o.Rows, o.Size, inFlight)
		if err != nil {
			return nil, fmt.Errorf("ceiling with %d in flight: %w", inFlight, err)
		}
		r := float64(o.Rows) / d.Seconds()
		rep.CeilingByBatch[strconv.Itoa(inFlight)] = r
		rep.Ceiling = max(rep.Ceiling, r)
		progress("ceiling, %d in flight: %.0f msgs/s", inFlight, r)
	}

	run := func(name string, d drain) (*RelayRun, error) {
		names, err := stream(name, prefix+".>")
		if err != nil {
			return nil, err
		}
		path := filepath.Join(dir, name+".db")
		r, err := b.benchRelay(ctx, path, url, names, d)
		if err == nil && d.rate > 0 {
			var lags []int64
			if lags, err = storedLags(ctx, js.API(), names.stream, time.Time{}); err == nil {
				r.AckLagRows = len(lags)
				r.AckLagP50Ms, r.AckLagP99Ms, r.AckLagMaxMs = spread(lags)
				progress("%s: commit to PubAck p50 %.1f ms p99 %.1f ms max %.1f ms", name, r.AckLagP50Ms, r.AckLagP99Ms, r.AckLagMaxMs)
			}
		}
		if err == nil && d.keys > 0 {
			if r.OrderCheckedMessages, r.OrderCheckedKeys, err = checkKeyOrder(ctx, js.API(), names.stream, path); err != nil {
				err = fmt.Errorf("%s: %w", name, err)
			} else {
				progress("%s: each key's messages in row id order (%d messages, %d keys)", name, r.OrderCheckedMessages, r.OrderCheckedKeys)
			}
		}
		if err == nil && d.group > 0 {
			if r.GroupCheckedMessages, r.GroupCheckedGroups, err = checkGroups(ctx, js.API(), names.stream, path, r.groups); err != nil {
				err = fmt.Errorf("%s: %w", name, err)
			} else {
				progress("%s: each group whole, in consecutive sequences of one atomic batch (%d messages, %d groups)", name, r.GroupCheckedMessages, r.GroupCheckedGroups)
			}
		}
		if err == nil {
			progress("%s: %.0f rows/s, lag p50 %.1f ms p99 %.1f ms, CPU %.2f s, %s", name, r.RowsPerSec, r.LagP50Ms, r.LagP99Ms, r.CPUSeconds, r.Memory)
		}
		return r, err
	}
	if rep.Drain, err = run("drain", drain{rows: o.Rows}); err != nil {
		return nil, err
	}
	rep.DrainRatio = rep.Drain.RowsPerSec / rep.Ceiling
	if o.Keys > 0 {
		// Right after the unordered drain, for a ratio within one run.
		rep.Keys = o.Keys
		if rep.KeyedDrain, err = run("drain-keyed", drain{rows: o.Rows, keys: o.Keys}); err != nil {
			return nil, err
		}
		rep.KeyedRatio = rep.KeyedDrain.RowsPerSec / rep.Drain.RowsPerSec
		// Right after the keyed drain, for a ratio within one run too.
		names, err := stream("sync-client", prefix+".>")
		if err != nil {
			return nil, err
		}
		if rep.SyncClientRun, err = b.benchSyncClient(url, names.prefix+".BenchEvent", min(o.Rows, syncMessages), o.Size); err != nil {
			return nil, err
		}
		rep.SyncClient = rep.SyncClientRun.MsgsPerSec
		rep.KeyedToSync = rep.KeyedDrain.RowsPerSec / rep.SyncClient
		progress("standard client, one PubAck awaited at a time: %.0f msgs/s (%d messages), CPU %.1f%% of one core; keyed / sync %.2f",
			rep.SyncClient, rep.SyncClientRun.Messages, rep.SyncClientRun.CPUPercent, rep.KeyedToSync)
	}
	if o.Group > 0 {
		rep.Group = o.Group
		if rep.GroupedDrain, err = run("drain-grouped", drain{rows: o.Rows, group: o.Group}); err != nil {
			return nil, err
		}
		rep.GroupedRatio = rep.GroupedDrain.RowsPerSec / rep.Drain.RowsPerSec
	}
	if rep.SettleWAL, err = run("settle-wal", drain{rows: min(o.Rows, walRows), pinWAL: true}); err != nil {
		return nil, err
	}
	rep.WALBytesPerRow = float64(rep.SettleWAL.WALBytes) / float64(rep.SettleWAL.Rows)
	progress("settle-wal: %s B of WAL per row (%d rows, pages of %d B)", thousands(rep.WALBytesPerRow), rep.SettleWAL.Rows, rep.SettleWAL.WALPageSize)
	if o.DoneRows > 0 {
		if rep.DrainWithDone, err = run("drain-with-done", drain{rows: o.Rows, done: o.DoneRows}); err != nil {
			return nil, err
		}
		rep.DoneRatio = rep.DrainWithDone.RowsPerSec / rep.Drain.RowsPerSec
	}
	if o.Rate > 0 {
		// The same writer with no relay first: the yardstick for what the
		// relay costs the application.
		alone, err := writerAlone(ctx, filepath.Join(dir, "writer-alone.db"), o)
		if err != nil {
			return nil, err
		}
		rep.WriterAlone = alone
		progress("writer alone: %d rows, lateness p50 %.2f ms p99 %.2f ms", alone.Rows, alone.WriterP50Us/1000, alone.WriterP99Us/1000)
		if rep.Rate, err = run("rate", drain{rate: o.Rate}); err != nil {
			return nil, err
		}
		rep.WriterP99Ratio = rep.Rate.WriterP99Us / max(1, alone.WriterP99Us)
		progress("rate: relay CPU %.1f%% of one core; writer lateness p99 %.2f x alone", rep.Rate.CPUPercent, rep.WriterP99Ratio)
		names, err := stream("client", prefix+".>")
		if err != nil {
			return nil, err
		}
		if rep.Client, err = b.benchClient(url, names.prefix+".Client", o.Rate, o.Size, o.Duration); err != nil {
			return nil, err
		}
		rep.CPUToClient = rep.Rate.CPUPercent / max(0.01, rep.Client.CPUPercent)
		progress("standard client alone: %.1f%% of one core at %d msgs/s; relay / client %.1f", rep.Client.CPUPercent, o.Rate, rep.CPUToClient)
	}
	if o.Reconcile > 0 {
		names, err := stream("reconcile", prefix+".>")
		if err != nil {
			return nil, err
		}
		if rep.Reconcile, err = b.benchReconcile(ctx, dir, url, names, js.API(), o.Reconcile); err != nil {
			return nil, err
		}
		r := rep.Reconcile
		progress("reconcile: %d of %d rows found in the stream in %.2f s, %.0f rows/s, %s, stream holds %d messages",
			r.Settled, r.Rows, r.Seconds, r.RowsPerSec, r.Memory, r.StreamMessages)
	}
	if o.Idle > 0 {
		names, err := stream("idle", prefix+".>")
		if err != nil {
			return nil, err
		}
		pct, err := b.benchIdle(ctx, filepath.Join(dir, "idle.db"), url, names, o.Idle)
		if err != nil {
			return nil, err
		}
		rep.IdleCPUPercent, rep.IdleSeconds = &pct, o.Idle.Seconds()
		progress("idle: %.2f%% of one core over %v", pct, o.Idle)
	}
	return rep, nil
}

// benchNames are the stream and subject prefix of a relay child.
type benchNames struct{ stream, prefix string }

// relayStartTimeout is how long a relay child may take to log "relay
// starting".
const relayStartTimeout = 30 * time.Second

// relayStopTimeout bounds a relay child's exit after SIGTERM: its
// shutdown (relay.shutdown_timeout, 10 s by default, then a few seconds of
// writes) with room to spare. A child still running then is killed.
const relayStopTimeout = time.Minute

// startChild runs this binary's "run" on path against url with the default
// configuration, or the bench's --config file (credentials and TLS, and any
// relay settings in it), metrics off, info level (which logs "relay
// starting"), and returns once it has started (startRelay).
func (b *bench) startChild(path, url string, names benchNames) (*child.Process, time.Time, error) {
	cmd, err := b.childCommand(path, url, names)
	if err != nil {
		return nil, time.Time{}, err
	}
	return startRelay(cmd)
}

// childCommand is the command startChild runs, not yet started.
func (b *bench) childCommand(path, url string, names benchNames) (*exec.Cmd, error) {
	self, err := b.executable()
	if err != nil {
		return nil, err
	}
	// Metrics off, or the child would take :9108 and fail where something
	// has it; the flag wins over whatever the environment says.
	cmd := exec.Command(self, append(b.configArgs(), "run", "--metrics-listen", "")...)
	cmd.Env = append(os.Environ(),
		config.EnvName("database.path")+"="+path,
		config.EnvName("nats.url")+"="+url,
		config.EnvName("stream.name")+"="+names.stream,
		config.EnvName("stream.subjects")+"="+names.prefix+".>",
		config.EnvName("stream.subject_prefix")+"="+names.prefix,
		config.EnvName("log.level")+"=info",
	)
	if b.o.DeleteDone {
		cmd.Env = append(cmd.Env, config.EnvName("retention.done_rows")+"="+config.DoneRowsDelete)
	}
	return cmd, nil
}

// startRelay starts a relay child and waits for its "relay starting" line
// (in the log format its configuration chose), returning when that came.
// A child that exits first, or does not start within relayStartTimeout,
// is an error with its last log lines, and is not left running.
func startRelay(cmd *exec.Cmd) (*child.Process, time.Time, error) {
	return startRelayLogging(cmd, "relay starting")
}

// startRelayLogging is startRelay waiting for the line msg instead.
func startRelayLogging(cmd *exec.Cmd, msg string) (*child.Process, time.Time, error) {
	ch, err := child.Start(cmd)
	if err != nil {
		return nil, time.Time{}, err
	}
	line, err := ch.WaitFor(msg, relayStartTimeout)
	if err != nil {
		ch.Kill()
		return nil, time.Time{}, fmt.Errorf("the relay %w", err)
	}
	return ch, line.At, nil
}

// Memory is a relay child's memory, read just before it exits.
type Memory struct {
	// PeakRSSMiB is the kernel's high-water mark of the relay's own image
	// (VmHWM): rusage's maxrss would also count the bench process's
	// memory that the child shared between fork and exec.
	PeakRSSMiB float64 `json:"peak_rss_mib"`
	// MappedFilesMiB is the part of the RSS that is pages of mapped files
	// (RssFile: the program's code and data, its libraries). It is set at
	// start by how much of the program's file the page cache holds, not
	// by the relay's work: a binary just built or copied is all in it.
	MappedFilesMiB float64 `json:"mapped_files_mib"`
}

// String is the peak, and the mapped files' part of it.
func (m Memory) String() string {
	return fmt.Sprintf("peak RSS %.1f MiB (mapped files %.1f)", m.PeakRSSMiB, m.MappedFilesMiB)
}

// stopRelay ends a relay child with SIGTERM and returns its CPU seconds and
// its memory.
func stopRelay(ch *child.Process) (cpu float64, mem Memory, err error) {
	mem, memErr := procMemory(ch.Pid())
	if err := ch.Stop(syscall.SIGTERM, relayStopTimeout); err != nil {
		return 0, mem, fmt.Errorf("relay: %w", err)
	}
	if memErr != nil {
		return 0, mem, fmt.Errorf("relay's peak RSS: %w", memErr)
	}
	ru, ok := ch.State().SysUsage().(*syscall.Rusage)
	if !ok {
		return 0, mem, errors.New("no resource usage for the relay")
	}
	cpu = time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	return cpu, mem, nil
}

// procMemory reads a process's peak and mapped files' resident set sizes
// from /proc.
func procMemory(pid int) (Memory, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Memory{}, err
	}
	var m Memory
	for _, f := range []struct {
		name string
		to   *float64
	}{{"VmHWM:", &m.PeakRSSMiB}, {"RssFile:", &m.MappedFilesMiB}} {
		kb, err := statusKB(string(raw), f.name)
		if err != nil {
			return m, fmt.Errorf("/proc/%d/status: %w", pid, err)
		}
		*f.to = kb / 1024
	}
	return m, nil
}

// statusKB returns the figure, in kB, of the field name ("VmHWM:") of a
// /proc status file, whose first line is never one of them.
func statusKB(status, name string) (float64, error) {
	_, rest, ok := strings.Cut(status, "\n"+name)
	if !ok {
		return 0, fmt.Errorf("no %s", name)
	}
	line, _, _ := strings.Cut(rest, "\n")
	kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(line), " kB"), 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s %q: %w", name, line, err)
	}
	return kb, nil
}

// drain is what one relay run prepares: rows pending (with rate > 0, a
// writer inserting rate rows/s for --duration instead), after done rows
// that are done already, with keys ordering keys round robin (0: none),
// every group consecutive rows in one atomic group (0: none). With pinWAL
// a reader holds the WAL (benchkit.PinWAL) from before the relay starts
// until it has stopped, and the run measures how much the WAL grew by
// until the rows were settled.
type drain struct {
	rows, done, rate, keys, group int
	pinWAL                        bool
}

// syncMessages is the most messages the standard client publishes one
// PubAck at a time: a few seconds at its rate, enough for a steady figure.
const syncMessages = 20_000

// walRows is the most rows the drain with the WAL pinned settles: enough
// for a steady figure, few enough that the WAL it cannot checkpoint stays
// small (about 135 MB for rows of 64 KiB).
const walRows = 2000

// benchRelay prepares a database as d says, runs the relay on it until
// every row is done, and measures.
func (b *bench) benchRelay(ctx context.Context, path, url string, names benchNames, d drain) (*RelayRun, error) {
	o := b.o
	if err := migrateBenchDB(ctx, path); err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		return nil, err
	}
	defer db.Close()
	if err := b.seed(ctx, db, d); err != nil {
		return nil, err
	}
	var groups map[int64]string
	if d.group > 0 {
		if groups, err = benchkit.AtomicGroups(ctx, db, "event_queue"); err != nil {
			return nil, err
		}
	}
	pending, rate := d.rows, d.rate
	if rate > 0 {
		pending = 0
	}
	var pin *benchkit.WALPin
	if d.pinWAL {
		// Closed after the relay has stopped (deferred calls run last
		// first), so that no checkpoint copies the WAL meanwhile.
		if pin, err = benchkit.PinWAL(ctx, path, "event_queue"); err != nil {
			return nil, err
		}
		defer pin.Close()
	}
	ch, start, err := b.startChild(path, url, names)
	if err != nil {
		return nil, err
	}
	res := &RelayRun{Rows: pending, DoneRows: d.done, OfferedRate: rate, groups: groups}
	if rate > 0 {
		res.WriterAutocheckpoint = &o.WriterCheckpoint
		cpuBefore, err := procCPU(ch.Pid())
		if err != nil {
			stopRelay(ch)
			return nil, err
		}
		began := time.Now()
		txs, err := writeRate(ctx, path, rate, o.Duration, o.Size, o.WriterCheckpoint)
		if err != nil {
			stopRelay(ch)
			return nil, err
		}
		cpuAfter, err := procCPU(ch.Pid())
		if err != nil {
			stopRelay(ch)
			return nil, err
		}
		res.CPUPercent = 100 * (cpuAfter - cpuBefore).Seconds() / time.Since(began).Seconds()
		res.Rows = len(txs)
		res.WriterP50Us, res.WriterP99Us, res.WriterMaxUs = spread(txs)
	}
	if err := waitDrained(ctx, db, ch); err != nil {
		stopRelay(ch)
		return nil, err
	}
	if pin != nil {
		if res.WALBytes, err = pin.Grown(); err != nil {
			stopRelay(ch)
			return nil, err
		}
		res.WALPageSize = pin.PageSize()
	}
	last, err := benchkit.LastProcessed(ctx, db, "event_queue")
	if err != nil {
		stopRelay(ch)
		return nil, err
	}
	res.Seconds = last.Sub(start).Seconds()
	res.RowsPerSec = float64(res.Rows) / res.Seconds
	if res.CPUSeconds, res.Memory, err = stopRelay(ch); err != nil {
		return nil, err
	}
	lags, err := benchkit.Lags(ctx, db, "event_queue", int64(d.done)) // the seeded done rows come first
	if err != nil {
		return nil, err
	}
	res.LagP50Ms, res.LagP99Ms, res.LagMaxMs = spread(lags)
	return res, nil
}

// seed writes d's done rows, then (unless d has a writer) its pending
// rows. With --delete-done the done rows become records in the records
// table, as the relay in that mode leaves them, and get no payload (their
// records keep none); their ids still come before the pending rows'.
func (b *bench) seed(ctx context.Context, db *sql.DB, d drain) error {
	if d.done > 0 {
		size := b.o.Size
		if b.o.DeleteDone {
			size = 0
		}
		if err := benchkit.Seed(ctx, db, "event_queue", d.done, size, "done"); err != nil {
			return err
		}
		if b.o.DeleteDone {
			if err := benchkit.MoveDone(ctx, db, "event_queue"); err != nil {
				return err
			}
		}
	}
	if d.rate > 0 {
		return nil
	}
	return benchkit.Seed(ctx, db, "event_queue", d.rows, b.o.Size, "pending", benchkit.Keys(d.keys), benchkit.GroupsOf(d.group))
}

// storedLags reads every message of stream and returns the milliseconds
// from its Outbox-Created-At to its store time in the stream, of the
// messages created at since or later (zero: all).
func storedLags(ctx context.Context, js jetstream.JetStream, stream string, since time.Time) ([]int64, error) {
	var lags []int64
	err := readStream(ctx, js, stream, func(msg jetstream.Msg, meta *jetstream.MsgMetadata) error {
		created, err := time.Parse(time.RFC3339Nano, msg.Headers().Get(publish.HeaderCreatedAt))
		if err != nil {
			return fmt.Errorf("message %d: %s: %w", meta.Sequence.Stream, publish.HeaderCreatedAt, err)
		}
		if created.Before(since) {
			return nil
		}
		lags = append(lags, meta.Timestamp.UnixMilli()-created.UnixMilli())
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read stored times: %w", err)
	}
	return lags, nil
}

// checkKeyOrder reads back the stream a drain with ordering keys filled
// and the table at path it drained, and returns an error unless every row
// is done and the stream holds each row once, with the row's ordering key,
// and each key's messages in row id order (stream sequence increasing with
// row id). It returns how many messages and keys it checked.
func checkKeyOrder(ctx context.Context, js jetstream.JetStream, stream, path string) (msgs, keys int, err error) {
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro&_busy_timeout=5000")
	if err != nil {
		return 0, 0, err
	}
	defer db.Close()
	rowKeys, notDone, err := benchkit.DoneKeys(ctx, db, "event_queue")
	if err != nil {
		return 0, 0, err
	}
	if notDone > 0 {
		return 0, 0, fmt.Errorf("check each key's order: %d of %d rows are not done", notDone, notDone+len(rowKeys))
	}
	// last is, per key, the row and stream sequence of its latest message.
	type at struct {
		row int64
		seq uint64
	}
	last := map[string]at{}
	seen := make(map[int64]bool, len(rowKeys))
	err = readStream(ctx, js, stream, func(msg jetstream.Msg, meta *jetstream.MsgMetadata) error {
		seq := meta.Sequence.Stream
		row, err := strconv.ParseInt(msg.Headers().Get(publish.HeaderRowID), 10, 64)
		if err != nil {
			return fmt.Errorf("message %d: %s: %w", seq, publish.HeaderRowID, err)
		}
		want, ok := rowKeys[row]
		switch {
		case !ok:
			return fmt.Errorf("message %d is row %d, which is not done in the table", seq, row)
		case seen[row]:
			return fmt.Errorf("message %d is row %d, stored before", seq, row)
		}
		seen[row] = true
		key := msg.Headers().Get(publish.HeaderOrderingKey)
		if key != want {
			return fmt.Errorf("message %d (row %d) has %s %q, the row has %q", seq, row, publish.HeaderOrderingKey, key, want)
		}
		if key == "" {
			return nil
		}
		if prev, ok := last[key]; ok && (row < prev.row || seq < prev.seq) {
			return fmt.Errorf("ordering key %q out of order: row %d stored at stream sequence %d, after row %d at sequence %d", key, row, seq, prev.row, prev.seq)
		}
		last[key] = at{row, seq}
		return nil
	})
	if err == nil && len(seen) != len(rowKeys) {
		err = fmt.Errorf("the stream holds %d of the %d rows", len(seen), len(rowKeys))
	}
	if err != nil {
		return 0, 0, fmt.Errorf("check each key's order in the stream: %w", err)
	}
	return len(seen), len(last), nil
}

// checkGroups reads back the stream a drain with atomic groups filled and
// the table at path it drained, and returns an error unless every row is
// done, the stream holds each row once, and each group of groups (the
// atomic_group of each row in one, by id) is whole in it: its rows in id
// order, in consecutive stream sequences, sharing one Nats-Batch-Id that
// no other message carries (a group of one row is published as any row,
// and may have none). It returns how many messages and groups it checked.
func checkGroups(ctx context.Context, js jetstream.JetStream, stream, path string, groups map[int64]string) (msgs, ngroups int, err error) {
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro&_busy_timeout=5000")
	if err != nil {
		return 0, 0, err
	}
	defer db.Close()
	done, notDone, err := benchkit.DoneKeys(ctx, db, "event_queue")
	if err != nil {
		return 0, 0, err
	}
	if notDone > 0 {
		return 0, 0, fmt.Errorf("check each atomic group: %d of %d rows are not done", notDone, notDone+len(done))
	}
	size := map[string]int{}
	for _, g := range groups {
		size[g]++
	}
	// got is, per group, what the stream held of it so far.
	type stored struct {
		batch         string
		rows          int
		lastRow       int64
		firstSeq, seq uint64
	}
	got := map[string]*stored{}
	// The group each batch id was first seen with ("" none): a batch holds
	// whole groups (several may share one) or rows of no group, not both.
	batchGroup := map[string]string{}
	seen := make(map[int64]bool, len(done))
	err = readStream(ctx, js, stream, func(msg jetstream.Msg, meta *jetstream.MsgMetadata) error {
		seq := meta.Sequence.Stream
		row, err := strconv.ParseInt(msg.Headers().Get(publish.HeaderRowID), 10, 64)
		if err != nil {
			return fmt.Errorf("message %d: %s: %w", seq, publish.HeaderRowID, err)
		}
		if _, ok := done[row]; !ok {
			return fmt.Errorf("message %d is row %d, which is not done in the table", seq, row)
		}
		if seen[row] {
			return fmt.Errorf("message %d is row %d, stored before", seq, row)
		}
		seen[row] = true
		g, batch := groups[row], msg.Headers().Get(jetstreamext.BatchIDHeader)
		if batch != "" {
			if other, ok := batchGroup[batch]; ok && (other == "") != (g == "") {
				return fmt.Errorf("message %d (row %d, atomic group %q) has %s %s, as a message of atomic group %q", seq, row, g, jetstreamext.BatchIDHeader, batch, other)
			}
			batchGroup[batch] = g
		}
		if g == "" {
			return nil
		}
		st := got[g]
		if st == nil {
			if batch == "" && size[g] > 1 {
				return fmt.Errorf("message %d (row %d, the first of atomic group %q, of %d rows) was not stored in an atomic batch (no %s)", seq, row, g, size[g], jetstreamext.BatchIDHeader)
			}
			got[g] = &stored{batch: batch, rows: 1, lastRow: row, firstSeq: seq, seq: seq}
			return nil
		}
		switch {
		case batch != st.batch:
			return fmt.Errorf("atomic group %q in two batches: row %d at sequence %d has %s %q, row %d at sequence %d had %q", g, row, seq, jetstreamext.BatchIDHeader, batch, st.lastRow, st.seq, st.batch)
		case seq != st.seq+1:
			return fmt.Errorf("atomic group %q not in consecutive sequences: row %d at sequence %d, its row %d before at sequence %d", g, row, seq, st.lastRow, st.seq)
		case row < st.lastRow:
			return fmt.Errorf("atomic group %q out of row id order: row %d at sequence %d, after row %d", g, row, seq, st.lastRow)
		}
		st.rows, st.lastRow, st.seq = st.rows+1, row, seq
		return nil
	})
	if err == nil && len(seen) != len(done) {
		err = fmt.Errorf("the stream holds %d of the %d rows", len(seen), len(done))
	}
	if err == nil {
		for _, g := range slices.Sorted(maps.Keys(size)) {
			st := got[g]
			if st == nil {
				err = fmt.Errorf("atomic group %q (%d rows) is not in the stream", g, size[g])
				break
			}
			if st.rows != size[g] {
				err = fmt.Errorf("atomic group %q has %d of its %d rows in the stream, at sequences %d to %d", g, st.rows, size[g], st.firstSeq, st.seq)
				break
			}
		}
	}
	if err != nil {
		return 0, 0, fmt.Errorf("check each atomic group in the stream: %w", err)
	}
	return len(seen), len(got), nil
}

// readStream calls fn with every message of stream, in sequence order,
// and its metadata; it stops at fn's first error.
func readStream(ctx context.Context, js jetstream.JetStream, stream string, fn func(jetstream.Msg, *jetstream.MsgMetadata) error) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	total := st.CachedInfo().State.Msgs
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return err
	}
	// Deleted once read, not left to the server's inactivity timeout: a
	// stream that lives on (a fleet's) would carry the consumer through
	// the measurements after, every message published counted for it too.
	defer func() {
		if ci := cons.CachedInfo(); ci != nil {
			st.DeleteConsumer(context.WithoutCancel(ctx), ci.Name)
		}
	}()
	var read uint64
	for empty := 0; read < total; {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return err
		}
		got := read
		for msg := range batch.Messages() {
			meta, err := msg.Metadata()
			if err != nil {
				return err
			}
			if err := fn(msg, meta); err != nil {
				return err
			}
			read++
		}
		if err := batch.Error(); err != nil { // a fetch that ends early is not an error
			return err
		}
		if read == got {
			empty++
		} else {
			empty = 0
		}
		if empty == 3 || ctx.Err() != nil {
			return fmt.Errorf("got %d of the stream's %d messages", read, total)
		}
	}
	return nil
}

// writeRate is the --rate writer: one row per BEGIN IMMEDIATE transaction,
// as an application writes, paced to rate rows/s for d, checkpointing every
// autocheckpoint WAL pages (0: never). It returns, for each row, the µs
// from when it was due (start + n/rate) to the end of its COMMIT: after a
// stall the rows written back to back each count the time they were late.
func writeRate(ctx context.Context, path string, rate int, d time.Duration, size, autocheckpoint int) (txs []int64, err error) {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=10000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		return nil, err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.ExecContext(ctx, fmt.Sprintf(`PRAGMA wal_autocheckpoint = %d`, autocheckpoint)); err != nil {
		return nil, fmt.Errorf("writer: %w", err)
	}
	payload := make([]byte, size)
	start := time.Now()
	for time.Since(start) < d {
		for {
			dueAt := start.Add(time.Duration(len(txs)) * time.Second / time.Duration(rate))
			if time.Now().Before(dueAt) {
				break
			}
			// created_at is taken once the transaction holds the write lock,
			// just before the commit: the lag is commit to done, not the
			// writer's own wait for the lock.
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return txs, fmt.Errorf("writer: %w", err)
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO event_queue (event_id, event_type, payload, created_at) VALUES (?, 'BenchEvent', ?, ?)`,
				event.NewID(), payload, time.Now().UnixMilli()); err != nil {
				tx.Rollback()
				return txs, fmt.Errorf("writer: %w", err)
			}
			if err := tx.Commit(); err != nil {
				return txs, fmt.Errorf("writer: %w", err)
			}
			txs = append(txs, time.Since(dueAt).Microseconds())
		}
		time.Sleep(200 * time.Microsecond)
	}
	return txs, nil
}

// writerAlone runs the --rate writer on a fresh outbox with no relay.
func writerAlone(ctx context.Context, path string, o Options) (*WriterRun, error) {
	if err := migrateBenchDB(ctx, path); err != nil {
		return nil, err
	}
	txs, err := writeRate(ctx, path, o.Rate, o.Duration, o.Size, o.WriterCheckpoint)
	if err != nil {
		return nil, err
	}
	r := &WriterRun{Rows: len(txs)}
	r.WriterP50Us, r.WriterP99Us, r.WriterMaxUs = spread(txs)
	return r, nil
}

// benchIdle measures the relay's CPU while it is connected with nothing to do.
func (b *bench) benchIdle(ctx context.Context, path, url string, names benchNames, d time.Duration) (float64, error) {
	if err := migrateBenchDB(ctx, path); err != nil {
		return 0, err
	}
	ch, _, err := b.startChild(path, url, names)
	if err != nil {
		return 0, err
	}
	time.Sleep(3 * time.Second) // let startup settle
	before, err := procCPU(ch.Pid())
	if err != nil {
		stopRelay(ch)
		return 0, err
	}
	time.Sleep(d)
	after, err := procCPU(ch.Pid())
	stopRelay(ch)
	if err != nil {
		return 0, err
	}
	return 100 * (after - before).Seconds() / d.Seconds(), nil
}

// procCPU reads a process's user+system CPU time from /proc.
func procCPU(pid int) (time.Duration, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name (which may hold spaces) start after ')'.
	fields := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	utime, err1 := strconv.ParseInt(fields[11], 10, 64)
	stime, err2 := strconv.ParseInt(fields[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	const ticks = 100 // USER_HZ on Linux
	return time.Duration(utime+stime) * time.Second / ticks, nil
}

// spread sorts xs and returns its median, 99th percentile and maximum.
func spread(xs []int64) (p50, p99, maxV float64) {
	if len(xs) == 0 {
		return 0, 0, 0
	}
	slices.Sort(xs)
	at := func(p float64) float64 { return float64(xs[int(p*float64(len(xs)-1))]) }
	return at(0.5), at(0.99), at(1)
}

func machine() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s, %d CPUs", host, runtime.NumCPU())
}

// Print writes the report for people.
func Print(w io.Writer, r *Report) {
	if r.Fleet != nil {
		printFleet(w, r)
		return
	}
	fmt.Fprintf(w, "outbox-relay bench: %d rows of %d bytes (%s)\n", r.Rows, r.PayloadBytes, r.Machine)
	if r.DoneRowsMode != "" {
		fmt.Fprintf(w, "  %-27s retention.done_rows: %s (settled rows deleted, recorded in %s)\n", "relay children", r.DoneRowsMode, schema.DoneTable("event_queue"))
	}
	keys := make([]int, 0, len(r.CeilingByBatch))
	for k := range r.CeilingByBatch {
		n, _ := strconv.Atoi(k)
		keys = append(keys, n)
	}
	sort.Ints(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "  ceiling, %4d in flight     %9.0f msgs/s\n", k, r.CeilingByBatch[strconv.Itoa(k)])
	}
	fmt.Fprintf(w, "  ceiling (best)              %9.0f msgs/s\n", r.Ceiling)
	line := func(name string, x *RelayRun) {
		fmt.Fprintf(w, "  %-27s %9.0f rows/s  lag p50 %.1f ms p99 %.1f ms  CPU %.2f s  %s\n",
			name, x.RowsPerSec, x.LagP50Ms, x.LagP99Ms, x.CPUSeconds, x.Memory)
	}
	line("relay drain", r.Drain)
	fmt.Fprintf(w, "  drain / ceiling             %9.2f\n", r.DrainRatio)
	if k := r.KeyedDrain; k != nil {
		line(fmt.Sprintf("relay drain, %d keys", r.Keys), k)
		fmt.Fprintf(w, "  keyed / unordered           %9.2f\n", r.KeyedRatio)
		fmt.Fprintf(w, "  %-27s %9d messages of %d keys, each key's in row id order\n", "  order checked", k.OrderCheckedMessages, k.OrderCheckedKeys)
		if s := r.SyncClientRun; s != nil {
			fmt.Fprintf(w, "  %-27s %9.0f msgs/s  one PubAck awaited at a time (%d messages)  CPU %.1f %% of one core\n", "standard client, sync", r.SyncClient, s.Messages, s.CPUPercent)
			fmt.Fprintf(w, "  keyed / sync client         %9.2f\n", r.KeyedToSync)
		}
	}
	if g := r.GroupedDrain; g != nil {
		line(fmt.Sprintf("relay drain, groups of %d", r.Group), g)
		fmt.Fprintf(w, "  grouped / unordered         %9.2f\n", r.GroupedRatio)
		fmt.Fprintf(w, "  %-27s %9d messages of %d groups, each whole in one atomic batch\n", "  groups checked", g.GroupCheckedMessages, g.GroupCheckedGroups)
	}
	if x := r.SettleWAL; x != nil {
		fmt.Fprintf(w, "  %-27s %9s B of WAL per row (%d rows of %d B; read pinned)\n", "settle writes", thousands(r.WALBytesPerRow), x.Rows, r.PayloadBytes)
	}
	if r.DrainWithDone != nil {
		line(fmt.Sprintf("drain, %d done rows", r.DrainWithDone.DoneRows), r.DrainWithDone)
		fmt.Fprintf(w, "  with done / empty           %9.2f\n", r.DoneRatio)
	}
	if r.Rate != nil {
		line(fmt.Sprintf("%d rows/s offered", r.Rate.OfferedRate), r.Rate)
		fmt.Fprintf(w, "  %-27s %9d pages\n", "  writer wal_autocheckpoint", *r.Rate.WriterAutocheckpoint)
		fmt.Fprintf(w, "  %-27s %9s         p50 %.1f ms p99 %.1f ms  max %.1f ms\n", "  commit to PubAck", "", r.Rate.AckLagP50Ms, r.Rate.AckLagP99Ms, r.Rate.AckLagMaxMs)
		fmt.Fprintf(w, "  %-27s %9s         p50 %.2f ms p99 %.2f ms  max %.2f ms\n", "  writer, due to committed", "", r.Rate.WriterP50Us/1000, r.Rate.WriterP99Us/1000, r.Rate.WriterMaxUs/1000)
		fmt.Fprintf(w, "  %-27s %9.1f %% of one core while the writer wrote\n", "  relay CPU", r.Rate.CPUPercent)
		if a := r.WriterAlone; a != nil {
			fmt.Fprintf(w, "  %-27s %9s         p50 %.2f ms p99 %.2f ms  max %.2f ms\n", "writer alone (no relay)", "", a.WriterP50Us/1000, a.WriterP99Us/1000, a.WriterMaxUs/1000)
			fmt.Fprintf(w, "  writer p99, relay / alone   %9.2f\n", r.WriterP99Ratio)
		}
		if cl := r.Client; cl != nil {
			fmt.Fprintf(w, "  %-27s %9.1f %% of one core, one PubAck awaited at a time\n", "standard client alone", cl.CPUPercent)
			fmt.Fprintf(w, "  relay CPU / client CPU      %9.1f\n", r.CPUToClient)
		}
	}
	if x := r.Reconcile; x != nil {
		fmt.Fprintf(w, "  %-27s %9.0f rows/s  %d of %d rows found in %.2f s  %s  stream holds %d messages\n",
			"reconcile after a restore", x.RowsPerSec, x.Settled, x.Rows, x.Seconds, x.Memory, x.StreamMessages)
	}
	if r.IdleCPUPercent != nil {
		fmt.Fprintf(w, "  idle CPU                    %9.2f %% of one core over %.0f s\n", *r.IdleCPUPercent, r.IdleSeconds)
	}
}

// configArgs passes the bench's --config file on to a child.
func (b *bench) configArgs() []string {
	if b.o.ConfigFile == "" {
		return nil
	}
	return []string{"--config", b.o.ConfigFile}
}

// migrateBenchDB creates a database at path with the relay's schema.
func migrateBenchDB(ctx context.Context, path string) error {
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Create: true})
	if err != nil {
		return err
	}
	defer s.Close()
	_, err = schema.Migrate(ctx, s)
	return err
}

// thousands rounds x and writes it with commas between groups of three
// digits: 66,912.
func thousands(x float64) string {
	s := strconv.FormatInt(int64(math.Round(x)), 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	if neg {
		s = "-" + s
	}
	return s
}

// bench is one run's state: what it measures, for the child processes.
type bench struct {
	o Options
	// exe is the binary whose run and bench-client commands the children
	// run; empty: this one.
	exe string
	// fleetSettle, when set, replaces the fleet's waits for its start to
	// settle and for its files to close as idle (a test's short run).
	fleetSettle *time.Duration
}

// executable is the binary the children run.
func (b *bench) executable() (string, error) {
	if b.exe != "" {
		return b.exe, nil
	}
	return os.Executable()
}
