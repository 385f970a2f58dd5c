package demo

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// meter reads what the progress line shows: the rows the relay published,
// from the database, and the delivery lag, from the relay's own histogram
// (created_at to the broker's ack), so that the demo shows what /metrics
// shows. Each reading covers the time since the one before.
type meter struct {
	db  *sqlitedb.DB
	lag prometheus.Histogram

	published int64 // done rows at the last reading
	// The histogram at the start and at the last reading.
	first, last lagTotals
}

// lagTotals are a histogram's sample count and sum (seconds).
type lagTotals struct {
	count uint64
	sum   float64
}

// reading is one progress line's numbers.
type reading struct {
	published, rate       int64 // done rows, and how many since the last reading
	backlog, deadLettered int64
	lag                   time.Duration // mean delivery lag since the last reading; -1: no row
}

// start takes the readings the first line is measured from: rows done in
// an earlier run on the same directory are not this run's rate.
func (m *meter) start(ctx context.Context) error {
	done, err := doneRows(ctx, m.db)
	if err != nil {
		return fmt.Errorf("count published rows: %w", err)
	}
	m.published = done
	m.first = m.totals()
	m.last = m.first
	return nil
}

// read takes a reading.
func (m *meter) read(ctx context.Context) (reading, error) {
	done, err := doneRows(ctx, m.db)
	if err != nil {
		return reading{}, err
	}
	b, err := housekeeping.Backlog(ctx, m.db, false)
	if err != nil {
		return reading{}, err
	}
	now := m.totals()
	r := reading{
		published: done, rate: max(0, done-m.published), // retention may delete done rows
		backlog: b.Pending + b.Processing, deadLettered: b.DeadLettered,
		lag: meanLag(m.last, now),
	}
	m.published, m.last = done, now
	return r, nil
}

// summary prints the demo's last line: what was written and published,
// and the mean delivery lag over the whole run.
func (m *meter) summary(out io.Writer, written int64, dir string) {
	ctx := context.Background()
	b, _ := housekeeping.Backlog(ctx, m.db, false)
	done, _ := doneRows(ctx, m.db)
	fmt.Fprintf(out, "demo stopped: the application wrote %d events, the relay published %d (avg lag %s), %d not yet published, %d dead-lettered; data kept in %s\n",
		written, done, lagText(meanLag(m.first, m.totals())), b.Pending+b.Processing, b.DeadLettered, dir)
}

// totals reads the histogram.
func (m *meter) totals() lagTotals {
	var d dto.Metric
	if err := m.lag.Write(&d); err != nil {
		return lagTotals{}
	}
	return lagTotals{count: d.GetHistogram().GetSampleCount(), sum: d.GetHistogram().GetSampleSum()}
}

// meanLag is the mean of the samples between two readings of the
// histogram; -1 when there are none.
func meanLag(from, to lagTotals) time.Duration {
	if to.count <= from.count {
		return -1
	}
	return time.Duration((to.sum - from.sum) / float64(to.count-from.count) * float64(time.Second))
}

// lagText shows a mean lag as the progress line does: "-" for none.
func lagText(d time.Duration) string {
	if d < 0 {
		return "-"
	}
	return d.Round(100 * time.Microsecond).String()
}

// doneRows counts the rows the relay has published.
func doneRows(ctx context.Context, db *sqlitedb.DB) (n int64, err error) {
	err = db.Reader().QueryRowContext(ctx, `SELECT count(*) FROM `+db.Table()+` WHERE status = 'done'`).Scan(&n)
	return n, err
}
