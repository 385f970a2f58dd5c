package main

import (
	"context"
	"io"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
)

// fleetLockWait is how long the fleet summary waits for a file held
// locked against readers: long enough for the locks that last
// milliseconds, short enough that a file an application keeps locked is
// reported on its line rather than holding up the others.
const fleetLockWait = time.Second

// fleetStatus is status without --db on a fleet: one line a file, worst
// first. A file that cannot be read (not a database, no outbox table,
// locked) is reported on its line and does not fail the command: the
// summary is how an operator finds it.
func (c *cli) fleetStatus(ctx context.Context, cfg config.Config, stream, asJSON bool) error {
	paths, err := fleet.Files(cfg.Database.Path)
	if err != nil {
		return err
	}
	r := admin.FleetReport{Pattern: cfg.Database.Path, Table: cfg.Database.Table, Count: len(paths), Files: []admin.FleetFile{},
		Detailed: "one file's detail: status --db TENANT"}
	for _, path := range paths {
		f := c.fleetFile(ctx, cfg, path)
		if f.Error != "" {
			r.Unread++
		}
		r.Files = append(r.Files, f)
	}
	admin.SortFleet(r.Files)
	if stream {
		if r.Window, err = c.streamWindow(ctx); err != nil {
			return err
		}
	}
	return c.output(asJSON, r, func(w io.Writer) { r.Print(w) })
}

// fleetFile reads the summary line of one file of the fleet: opened
// read-only, so that nothing is created or changed, and closed before
// the next is opened, so that a large fleet holds one file at a time.
func (c *cli) fleetFile(ctx context.Context, cfg config.Config, path string) admin.FleetFile {
	f := admin.FleetFile{Tenant: fleet.Tenant(path), Path: absolute(path)}
	d := cfg.Database
	d.Path = path
	s, err := openFile(ctx, d, true, fleetLockWait, nil, admin.StatusTables...)
	if err != nil {
		f.Error = err.Error()
		return f
	}
	defer s.Close()
	st, err := admin.ReadStatus(ctx, s, admin.StatusOptions{Parks: cfg.Ordering.Parks(), StaleAfter: relayStaleAfter})
	if err != nil {
		f.Error = err.Error()
		return f
	}
	return admin.FleetFileOf(f.Tenant, f.Path, st, time.Now())
}
