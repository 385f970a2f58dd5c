package main

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// openDB opens database.path for an operator command (on a fleet, the
// file --db chooses: chooseDB), and checks that it holds the outbox table
// and the relay's tables the command reads (so that a wrong file or table
// is named, with what to do). One that writes in many short transactions
// checkpoints between them itself (see admin.Requeue), outside the lock.
// The configuration it returns has database.path set to the file opened.
func (c *cli) openDB(ctx context.Context, readOnly bool, relayTables ...string) (*sqlitedb.DB, config.Config, error) {
	cfg, err := c.loadConfig()
	if err != nil {
		return nil, cfg, err
	}
	if cfg.Database.Path, err = c.chooseDB(cfg.Database.Path); err != nil {
		return nil, cfg, err
	}
	// A file held locked against readers (an application in
	// locking_mode=EXCLUSIVE) is waited out, saying on stderr who holds it.
	log, err := reportLogger(cfg.Log, c.stderr)
	if err != nil {
		return nil, cfg, err
	}
	s, err := openFile(ctx, cfg.Database, readOnly, -1, log.Named("database"), relayTables...)
	return s, cfg, err
}

// openFile opens the database file d.Path, waiting lockWait for a lock
// that keeps readers out (negative: until ctx ends), and checks that it
// holds the outbox table and relayTables.
func openFile(ctx context.Context, d config.Database, readOnly bool, lockWait time.Duration, log *zap.Logger, relayTables ...string) (*sqlitedb.DB, error) {
	s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: d.Path, Table: d.Table, BusyTimeout: d.BusyTimeout,
		ReadOnly: readOnly, OwnCheckpoints: !readOnly, LockWait: lockWait, Log: log})
	if err != nil {
		return nil, err
	}
	if err := admin.RequireTables(ctx, s, relayTables...); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}
