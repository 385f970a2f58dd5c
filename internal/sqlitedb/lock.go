package sqlitedb

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// lockReportAfter is how long a lock that keeps readers out may last
// before Open says what it waits for: a write in rollback-journal mode, a
// WAL recovery or another connection's last close take milliseconds.
const lockReportAfter = 500 * time.Millisecond

// waitUnlocked runs open until it fails with something other than a lock
// (Busy), for up to wait (negative: until ctx ends). In WAL mode nothing
// keeps a reader out but a connection in exclusive locking mode (or one
// changing the journal mode), and such a lock lasts until that connection
// closes the database: Open waits, as the relay waits for a busy writer,
// and says once what holds the file, and once when it is free again (in
// the log, and to locked when set).
func waitUnlocked(ctx context.Context, path string, wait time.Duration, log *zap.Logger, locked func(error), open func() error) error {
	start := time.Now()
	step := 10 * time.Millisecond
	reported := false
	for {
		err := open()
		if err == nil || !Busy(err) {
			if reported {
				log.Info("database lock released", zap.String("path", path), zap.Duration("after", time.Since(start).Round(time.Millisecond)))
				if locked != nil {
					locked(nil)
				}
			}
			return err
		}
		waited := time.Since(start)
		if wait >= 0 && waited >= wait {
			return fmt.Errorf("%w: %w: %s; gave up after %v", event.ErrBusy, err, describeLock(path), waited.Round(time.Millisecond))
		}
		if !reported && waited >= lockReportAfter {
			reported = true
			holds := describeLock(path)
			log.Warn("database locked against this process; waiting until it is free",
				zap.String("path", path), zap.String("lock", holds))
			if locked != nil {
				locked(fmt.Errorf("%w, waiting until it is free: %s", event.ErrBusy, holds))
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(step):
		}
		step = min(2*step, 250*time.Millisecond)
	}
}

// describeLock says who holds the file at path locked against readers and
// what that means, as far as this host can tell. It must not read the
// file itself: closing any descriptor of it would drop every lock this
// process's own SQLite connections hold on it (POSIX locks belong to the
// process, not to the descriptor).
func describeLock(path string) string {
	who := "another connection"
	if pids := lockHolders(path); len(pids) > 0 {
		names := make([]string, len(pids))
		for i, pid := range pids {
			names[i] = processName(pid)
		}
		who = strings.Join(names, " and ")
	}
	// A writer in rollback-journal mode keeps its journal beside the file;
	// in WAL mode there is none.
	if _, err := os.Stat(path + "-journal"); err == nil {
		return who + " is writing to it in rollback-journal mode, where every write keeps readers out until it commits (the relay needs the file in WAL mode)"
	}
	return who + " keeps it locked against every other connection, as one that set PRAGMA locking_mode=EXCLUSIVE does until it closes the database" +
		" (applications sharing the file with the relay must keep the default, NORMAL)"
}

// processName names a process for a person: its id and command name.
func processName(pid int) string {
	switch pid {
	case os.Getpid():
		return fmt.Sprintf("this process (pid %d)", pid)
	case 0, -1:
		// /proc/locks shows 0 for a process in another PID namespace
		// (another container), -1 for an open-file-description lock.
		return "a process not visible from here (another container?)"
	}
	if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil {
		return fmt.Sprintf("process %d (%s)", pid, strings.TrimSpace(string(comm)))
	}
	return fmt.Sprintf("process %d", pid)
}
