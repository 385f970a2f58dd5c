package daemon_test

import (
	"database/sql"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestFleetDirectoryReplaced: the tenants' directory is moved away and
// another put in its place (a restore of the whole directory): the relay
// serves the new directory's files, and a commit to one of them, closed
// as idle, opens it as before.
func TestFleetDirectoryReplaced(t *testing.T) {
	root, dir, h, _ := idleTenantsDir(t)

	staged := stagedDir(t, root)
	acme := tenantFile(t, staged, "acme", 0)
	globex := tenantFile(t, staged, "globex", 2)
	swapIn(t, root, dir, staged)
	waitDone(t, globex, 2)
	h.waitReadyz(t, ": 0 open (leading 0), 2 idle")
	// Past the looks that follow a close: only a notification opens
	// acme now.
	time.Sleep(6 * time.Second)
	insertKeyed(t, acme, "acme", 1) // the connection opened in staged: the same file
	waitDone(t, acme, 1)
	if got := logCountOf(h.logs, "database directory replaced; watching the new one"); got != 1 {
		t.Errorf("%d log lines saying the directory was replaced, want 1", got)
	}
}

// TestFleetRestoredDirectoryIsLookedAtFirst: a directory put in place of
// the watched one (a restore of the whole directory) holds files new to
// the relay. Each is looked at for due rows, as the files found at start
// are, and opened only for them, rather than all opened at once: of four
// restored files, only the one with a due row is opened, and its row is
// published.
func TestFleetRestoredDirectoryIsLookedAtFirst(t *testing.T) {
	root, dir, h, acme := idleTenantsDir(t)
	staged := stagedDir(t, root)
	for _, name := range []string{"globex", "initech", "umbrella", "hooli"} {
		testenv.MustExec(t, acme, `VACUUM INTO ?`, filepath.Join(staged, name+".db"))
	}
	hooli := testenv.AppDB(t, filepath.Join(staged, "hooli.db"))
	insertKeyed(t, hooli, "hooli", 1)
	const starts = "outbox_relay_fleet_file_start_seconds_count"
	before := sampleOf(t, h.waitMetrics(t), starts)

	swapIn(t, root, dir, staged)
	waitDone(t, hooli, 2)
	h.waitReadyz(t, ": 0 open (leading 0), 4 idle")
	if after := sampleOf(t, h.waitMetrics(t), starts); after != before+1 {
		t.Errorf("%s went from %v to %v: %v files opened, want only the one with a due row", starts, before, after, after-before)
	}
}

// TestFleetDirectoryRemovedAndRecreated: the tenants' directory is
// removed and made again (a restore by rm -rf and mkdir), which on ext4
// often gives the new one the old one's inode number: the relay watches
// the new one all the same, and a commit to a file in it, closed as idle,
// opens it.
func TestFleetDirectoryRemovedAndRecreated(t *testing.T) {
	_, dir, h, old := idleTenantsDir(t)
	old.Close()
	ino, same := inodeOf(t, dir), false
	for i := 0; i < 500 && !same; i++ { // the same number if the filesystem gives it
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		same = inodeOf(t, dir) == ino
	}
	t.Logf("the new directory has the old one's inode number: %v", same)
	globex := tenantFile(t, dir, "globex", 2)
	waitDone(t, globex, 2)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	time.Sleep(6 * time.Second) // past the looks that follow a close
	insertKeyed(t, globex, "globex", 1)
	waitDone(t, globex, 3)
}

// TestFleetDirectoryMissingIsLookedFor: the tenants' directory is removed
// (a restore by rm -rf, before its mkdir): the relay says so, in its log
// and in /readyz, and serves the directory made again, and the files in
// it, without the periodic look at the directory (an hour apart here),
// which until then was the only thing to find it.
func TestFleetDirectoryMissingIsLookedFor(t *testing.T) {
	dir, h := missingDir(t, nil, nil)
	globex := madeAgain(t, dir)
	if body := h.waitReadyz(t, "serving 1 database files"); strings.Contains(body, "missing") {
		t.Errorf("/readyz %q says the directory is missing once it is back", body)
	}
	if got := logCountOf(h.logs, "the database directory is back; serving its files"); got != 1 {
		t.Errorf("%d log lines saying the directory is back, want 1", got)
	}
	if got := h.logs.FilterMessageSnippet("is missing: no file is served until it is back").Len(); got != 1 {
		t.Errorf("%d log lines saying the directory is missing, want 1", got)
	}
	insertKeyed(t, globex, "globex", 1) // watched: the idle file wakes on its commit
	waitDone(t, globex, 3)
}

// TestFleetDirectoryMadeAgainAsTheRelayLooks: the directory is made again
// after the relay found it missing, as it moves its watch, and before it
// matches the pattern: the match finds it, but nothing watches it yet.
// The relay goes on looking for it until it is watched, and serves it.
func TestFleetDirectoryMadeAgainAsTheRelayLooks(t *testing.T) {
	var mkdir atomic.Pointer[string]
	dir, _ := missingDir(t, nil, func(th *daemon.TestHooks) {
		th.Scanning = func() {
			if d := mkdir.Swap(nil); d != nil {
				if err := os.Mkdir(*d, 0o755); err != nil {
					t.Error(err)
				}
			}
		}
	})
	mkdir.Store(&dir)
	testenv.Eventually(t, 20*time.Second, "the directory made again", func() bool { return mkdir.Load() == nil })
	globex := tenantFile(t, dir, "globex", 2)
	waitDone(t, globex, 2)
}

// TestFleetRelativePatternFollowsItsDirectory: a pattern relative to the
// working directory, the tenants' directory itself (database.path *.db),
// names the directory by its path: removed, it is missing, and the
// directory made again in its place is served. Not parallel: it changes
// the process's working directory.
func TestFleetRelativePatternFollowsItsDirectory(t *testing.T) {
	dir, _ := missingDir(t, func(cfg *config.Config, dir string) {
		t.Chdir(dir)
		cfg.Database.Path = "*.db"
	}, nil)
	madeAgain(t, dir)
}

// TestFleetDirectoryReplacedByAFile: a regular file in the directory's
// place is no directory: the relay says so, and serves the directory that
// takes its place later.
func TestFleetDirectoryReplacedByAFile(t *testing.T) {
	dir, h := missingDir(t, nil, nil)
	if err := os.WriteFile(dir, []byte("not a directory"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.waitReadyz(t, "; the database directory "+dir+" is not a directory")
	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	madeAgain(t, dir)
	h.waitReadyz(t, "serving 1 database files")
}

// missingDir serves a directory of one file, acme's, closed as idle, with
// the periodic look at the directory an hour apart, then removes the
// directory, and returns once /readyz says it is missing.
func missingDir(t *testing.T, edit func(cfg *config.Config, dir string), hooks func(*daemon.TestHooks)) (dir string, h *fleetHarness) {
	t.Helper()
	n := testenv.StartNATS(t)
	dir = filepath.Join(t.TempDir(), "tenants")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	acme := tenantFile(t, dir, "acme", 1)
	h = startFleetWith(t, dir, n.URL(), 300*time.Millisecond, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto // the tenants' files are given the table
		if edit != nil {
			edit(cfg, dir)
		}
	}, func(th *daemon.TestHooks) {
		th.Rescan = time.Hour
		if hooks != nil {
			hooks(th)
		}
	})
	waitDone(t, acme, 1)
	acme.Close()
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	// Past the looks that follow a close: once the directory is found
	// missing, nothing the relay has under way looks at it again.
	time.Sleep(6 * time.Second)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	h.waitReadyz(t, "serving 0 database files", "; the database directory "+dir+" is missing")
	return dir, h
}

// madeAgain makes dir again with a file of two rows, globex's, and waits
// until they are published.
func madeAgain(t *testing.T, dir string) *sql.DB {
	t.Helper()
	if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
		t.Fatal(err)
	}
	globex := tenantFile(t, dir, "globex", 2)
	waitDone(t, globex, 2)
	return globex
}

// TestFleetDirectoryAwayAsItIsWatchedAgain: the directory that replaced
// the watched one is away for a moment as the relay begins to watch it
// (moved away and back, as a restore that makes it again may): the relay
// tries again, watches it, and its closed files still wake on their
// commits rather than all staying open.
func TestFleetDirectoryAwayAsItIsWatchedAgain(t *testing.T) {
	h := awayAsWatched(t, func(*fleetHarness) { time.Sleep(200 * time.Millisecond) })
	if got := logCountOf(h.logs, "database directory replaced; watching the new one"); got != 1 {
		t.Errorf("%d log lines saying the new directory is watched, want 1", got)
	}
}

// TestFleetDirectoryAwayLongerIsWatchedLater: away for longer than the
// relay tries at once, the directory is watched at a later look, and the
// relay's closed files wake on their commits again, rather than every file
// staying open for the life of the process.
func TestFleetDirectoryAwayLongerIsWatchedLater(t *testing.T) {
	const gaveUp = "database directory replaced, and the new one gives no file-system notifications: every file stays open, and new files are found by looking every 5s, when the relay also tries to watch it again"
	h := awayAsWatched(t, func(h *fleetHarness) {
		for logCountOf(h.logs, gaveUp) == 0 {
			time.Sleep(10 * time.Millisecond)
		}
	})
	if got := logCountOf(h.logs, "watching the database directory again: idle files close, and wake on their commits"); got != 1 {
		t.Errorf("%d log lines saying the directory is watched again, want 1", got)
	}
}

// awayAsWatched serves a directory of one file, replaces the directory by
// another of one file, moves that one away as the relay begins to watch it
// and back once away returns, and checks that its file closes idle and
// wakes on a commit.
func awayAsWatched(t *testing.T, away func(*fleetHarness)) *fleetHarness {
	t.Helper()
	n := testenv.StartNATS(t)
	root := t.TempDir()
	dir := filepath.Join(root, "tenants")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	acme := tenantFile(t, dir, "acme", 1)
	var once sync.Once
	started := make(chan *fleetHarness, 1)
	h := startFleetWith(t, dir, n.URL(), 300*time.Millisecond, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto // the tenants' files are given the table
	}, func(th *daemon.TestHooks) {
		th.Rewatch = func() {
			once.Do(func() {
				aside := filepath.Join(root, "away")
				if err := os.Rename(dir, aside); err != nil {
					t.Error(err)
					return
				}
				go func() {
					h := <-started
					away(h)
					if err := os.Rename(aside, dir); err != nil {
						t.Error(err)
					}
				}()
			})
		}
	})
	started <- h
	waitDone(t, acme, 1)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")

	staged := stagedDir(t, root)
	globex := tenantFile(t, staged, "globex", 2)
	swapIn(t, root, dir, staged)
	waitDone(t, globex, 2)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	time.Sleep(6 * time.Second) // past the looks that follow a close
	insertKeyed(t, globex, "globex", 1)
	waitDone(t, globex, 3)
	return h
}

// TestFleetDirectoryReplacedWithItsOwnFiles: the files are moved into a
// new directory that takes the old one's place, and one is written before
// the relay has found the new directory: the commit, notified to no one,
// is found when the relay watches the new directory.
func TestFleetDirectoryReplacedWithItsOwnFiles(t *testing.T) {
	root, dir, _, acme := idleTenantsDir(t)
	acme.Close()                // its checkpoint is a write, which looks follow
	time.Sleep(6 * time.Second) // past them
	staged := stagedDir(t, root)
	for _, suffix := range []string{"", "-wal", "-shm"} {
		if err := os.Rename(filepath.Join(dir, "acme.db"+suffix), filepath.Join(staged, "acme.db"+suffix)); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	swapIn(t, root, dir, staged)
	acme = testenv.AppDB(t, filepath.Join(dir, "acme.db"))
	insertKeyed(t, acme, "acme", 1)
	waitDone(t, acme, 2)
}

// stagedDir makes the directory root/staged, where a test prepares the
// directory that replaces the tenants' one (swapIn).
func stagedDir(t *testing.T, root string) string {
	t.Helper()
	staged := filepath.Join(root, "staged")
	if err := os.Mkdir(staged, 0o755); err != nil {
		t.Fatal(err)
	}
	return staged
}

// swapIn replaces the directory dir by staged, as a restore does: dir is
// moved aside to root/before and staged takes its place.
func swapIn(t *testing.T, root, dir, staged string) {
	t.Helper()
	if err := os.Rename(dir, filepath.Join(root, "before")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(staged, dir); err != nil {
		t.Fatal(err)
	}
}

// idleTenantsDir starts a fleet on root/tenants, whose file acme.db has
// one row, and returns once the row is published and the file closed as
// idle (after 300 ms).
func idleTenantsDir(t *testing.T) (root, dir string, h *fleetHarness, acme *sql.DB) {
	t.Helper()
	n := testenv.StartNATS(t)
	root = t.TempDir()
	dir = filepath.Join(root, "tenants")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	acme = tenantFile(t, dir, "acme", 1)
	h = startFleet(t, dir, n.URL(), 300*time.Millisecond)
	waitDone(t, acme, 1)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	return root, dir, h, acme
}

func inodeOf(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}
