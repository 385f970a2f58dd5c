package daemon_test

import (
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestOpenFilesShareTheFleetsNotifications: the files a fleet holds open
// are told of their commits by the fleet's one notification of the
// directory, not each by one of its own, of which the kernel allows a
// user 128 by default (fs.inotify.max_user_instances): with 20 files
// open the process holds one notification instance more than before the
// fleet started, and a
// commit to each open file is published with the relays' fallback polls
// set to an hour, which only a notification can then wake.
func TestOpenFilesShareTheFleetsNotifications(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	const files = 20
	dbs := make([]*sql.DB, files)
	tenants := make([]string, files)
	for i := range dbs {
		tenants[i] = fmt.Sprintf("t%02d", i)
		dbs[i] = tenantFile(t, dir, tenants[i], 1)
	}
	migrate(t, dir, tenants...)
	before := inotifyInstances(t)
	h := startFleetWith(t, dir, n.URL(), time.Hour, func(*config.Config) {}, func(th *daemon.TestHooks) {
		tune := th.Tune
		th.Tune = func(o *relay.Options, k *housekeeping.Options) {
			tune(o, k)
			o.WatchInterval, o.PollInterval = time.Hour, time.Hour
		}
	})
	for _, db := range dbs {
		waitDone(t, db, 1) // each file's first claim, as it opens
	}
	h.waitReadyz(t, fmt.Sprintf(": %d open (leading %d), 0 idle", files, files))
	if got := inotifyInstances(t); got > before+1 {
		t.Errorf("%d file-system notification instances with %d files open, %d before the fleet started: want the fleet's one more", got, files, before)
	}
	for i, db := range dbs {
		insertKeyed(t, db, tenants[i], 1)
	}
	for _, db := range dbs {
		waitDone(t, db, 2)
	}
}

// inotifyInstances counts the process's inotify file descriptors.
func inotifyInstances(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	count := 0
	for _, fd := range fds {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && target == "anon_inode:inotify" {
			count++
		}
	}
	return count
}

// TestRelativePatternWakesClosedFiles: with database.path a pattern of
// the working directory ("*.db"), a commit to a file closed while idle
// opens it: the directory's notifications name its files as the
// pattern's matches do ("acme.db", not "./acme.db"). The commit comes
// after the looks again that follow the file's closing (10 ms, 250 ms and
// 5 s later), which would otherwise find it.
func TestRelativePatternWakesClosedFiles(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	db := tenantFile(t, dir, "acme", 1)
	migrate(t, dir, "acme")
	t.Chdir(dir)
	h := startFleetWith(t, dir, n.URL(), 300*time.Millisecond, func(cfg *config.Config) { cfg.Database.Path = "*.db" })
	waitDone(t, db, 1)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	time.Sleep(6 * time.Second)
	insertKeyed(t, db, "acme", 1)
	waitDone(t, db, 2)
}
