package bench

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/child"
)

// FleetDrains are backlogs drained by the fleet, against a single-file
// relay draining --rows rows, in rounds that alternate them (see drains).
type FleetDrains struct {
	Rounds []*DrainRound `json:"rounds"`
	// The rounds' medians, and their ranges.
	OneRatio        Spread `json:"one_file_to_single_file"`
	ManyMaxOverMean Spread `json:"many_files_done_max_to_mean"`
	ManyRatio       Spread `json:"many_files_to_single_file"`
}

// DrainRound is one round of the drains: each figure beside the single
// file's of the same round.
type DrainRound struct {
	Single   *DrainRun `json:"single_file"`
	One      *DrainRun `json:"one_file"` // one file of the fleet, the others idle
	OneRatio float64   `json:"one_file_to_single_file"`
	// Many is min(100, N) files of the fleet at once, each --rows/100 rows.
	Many            *DrainRun `json:"many_files"`
	ManyMaxOverMean float64   `json:"many_files_done_max_to_mean"`
	ManyRatio       float64   `json:"many_files_to_single_file"`
}

// Spread is the median of several rounds' figures, and their range.
type Spread struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

// spreadOf returns the Spread of xs.
func spreadOf(xs []float64) Spread {
	if len(xs) == 0 {
		return Spread{}
	}
	return Spread{Median: median(xs), Min: slices.Min(xs), Max: slices.Max(xs)}
}

// DrainRun is a backlog that appeared at once (see seedFrozen) drained:
// from then to the last row's processed_at, and the relay's CPU meanwhile.
type DrainRun struct {
	Files      int     `json:"files"`
	Rows       int     `json:"rows"`
	Seconds    float64 `json:"seconds"`
	RowsPerSec float64 `json:"rows_per_second"`
	CPUSeconds float64 `json:"cpu_seconds"`
	// Each file's time to done, from the same start (several files).
	DoneMeanSeconds float64 `json:"done_mean_seconds,omitempty"`
	DoneMaxSeconds  float64 `json:"done_max_seconds,omitempty"`
}

// fleetDrainRounds is how many rounds of the drains a run measures: on a
// shared machine one drain against one other differed by a fifth either
// way from run to run, whichever came second.
const fleetDrainRounds = 3

// drains measures, in fleetDrainRounds rounds, the single-file drain of
// --rows, the same rows in one file of the fleet, and --rows spread over
// min(100, N) files of it. Each round drains files of the fleet that no
// round drained before, while there are enough.
func (f *fleetRun) drains(ctx context.Context) (*FleetDrains, error) {
	d := &FleetDrains{}
	var one, maxMean, many []float64
	for i := range fleetDrainRounds {
		r, err := f.drainRound(ctx, i)
		if err != nil {
			return nil, err
		}
		d.Rounds = append(d.Rounds, r)
		one, maxMean, many = append(one, r.OneRatio), append(maxMean, r.ManyMaxOverMean), append(many, r.ManyRatio)
	}
	d.OneRatio, d.ManyMaxOverMean, d.ManyRatio = spreadOf(one), spreadOf(maxMean), spreadOf(many)
	return d, nil
}

// drainRound is round i of the drains.
func (f *fleetRun) drainRound(ctx context.Context, i int) (*DrainRound, error) {
	o := f.b.o
	d := &DrainRound{}
	path, ch, names, err := f.single(fmt.Sprintf("fleet-single-drain-%d", i))
	if err != nil {
		return nil, err
	}
	time.Sleep(time.Second) // let its start settle
	d.Single, err = drainFrozen(ctx, ch, []string{path}, o.Rows, o.Size)
	if _, _, stopErr := stopRelay(ch); err == nil {
		err = stopErr
	}
	if err != nil {
		return nil, err
	}
	// The server holds the fleet's stream alone again, as when the single
	// file drained.
	if err := f.js.DeleteStream(ctx, names.stream); err != nil {
		return nil, err
	}
	f.progress("round %d, single-file drain: %.0f rows/s (%d rows), CPU %.2f s", i+1, d.Single.RowsPerSec, d.Single.Rows, d.Single.CPUSeconds)

	n := len(f.files)
	f.waitQuiet()
	if d.One, err = drainFrozen(ctx, f.ch, []string{f.files[n-1-i%n]}, o.Rows, o.Size); err != nil {
		return nil, err
	}
	f.quiet = time.Now()
	d.OneRatio = d.One.RowsPerSec / d.Single.RowsPerSec
	f.progress("round %d, fleet, one file draining: %.0f rows/s, CPU %.2f s; / single file %.2f", i+1, d.One.RowsPerSec, d.One.CPUSeconds, d.OneRatio)

	busy := min(fleetBusy, n)
	from := i * busy % n
	if from+busy > n {
		from = 0
	}
	f.waitQuiet()
	if d.Many, err = drainFrozen(ctx, f.ch, f.files[from:from+busy], max(1, o.Rows/fleetBusy), o.Size); err != nil {
		return nil, err
	}
	f.quiet = time.Now()
	d.ManyMaxOverMean = d.Many.DoneMaxSeconds / d.Many.DoneMeanSeconds
	d.ManyRatio = d.Many.RowsPerSec / d.Single.RowsPerSec
	f.progress("round %d, fleet, %d files draining: %.0f rows/s, CPU %.2f s; time to done mean %.2f s max %.2f s (max / mean %.2f); / single file %.2f",
		i+1, busy, d.Many.RowsPerSec, d.Many.CPUSeconds, d.Many.DoneMeanSeconds, d.Many.DoneMaxSeconds, d.ManyMaxOverMean, d.ManyRatio)
	return d, nil
}

// drainFrozen seeds rows pending rows in each of paths with the relay ch
// stopped (seedFrozen), so that the whole backlog appears to it at once,
// and measures from its continuing to each file's last settled row.
func drainFrozen(ctx context.Context, ch *child.Process, paths []string, rows, size int) (*DrainRun, error) {
	dbs, closeAll, err := openDBs(paths)
	if err != nil {
		return nil, err
	}
	defer closeAll()
	cpu0, err := procCPU(ch.Pid())
	if err != nil {
		return nil, err
	}
	start, err := seedFrozen(ctx, ch, dbs, rows, size)
	if err != nil {
		return nil, err
	}
	if err := waitAllDrained(ctx, dbs, ch); err != nil {
		return nil, err
	}
	cpu1, err := procCPU(ch.Pid())
	if err != nil {
		return nil, err
	}
	r := &DrainRun{Files: len(paths), Rows: rows * len(paths), CPUSeconds: (cpu1 - cpu0).Seconds()}
	var sum float64
	for _, db := range dbs {
		last, err := benchkit.LastProcessed(ctx, db, "event_queue")
		if err != nil {
			return nil, err
		}
		s := last.Sub(start).Seconds()
		sum += s
		r.DoneMaxSeconds = max(r.DoneMaxSeconds, s)
	}
	r.Seconds = r.DoneMaxSeconds
	r.RowsPerSec = float64(r.Rows) / r.Seconds
	if len(dbs) > 1 {
		r.DoneMeanSeconds = sum / float64(len(dbs))
	} else {
		r.DoneMaxSeconds = 0
	}
	return r, nil
}

// seedFrozen stops the relay ch (SIGSTOP), seeds rows pending rows of
// size bytes into each of dbs, and lets it go on (SIGCONT), returning
// when: the relay finds the whole backlog at once, however long seeding
// took, as a single file's relay and a fleet's alike, and startup is not
// counted. A relay stopped while it held a file's write lock is let go
// on and stopped again a moment later.
func seedFrozen(ctx context.Context, ch *child.Process, dbs []*sql.DB, rows, size int) (time.Time, error) {
	for attempt := 0; ; attempt++ {
		if err := ch.Signal(syscall.SIGSTOP); err != nil {
			return time.Time{}, err
		}
		err := stopped(ch.Pid())
		if err == nil {
			err = writable(ctx, dbs)
		}
		if err == nil {
			break
		}
		if err := ch.Signal(syscall.SIGCONT); err != nil {
			return time.Time{}, err
		}
		if attempt == 50 {
			return time.Time{}, fmt.Errorf("seed with the relay stopped: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, db := range dbs {
		if err := benchkit.Seed(ctx, db, "event_queue", rows, size, "pending"); err != nil {
			ch.Signal(syscall.SIGCONT)
			return time.Time{}, err
		}
	}
	start := time.Now()
	return start, ch.Signal(syscall.SIGCONT)
}

// stopped waits until every thread of process pid has stopped: a signal
// is delivered after kill returns, and a thread running meanwhile may
// take a write lock after writable looked.
func stopped(pid int) error {
	for range 1000 {
		tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
		if err != nil {
			return err
		}
		all := len(tasks) > 0
		for _, task := range tasks {
			if raw, err := os.ReadFile(task); err == nil {
				// The state follows the command name, which may hold spaces.
				if i := bytes.LastIndexByte(raw, ')'); i < 0 || i+2 >= len(raw) || raw[i+2] != 'T' {
					all = false
				}
			}
		}
		if all {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("process %d did not stop", pid)
}

// writable checks that no one holds the write lock of dbs, at once.
func writable(ctx context.Context, dbs []*sql.DB) error {
	for _, db := range dbs {
		conn, err := db.Conn(ctx)
		if err != nil {
			return err
		}
		_, err = conn.ExecContext(ctx, `PRAGMA busy_timeout = 0`)
		if err == nil {
			if _, err = conn.ExecContext(ctx, `BEGIN IMMEDIATE`); err == nil {
				_, err = conn.ExecContext(ctx, `ROLLBACK`)
			}
		}
		conn.ExecContext(ctx, `PRAGMA busy_timeout = 5000`)
		conn.Close()
		if err != nil {
			return err
		}
	}
	return nil
}
