package bench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/event"
)

// trickle has fleetWriters of the fleet's files written fleetWriterRate
// rows/s each for --duration, then one file of a single-file relay at
// their total rate, the same writer code for both.
func (f *fleetRun) trickle(ctx context.Context) (*FleetTrickle, error) {
	o := f.b.o
	n := min(fleetWriters, len(f.files))
	t := &FleetTrickle{FilesWritten: n, PerFileRate: fleetWriterRate, Rate: n * fleetWriterRate}
	st, err := f.js.Stream(ctx, f.names.stream)
	if err != nil {
		return nil, err
	}
	if err := st.Purge(ctx); err != nil { // the lags read back are this trickle's
		return nil, fmt.Errorf("purge the fleet's stream: %w", err)
	}
	paths := f.files[:n]
	if t.Fleet, err = trickleRun(ctx, f.ch, paths, fleetWriterRate, o); err != nil {
		return nil, err
	}
	f.quiet = time.Now()
	if err = ackLags(ctx, f, f.names.stream, t.Fleet); err != nil {
		return nil, err
	}
	f.progress("fleet trickle, %d files x %d rows/s: commit to PubAck p50 %.1f ms p99 %.1f ms max %.1f ms, CPU %.1f%% of one core",
		n, fleetWriterRate, t.Fleet.AckLagP50Ms, t.Fleet.AckLagP99Ms, t.Fleet.AckLagMaxMs, t.Fleet.CPUPercent)

	path, ch, names, err := f.single("fleet-single-trickle")
	if err != nil {
		return nil, err
	}
	time.Sleep(time.Second) // let its start settle
	t.Single, err = trickleRun(ctx, ch, []string{path}, t.Rate, o)
	if _, _, stopErr := stopRelay(ch); err == nil {
		err = stopErr
	}
	if err != nil {
		return nil, err
	}
	if err = ackLags(ctx, f, names.stream, t.Single); err != nil {
		return nil, err
	}
	t.CPURatio = t.Fleet.CPUPercent / max(0.01, t.Single.CPUPercent)
	f.progress("single-file trickle, %d rows/s: commit to PubAck p50 %.1f ms p99 %.1f ms max %.1f ms, CPU %.1f%% of one core; fleet / single %.2f",
		t.Rate, t.Single.AckLagP50Ms, t.Single.AckLagP99Ms, t.Single.AckLagMaxMs, t.Single.CPUPercent, t.CPURatio)
	return t, nil
}

// trickleRun writes rate rows/s to each of paths for --duration while the
// relay ch runs, waits for them to be settled, and returns the relay's CPU
// while the writers wrote.
func trickleRun(ctx context.Context, ch *child.Process, paths []string, rate int, o Options) (*TrickleRun, error) {
	before, err := procCPU(ch.Pid())
	if err != nil {
		return nil, err
	}
	began := time.Now()
	rows, err := writeFleet(ctx, paths, rate, o.Duration, o.Size, o.WriterCheckpoint)
	if err != nil {
		return nil, err
	}
	after, err := procCPU(ch.Pid())
	if err != nil {
		return nil, err
	}
	took := time.Since(began)
	dbs, closeAll, err := openDBs(paths)
	if err != nil {
		return nil, err
	}
	defer closeAll()
	if err := waitAllDrained(ctx, dbs, ch); err != nil {
		return nil, err
	}
	return &TrickleRun{Rows: rows, Seconds: took.Seconds(), CPUPercent: 100 * (after - before).Seconds() / took.Seconds(), began: began}, nil
}

// ackLags reads run's commit-to-PubAck lags from the stream: one for each
// of its rows.
func ackLags(ctx context.Context, f *fleetRun, stream string, run *TrickleRun) error {
	lags, err := storedLags(ctx, f.js, stream, time.Time{})
	if err != nil {
		return err
	}
	if len(lags) != run.Rows {
		return fmt.Errorf("stream %s holds %d messages of the trickle's %d rows", stream, len(lags), run.Rows)
	}
	run.AckLagP50Ms, run.AckLagP99Ms, run.AckLagMaxMs = spread(lags)
	if lags, err = storedLags(ctx, f.js, stream, run.began.Add(time.Second)); err != nil {
		return err
	}
	_, run.AckLagSteadyP99Ms, _ = spread(lags)
	return nil
}

// writeFleet is the fleet's application: a writer per file, each
// committing rate single-row transactions a second for d (BEGIN
// IMMEDIATE, created_at taken with the lock held, as writeRate), the
// files' commits spread evenly over each period. Each writer sleeps until
// its next row is due, so that fifty of them cost the bench little CPU.
// It returns the rows written.
func writeFleet(ctx context.Context, paths []string, rate int, d time.Duration, size, autocheckpoint int) (int, error) {
	start := time.Now().Add(50 * time.Millisecond)
	var rows atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, len(paths))
	period := time.Second / time.Duration(rate)
	for i, path := range paths {
		offset := period * time.Duration(i) / time.Duration(len(paths))
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = writeFile(ctx, path, start.Add(offset), period, d, size, autocheckpoint, &rows)
		}()
	}
	wg.Wait()
	return int(rows.Load()), errors.Join(errs...)
}

// writeFile is one of writeFleet's writers: a row due every period from
// first on, until d after it.
func writeFile(ctx context.Context, path string, first time.Time, period, d time.Duration, size, autocheckpoint int, rows *atomic.Int64) error {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=10000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.ExecContext(ctx, fmt.Sprintf(`PRAGMA wal_autocheckpoint = %d`, autocheckpoint)); err != nil {
		return fmt.Errorf("writer: %w", err)
	}
	payload := make([]byte, size)
	for due := first; due.Before(first.Add(d)); due = due.Add(period) {
		time.Sleep(time.Until(due))
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return fmt.Errorf("writer: %w", err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO event_queue (event_id, event_type, payload, created_at) VALUES (?, 'BenchEvent', ?, ?)`,
			event.NewID(), payload, time.Now().UnixMilli()); err != nil {
			tx.Rollback()
			return fmt.Errorf("writer: %w", err)
		}
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("writer: %w", err)
		}
		rows.Add(1)
	}
	return nil
}
