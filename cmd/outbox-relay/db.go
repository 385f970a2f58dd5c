package main

import (
	"context"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// openDB opens database.path for an operator command, and checks that it
// holds the outbox table and the relay's tables the command reads (so that
// a wrong file or table is named, with what to do). One that writes in
// many short transactions checkpoints between them itself (see
// admin.Requeue), outside the lock.
func (c *cli) openDB(ctx context.Context, readOnly bool, relayTables ...string) (*sqlitedb.DB, config.Config, error) {
	cfg, err := c.loadConfig()
	if err != nil {
		return nil, cfg, err
	}
	// A file held locked against readers (an application in
	// locking_mode=EXCLUSIVE) is waited out, saying on stderr who holds it.
	log, err := reportLogger(cfg.Log, c.stderr)
	if err != nil {
		return nil, cfg, err
	}
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: cfg.Database.Path, Table: cfg.Database.Table, BusyTimeout: cfg.Database.BusyTimeout,
		ReadOnly: readOnly, OwnCheckpoints: !readOnly, LockWait: -1, Log: log.Named("database")})
	if err != nil {
		return nil, cfg, err
	}
	if err := admin.RequireTables(ctx, s, relayTables...); err != nil {
		s.Close()
		return nil, cfg, err
	}
	return s, cfg, nil
}
