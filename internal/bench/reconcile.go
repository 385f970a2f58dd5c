package bench

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/benchkit"
	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// ReconcileRun is the relay started on a backup taken before its rows
// were published: it finds them in the stream and settles them without
// publishing them again.
type ReconcileRun struct {
	Rows       int     `json:"rows"`            // rows published after the backup, pending in it
	Settled    int     `json:"settled"`         // of them, found in the stream and settled done
	Seconds    float64 `json:"seconds"`         // from the reconciliation's first log line to its last
	RowsPerSec float64 `json:"rows_per_second"` // Settled / Seconds
	Memory
	StreamMessages uint64 `json:"stream_messages"` // after: Rows when nothing was published twice
}

// The relay's log lines around a reconciliation that reads messages.
const (
	reconcileBegins = "reconciling the outbox with the stream before publishing: reading the stream's messages that may be this outbox's, to settle the rows published already"
	reconcileEnds   = "reconciled the outbox with the stream; publishing"
)

// benchReconcile seeds n pending rows, copies the file (the backup), has
// a relay publish the rows, then runs a relay on the copy: a restore from
// a backup taken before the rows were published.
func (b *bench) benchReconcile(ctx context.Context, dir, url string, names benchNames, js jetstream.JetStream, n int) (*ReconcileRun, error) {
	path, backup := filepath.Join(dir, "reconcile.db"), filepath.Join(dir, "reconcile-backup.db")
	if err := migrateBenchDB(ctx, path); err != nil {
		return nil, err
	}
	// The origin first, as a relay that ran on the file before gives it:
	// the backup keeps it.
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: "event_queue"})
	if err != nil {
		return nil, err
	}
	_, err = reconcile.Origin(ctx, s)
	s.Close()
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		return nil, err
	}
	defer db.Close()
	if err := b.seed(ctx, db, drain{rows: n}); err != nil {
		return nil, err
	}
	if _, err := db.ExecContext(ctx, `VACUUM INTO ?`, backup); err != nil {
		return nil, fmt.Errorf("back up the bench database: %w", err)
	}
	ch, _, err := b.startChild(path, url, names)
	if err != nil {
		return nil, err
	}
	if err := waitDrained(ctx, db, ch); err != nil {
		stopRelay(ch)
		return nil, err
	}
	if _, _, err := stopRelay(ch); err != nil {
		return nil, err
	}

	restored, err := sql.Open("sqlite3", "file:"+backup+"?_busy_timeout=5000")
	if err != nil {
		return nil, err
	}
	defer restored.Close()
	if ch, _, err = b.startChild(backup, url, names); err != nil {
		return nil, err
	}
	began, err := ch.WaitFor(reconcileBegins, relayStartTimeout)
	if err != nil {
		stopRelay(ch)
		return nil, fmt.Errorf("the relay on the restored file %w", err)
	}
	ended, err := ch.WaitFor(reconcileEnds, relayStopTimeout)
	if err != nil {
		stopRelay(ch)
		return nil, fmt.Errorf("the relay on the restored file %w", err)
	}
	if err := waitDrained(ctx, restored, ch); err != nil {
		stopRelay(ch)
		return nil, err
	}
	res := &ReconcileRun{Rows: n, Seconds: ended.At.Sub(began.At).Seconds()}
	if settled, ok := ended.Fields["settled"].(float64); ok {
		res.Settled = int(settled)
	}
	res.RowsPerSec = float64(res.Settled) / res.Seconds
	if _, res.Memory, err = stopRelay(ch); err != nil {
		return nil, err
	}
	info, err := js.Stream(ctx, names.stream)
	if err != nil {
		return nil, err
	}
	res.StreamMessages = info.CachedInfo().State.Msgs
	return res, nil
}

// waitDrained waits until the relay child ch has settled every row of db.
func waitDrained(ctx context.Context, db *sql.DB, ch *child.Process) error {
	for {
		drained, err := benchkit.Drained(ctx, db, "event_queue")
		if err != nil || drained {
			return err
		}
		select {
		case <-ch.Exited():
			return fmt.Errorf("the relay %w", ch.ExitedEarly("the table drained"))
		case <-time.After(10 * time.Millisecond):
		}
	}
}
