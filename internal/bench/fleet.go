package bench

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/config"
)

// FleetReport is what --fleet N measured: one relay serving N database
// files (database.path a glob), each figure beside a relay serving one
// file, measured in the same run.
type FleetReport struct {
	Files     int            `json:"files"`
	Idle      *FleetIdle     `json:"idle"`
	Trickle   *FleetTrickle  `json:"trickle"`
	Drains    *FleetDrains   `json:"drains"`
	NewFiles  *FleetNewFiles `json:"new_files"`
	PeakRSSMi float64        `json:"peak_rss_mib"` // the fleet's relay, over the whole run
	// FileOpens is how many times the fleet opened one of its files (its
	// "relay starting" lines) over the whole run.
	FileOpens int `json:"file_opens"`
}

// FleetIdle is the fleet's relay with every file idle.
type FleetIdle struct {
	Seconds    float64 `json:"seconds"` // the window, after startup settled
	CPUPercent float64 `json:"cpu_percent_of_one_core"`
	Memory             // from its start to the window's end
	// FileOpens is how many files the fleet opened before the window's
	// end (none should be: none has anything to do).
	FileOpens int `json:"file_opens"`
}

// FleetTrickle is writers committing single-row transactions to some of
// the fleet's files, against one file written at their total rate.
type FleetTrickle struct {
	FilesWritten int         `json:"files_written"`
	PerFileRate  int         `json:"rows_per_second_per_file"`
	Rate         int         `json:"rows_per_second"`
	Fleet        *TrickleRun `json:"fleet"`
	Single       *TrickleRun `json:"single_file"`
	CPURatio     float64     `json:"fleet_cpu_to_single_file"`
}

// TrickleRun is one relay under a trickle: commit-to-PubAck lag (a
// message's store time in the stream minus its Outbox-Created-At) and the
// relay's CPU while the writers wrote.
type TrickleRun struct {
	Rows        int     `json:"rows"`
	Seconds     float64 `json:"seconds"`
	CPUPercent  float64 `json:"cpu_percent_of_one_core"`
	AckLagP50Ms float64 `json:"ack_lag_p50_ms"`
	AckLagP99Ms float64 `json:"ack_lag_p99_ms"`
	AckLagMaxMs float64 `json:"ack_lag_max_ms"`
	// AckLagSteadyP99Ms is the p99 of the rows committed after the first
	// second: without the files' opening.
	AckLagSteadyP99Ms float64 `json:"ack_lag_steady_p99_ms"`
	began             time.Time
}

// fleetWriters and fleetWriterRate are the trickle's shape: this many
// files (at most the fleet's), each written this many rows a second.
const (
	fleetWriters    = 50
	fleetWriterRate = 20
)

// fleetBusy is how many of the fleet's files drain a backlog at once.
const fleetBusy = 100

// fleetStarting is the fleet's line once it serves its pattern.
const fleetStarting = "relay starting for a fleet of database files"

// fleetIdleAfter is how long after its last commit a fleet's file is
// closed as idle (the relay's fleetIdleAfter, 10 s), with a margin.
const fleetIdleAfter = 12 * time.Second

// fleetRun is one --fleet measurement's state.
type fleetRun struct {
	b        *bench
	dir      string   // the fleet's directory
	files    []string // its database files
	names    benchNames
	js       jetstream.JetStream
	url      string
	ch       *child.Process // the fleet's relay
	quiet    time.Time      // since when no file of the fleet was written
	progress func(string, ...any)
	// single starts a relay on one fresh file, on a fresh stream.
	single func(name string) (string, *child.Process, benchNames, error)
}

// benchFleet measures a fleet of b.o.Fleet files: idle, a trickle into
// some of them, one file draining, many files draining, new files; each
// against a single-file relay of the same run where the target is a ratio.
func (b *bench) benchFleet(ctx context.Context, dir, url string, js jetstream.JetStream, prefix string,
	stream func(name, subjects string) (benchNames, error), progress func(string, ...any)) (*FleetReport, error) {
	o := b.o
	f := &fleetRun{b: b, dir: filepath.Join(dir, "fleet"), js: js, url: url, progress: progress}
	var err error
	began := time.Now()
	if f.files, err = makeFleet(ctx, dir, f.dir, o.Fleet); err != nil {
		return nil, err
	}
	progress("fleet: %d database files in %s, made in %.1f s", len(f.files), f.dir, time.Since(began).Seconds())
	// One stream for the fleet's relay, for its whole life, beside the
	// single-file relays' streams, which stream() replaces.
	f.names = benchNames{stream: strings.ToUpper(prefix) + "_FLEET", prefix: prefix + "_fleet"}
	if err := benchkit.ReplaceStream(ctx, js, "", f.names.stream, []string{f.names.prefix + ".>"}, time.Hour); err != nil {
		return nil, err
	}
	defer js.DeleteStream(context.Background(), f.names.stream)
	f.single = func(name string) (string, *child.Process, benchNames, error) {
		names, err := stream(name, prefix+".>")
		if err != nil {
			return "", nil, names, err
		}
		path := filepath.Join(dir, name+".db")
		if err := migrateBenchDB(ctx, path); err != nil {
			return "", nil, names, err
		}
		ch, _, err := b.startChild(path, url, names)
		return path, ch, names, err
	}

	cmd, err := b.childCommand(filepath.Join(f.dir, "*.db"), url, f.names)
	if err != nil {
		return nil, err
	}
	cmd.Env = append(cmd.Env, config.EnvName("stream.subject_template")+"={tenant}.{event_type}")
	if f.ch, _, err = startRelayLogging(cmd, fleetStarting); err != nil {
		return nil, err
	}
	defer func() {
		if f.ch != nil {
			stopRelay(f.ch)
		}
	}()
	f.quiet = time.Now()
	rep := &FleetReport{Files: len(f.files)}
	if rep.Idle, err = f.idle(); err != nil {
		return nil, err
	}
	progress("fleet idle: %.2f%% of one core over %.0f s, %s, %d files opened", rep.Idle.CPUPercent, rep.Idle.Seconds, rep.Idle.Memory, rep.Idle.FileOpens)
	if rep.Trickle, err = f.trickle(ctx); err != nil {
		return nil, err
	}
	if rep.Drains, err = f.drains(ctx); err != nil {
		return nil, err
	}
	if rep.NewFiles, err = f.newFiles(ctx); err != nil {
		return nil, err
	}
	rep.FileOpens = f.opens()
	var mem Memory
	_, mem, err = stopRelay(f.ch)
	rep.PeakRSSMi = mem.PeakRSSMiB
	f.ch = nil
	return rep, err
}

// makeFleet creates n migrated database files in fleetDir as
// "outbox-relay migrate" leaves them: copies of one migrated in dir (a
// copy is faster than creating a file), each opened and checked by the
// migration again, which leaves its -wal and -shm files beside it. (A
// file without them, as an application's last connection leaves it, the
// fleet cannot read without opening it for writing: at start it opens
// every such file.)
func makeFleet(ctx context.Context, dir, fleetDir string, n int) ([]string, error) {
	tmpl := filepath.Join(dir, "fleet-template.db")
	if err := migrateBenchDB(ctx, tmpl); err != nil {
		return nil, err
	}
	raw, err := os.ReadFile(tmpl) // closed: its WAL is checkpointed and empty
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(fleetDir, 0o755); err != nil {
		return nil, err
	}
	files := make([]string, n)
	for i := range files {
		files[i] = filepath.Join(fleetDir, fmt.Sprintf("t%05d.db", i))
		if err := os.WriteFile(files[i], raw, 0o644); err != nil {
			return nil, err
		}
		if err := migrateBenchDB(ctx, files[i]); err != nil {
			return nil, err
		}
	}
	return files, nil
}

// settle is how long the fleet gets after its start before the idle
// window; waitQuiet waits until every file written has been closed as
// idle. A test makes both short.
func (f *fleetRun) settle() time.Duration {
	if f.b.fleetSettle != nil {
		return *f.b.fleetSettle
	}
	return 5 * time.Second
}

func (f *fleetRun) waitQuiet() {
	wait := fleetIdleAfter
	if f.b.fleetSettle != nil {
		wait = *f.b.fleetSettle
	}
	time.Sleep(time.Until(f.quiet.Add(wait)))
}

// idle measures the fleet's relay's CPU over --idle (30 s unless set)
// once its start settled, every file idle, and its peak RSS until then.
func (f *fleetRun) idle() (*FleetIdle, error) {
	d := f.b.o.Idle
	if d <= 0 {
		d = 30 * time.Second
	}
	time.Sleep(f.settle())
	before, err := procCPU(f.ch.Pid())
	if err != nil {
		return nil, err
	}
	began := time.Now()
	time.Sleep(d)
	after, err := procCPU(f.ch.Pid())
	if err != nil {
		return nil, err
	}
	took := time.Since(began)
	mem, err := procMemory(f.ch.Pid())
	if err != nil {
		return nil, err
	}
	return &FleetIdle{Seconds: took.Seconds(), CPUPercent: 100 * (after - before).Seconds() / took.Seconds(), Memory: mem, FileOpens: f.opens()}, nil
}

// opens is how many times the fleet opened one of its files so far.
func (f *fleetRun) opens() int {
	return len(f.ch.Find("relay starting"))
}

// openDBs opens the application's connections to paths.
func openDBs(paths []string) ([]*sql.DB, func(), error) {
	var dbs []*sql.DB
	closeAll := func() {
		for _, db := range dbs {
			db.Close()
		}
	}
	for _, p := range paths {
		db, err := sql.Open("sqlite3", "file:"+p+"?_busy_timeout=5000")
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		dbs = append(dbs, db)
	}
	return dbs, closeAll, nil
}

// waitAllDrained waits until the relay ch has settled every row of dbs.
func waitAllDrained(ctx context.Context, dbs []*sql.DB, ch *child.Process) error {
	for _, db := range dbs {
		if err := waitDrained(ctx, db, ch); err != nil {
			return err
		}
	}
	return nil
}

// printFleet writes a --fleet report for people.
func printFleet(w io.Writer, r *Report) {
	x := r.Fleet
	fmt.Fprintf(w, "outbox-relay bench --fleet: %d database files, rows of %d bytes (%s)\n", x.Files, r.PayloadBytes, r.Machine)
	if i := x.Idle; i != nil {
		fmt.Fprintf(w, "  %-31s %8.2f %% of one core over %.0f s  %s  files opened %d\n", "all idle", i.CPUPercent, i.Seconds, i.Memory, i.FileOpens)
	}
	if t := x.Trickle; t != nil {
		fmt.Fprintf(w, "  trickle: %d files x %d rows/s, single-row transactions, against one file at %d rows/s\n", t.FilesWritten, t.PerFileRate, t.Rate)
		tr := func(name string, run *TrickleRun) {
			fmt.Fprintf(w, "    %-29s commit to PubAck p50 %.1f ms p99 %.1f ms max %.1f ms (after the first second: p99 %.1f ms)  CPU %.1f %% of one core  (%d rows)\n",
				name, run.AckLagP50Ms, run.AckLagP99Ms, run.AckLagMaxMs, run.AckLagSteadyP99Ms, run.CPUPercent, run.Rows)
		}
		tr("fleet", t.Fleet)
		tr("single file", t.Single)
		fmt.Fprintf(w, "    %-29s %8.2f\n", "CPU, fleet / single file", t.CPURatio)
	}
	if d := x.Drains; d != nil {
		dr := func(name string, run *DrainRun) {
			fmt.Fprintf(w, "    %-29s %8.0f rows/s  %d rows in %d files, done in %.2f s  CPU %.2f s\n", name, run.RowsPerSec, run.Rows, run.Files, run.Seconds, run.CPUSeconds)
		}
		sp := func(name string, s Spread) {
			fmt.Fprintf(w, "    %-29s %8.2f  (%.2f to %.2f, %d rounds)\n", name, s.Median, s.Min, s.Max, len(d.Rounds))
		}
		for i, r := range d.Rounds {
			fmt.Fprintf(w, "  drains, round %d\n", i+1)
			dr("single file", r.Single)
			dr(fmt.Sprintf("one file of %d", x.Files), r.One)
			dr(fmt.Sprintf("%d files at once", r.Many.Files), r.Many)
			fmt.Fprintf(w, "    %-29s %8.2f  (mean %.2f s, max %.2f s)\n", "time to done, max / mean", r.ManyMaxOverMean, r.Many.DoneMeanSeconds, r.Many.DoneMaxSeconds)
		}
		fmt.Fprintf(w, "  drains, medians of the rounds\n")
		sp("one file / single file", d.OneRatio)
		sp("time to done, max / mean", d.ManyMaxOverMean)
		sp(fmt.Sprintf("%d files / single file", d.Rounds[0].Many.Files), d.ManyRatio)
	}
	if n := x.NewFiles; n != nil {
		nf := func(name string, s *NewFileSamples) {
			fmt.Fprintf(w, "  %-31s commit to PubAck median %.0f ms, %.0f to %.0f ms (%d files); to done median %.0f ms\n",
				name, s.AckMedianMs, s.AckMinMs, s.AckMaxMs, len(s.AckMs), s.DoneMedianMs)
		}
		nf("new file, moved in", n.MovedIn)
		nf("new file, created in place", n.CreatedInPlace)
		nf("woken, synchronous=FULL", n.WokenSyncFull)
	}
	fmt.Fprintf(w, "  %-31s %8.1f MiB over the whole run; files opened %d times\n", "fleet peak RSS", x.PeakRSSMi, x.FileOpens)
}
