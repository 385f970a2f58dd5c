package daemon

import (
	"context"
	"math/rand/v2"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// fleetKeepClosed is how often a file closed while idle is kept: its
// rows past retention deleted and its WAL checkpointed, on a connection
// of the fleet's own (an open file's relay does both itself). A file
// that stays idle for weeks is pruned all the same, and the pass writes
// only what retention deletes: nothing in proportion to the files' number.
const fleetKeepClosed = time.Hour

// keepEvery is fleetKeepClosed, or what a test made it.
func (f *Fleet) keepEvery() time.Duration {
	if f.oo.Test != nil && f.oo.Test.KeepClosed > 0 {
		return f.oo.Test.KeepClosed
	}
	return fleetKeepClosed
}

// park records the file at path as closed while idle, its housekeeping
// due a keepEvery after its relay's last retention pass began; the files
// found idle at start (first) have theirs spread over the first
// keepEvery, rather than all at once. Called with f.mu held.
func (f *Fleet) park(path string, p *parkedFile, first bool) {
	every := f.keepEvery()
	p.keep = f.sweepsOf(path).Last.Add(every)
	if first {
		p.keep = time.Now().Add(rand.N(every))
	}
	f.parked[path] = p
}

// keep runs the housekeeping of the closed file p at path, in a goroutine
// among the looks: retention as its relay runs it (logged and counted
// alike, going on from where the last pass stopped), then a passive
// checkpoint. A file it cannot open or write is tried again a keepEvery
// later; opening it to serve it says why. Called with f.mu held.
func (f *Fleet) keep(ctx context.Context, path string, p *parkedFile) {
	p.keeping = true
	sw := f.sweepsOf(path).Clone() // a commit may open the file meanwhile
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		err := f.keepFile(ctx, path, &sw)
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.parked[path] == p { // else its relay has the file's sweeps
			*f.sweepsOf(path) = sw
		}
		p.keeping, p.keep = false, time.Now().Add(f.keepEvery())
		if err != nil && ctx.Err() == nil {
			f.log.Debug("cannot keep an idle database file; tried again later", zap.String("database", path), zap.Error(err))
		}
	}()
}

// keepFile prunes the file at path from where its sweeps stand, and
// checkpoints it.
func (f *Fleet) keepFile(ctx context.Context, path string, sw *housekeeping.Sweeps) error {
	select {
	case f.looks <- struct{}{}:
		defer func() { <-f.looks }()
	case <-ctx.Done():
		return ctx.Err()
	}
	db, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: f.cfg.Database.Table, BusyTimeout: f.cfg.Database.BusyTimeout})
	if err != nil {
		return err
	}
	defer db.Close()
	tenant := fleet.Tenant(path)
	housekeeping.New(housekeeping.OnFile(db, f.cfg.Ordering.Parks()), housekeeping.Options{
		RetainDone:            f.cfg.Retention.Done,
		RetainProcessedEvents: f.cfg.Retention.ProcessedEvents,
		RetentionInterval:     f.keepEvery(), // how often Retain comes here: Run is not called
		Sweeps:                sw,
		Metrics:               f.fileMetrics,
		Gauges:                f.gaugesOf(path, tenant),
		Log:                   f.log.With(zap.String("tenant", tenant)).Named("relay"),
	}).Retain(ctx)
	_, _, err = db.Checkpoint(ctx)
	return err
}
