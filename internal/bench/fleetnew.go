package bench

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/event"
)

// fleetNewFiles is how many new files each way of creating one gets.
const fleetNewFiles = 5

// FleetNewFiles are files that appear in the fleet's directory while its
// relay runs, each holding one row, and how long that row took.
type FleetNewFiles struct {
	// MovedIn files are migrated and given their row elsewhere, then
	// renamed to a name the pattern matches: timed from the rename.
	MovedIn *NewFileSamples `json:"moved_in"`
	// CreatedInPlace files are created empty under a name the pattern
	// matches, migrated there, then given their row: timed from its commit.
	CreatedInPlace *NewFileSamples `json:"created_in_place"`
	// WokenSyncFull are files of the fleet served before and closed as
	// idle, each given a row by an application that commits with
	// synchronous=FULL (the WAL is synced after its notification and
	// before the commit shows): timed from its commit.
	WokenSyncFull *NewFileSamples `json:"woken_sync_full"`
}

// NewFileSamples are the milliseconds from each new file's row being
// there to its PubAck (its store time in the stream) and to its settle
// (processed_at), one file after the other.
type NewFileSamples struct {
	AckMs        []float64 `json:"ack_ms"`
	DoneMs       []float64 `json:"done_ms"`
	AckMedianMs  float64   `json:"ack_median_ms"`
	AckMinMs     float64   `json:"ack_min_ms"`
	AckMaxMs     float64   `json:"ack_max_ms"`
	DoneMedianMs float64   `json:"done_median_ms"`
}

// newFiles times new files both ways.
func (f *fleetRun) newFiles(ctx context.Context) (*FleetNewFiles, error) {
	aside := filepath.Join(filepath.Dir(f.dir), "fleet-aside")
	if err := os.MkdirAll(aside, 0o755); err != nil {
		return nil, err
	}
	moved := func(i int) (string, time.Time, error) {
		tmp := filepath.Join(aside, fmt.Sprintf("moved%d.db", i))
		if err := migrateBenchDB(ctx, tmp); err != nil {
			return "", time.Time{}, err
		}
		if err := insertOne(ctx, tmp, ""); err != nil {
			return "", time.Time{}, err
		}
		path := filepath.Join(f.dir, filepath.Base(tmp))
		if err := os.Rename(tmp, path); err != nil {
			return "", time.Time{}, err
		}
		return path, time.Now(), nil
	}
	inPlace := func(i int) (string, time.Time, error) {
		path := filepath.Join(f.dir, fmt.Sprintf("created%d.db", i))
		if err := os.WriteFile(path, nil, 0o644); err != nil { // an empty file: an empty database
			return "", time.Time{}, err
		}
		if err := migrateBenchDB(ctx, path); err != nil {
			return "", time.Time{}, err
		}
		if err := insertOne(ctx, path, ""); err != nil {
			return "", time.Time{}, err
		}
		return path, time.Now(), nil
	}
	woken := func(i int) (string, time.Time, error) {
		path := f.files[i%len(f.files)]
		if err := insertOne(ctx, path, "&_sync=FULL"); err != nil {
			return "", time.Time{}, err
		}
		return path, time.Now(), nil
	}
	n := &FleetNewFiles{}
	var err error
	if n.MovedIn, err = f.newFileSamples(ctx, moved); err != nil {
		return nil, fmt.Errorf("new file moved in: %w", err)
	}
	if n.CreatedInPlace, err = f.newFileSamples(ctx, inPlace); err != nil {
		return nil, fmt.Errorf("new file created in place: %w", err)
	}
	f.waitQuiet() // the files the drains wrote are closed again
	if n.WokenSyncFull, err = f.newFileSamples(ctx, woken); err != nil {
		return nil, fmt.Errorf("closed file woken: %w", err)
	}
	for name, s := range map[string]*NewFileSamples{"new file moved in": n.MovedIn, "new file created in place": n.CreatedInPlace,
		"closed file woken, synchronous=FULL": n.WokenSyncFull} {
		f.progress("fleet, %s: commit to PubAck median %.0f ms (%.0f to %.0f), to done median %.0f ms", name, s.AckMedianMs, s.AckMinMs, s.AckMaxMs, s.DoneMedianMs)
	}
	return n, nil
}

// newFileSamples makes fleetNewFiles files with make, which returns the
// file and when its row was there, and times each row.
func (f *fleetRun) newFileSamples(ctx context.Context, make func(i int) (string, time.Time, error)) (*NewFileSamples, error) {
	s := &NewFileSamples{}
	st, err := f.js.Stream(ctx, f.names.stream)
	if err != nil {
		return nil, err
	}
	for i := range fleetNewFiles {
		path, at, err := make(i)
		if err != nil {
			return nil, err
		}
		done, err := waitRowDone(ctx, path, f.ch)
		if err != nil {
			return nil, err
		}
		subject := f.names.prefix + "." + tenantOf(path) + ".BenchEvent"
		msg, err := st.GetLastMsgForSubject(ctx, subject)
		if err != nil {
			return nil, fmt.Errorf("the message of %s (%s): %w", path, subject, err)
		}
		s.AckMs = append(s.AckMs, float64(msg.Time.Sub(at).Microseconds())/1000)
		s.DoneMs = append(s.DoneMs, float64(done.Sub(at).Microseconds())/1000)
	}
	s.AckMedianMs, s.AckMinMs, s.AckMaxMs = median(s.AckMs), slices.Min(s.AckMs), slices.Max(s.AckMs)
	s.DoneMedianMs = median(s.DoneMs)
	return s, nil
}

// tenantOf is the tenant of a fleet's file: its name without ".db".
func tenantOf(path string) string {
	base := filepath.Base(path)
	return base[:len(base)-len(filepath.Ext(base))]
}

// median returns the middle of xs (the mean of the two middle ones).
func median(xs []float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// insertOne commits one row to the outbox at path, as an application
// whose connection's DSN ends in dsn.
func insertOne(ctx context.Context, path, dsn string) error {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=10000&_txlock=immediate"+dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	_, err = db.ExecContext(ctx, `INSERT INTO event_queue (event_id, event_type, payload, created_at) VALUES (?, 'BenchEvent', x'00', ?)`,
		event.NewID(), time.Now().UnixMilli())
	return err
}

// waitRowDone waits until the rows of the file at path are settled, and
// returns the last one's processed_at; at most 30 s.
func waitRowDone(ctx context.Context, path string, ch *child.Process) (time.Time, error) {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		return time.Time{}, err
	}
	defer db.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var done bool
		var at sql.NullInt64
		err := db.QueryRowContext(ctx, `SELECT count(*) > 0 AND count(*) = count(CASE WHEN status = 'done' THEN 1 END), max(processed_at) FROM event_queue`).Scan(&done, &at)
		if err != nil {
			return time.Time{}, fmt.Errorf("read %s: %w", path, err)
		}
		if done {
			return time.UnixMilli(at.Int64), nil
		}
		if time.Now().After(deadline) {
			return time.Time{}, fmt.Errorf("the row of the new file %s was not done within 30 s", path)
		}
		select {
		case <-ch.Exited():
			return time.Time{}, fmt.Errorf("the fleet's relay exited before the row of %s was done", path)
		case <-time.After(5 * time.Millisecond):
		}
	}
}
