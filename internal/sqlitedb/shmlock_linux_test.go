package sqlitedb_test

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestTheIndexStaysLockedWhileOpen: the relay's reads of the WAL index
// header (a commit watch's, a commit mark's) leave SQLite's locks on the
// -shm file as they were until Close. Closing any descriptor of a file
// drops every POSIX lock the process holds on it, among them the shared
// lock that tells another process's first connection that the index is in
// use and must not be rebuilt under the open connections.
func TestTheIndexStaysLockedWhileOpen(t *testing.T) {
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	_, stop := startWatch(t, s, db)
	if !indexInUse(t, s.Path()) {
		t.Fatal("this process holds no lock on the -shm file while it watches")
	}
	stop()
	if !indexInUse(t, s.Path()) {
		t.Fatal("the watch's end dropped this process's lock on the -shm file; its connections are open")
	}
	if _, ok := s.CommitMark(); !ok {
		t.Fatal("no commit mark")
	}
	if !indexInUse(t, s.Path()) {
		t.Fatal("reading the commit mark dropped this process's lock on the -shm file; its connections are open")
	}
}

// TestOtherUsersLeaveTheIndexLocked: in a process that has a database
// open, neither a commit mark read by path (a fleet's look at a closed
// file) nor another DB of the same file closing (a relay's, beside a
// fleet's pass over the file) drops the open connections' locks on its
// -shm file.
func TestOtherUsersLeaveTheIndexLocked(t *testing.T) {
	s := testenv.MigratedDB(t)
	testenv.MustExec(t, s.Reader(), `SELECT count(*) FROM event_queue`) // its connections lock the -shm file
	if !indexInUse(t, s.Path()) {
		t.Fatal("this process holds no lock on the -shm file while its connections are open")
	}
	if _, ok := sqlitedb.ReadCommitMark(s.Path()); !ok {
		t.Fatal("no commit mark")
	}
	if !indexInUse(t, s.Path()) {
		t.Fatal("reading the commit mark by path dropped the lock of another DB's connections")
	}
	other := testenv.OpenDB(t, s.Path())
	if _, ok := other.CommitMark(); !ok {
		t.Fatal("no commit mark")
	}
	if err := other.Close(); err != nil {
		t.Fatal(err)
	}
	if !indexInUse(t, s.Path()) {
		t.Fatal("closing a DB that read the commit mark dropped the lock of another DB's connections")
	}
}

// indexInUse reports whether this process holds SQLite's "in use" lock on
// the -shm file of the database at path (a shared lock on its byte 128),
// as /proc/locks lists it.
func indexInUse(t *testing.T, path string) bool {
	t.Helper()
	fi, err := os.Stat(path + "-shm")
	if err != nil {
		t.Fatal(err)
	}
	ino := strconv.FormatUint(fi.Sys().(*syscall.Stat_t).Ino, 10)
	locks, err := os.ReadFile("/proc/locks")
	if err != nil {
		t.Fatal(err)
	}
	pid := strconv.Itoa(os.Getpid())
	for line := range strings.Lines(string(locks)) {
		// "1: POSIX  ADVISORY  READ 1234 fe:00:9982397 128 128"
		f := strings.Fields(line)
		if len(f) == 8 && f[1] == "POSIX" && f[4] == pid && strings.HasSuffix(f[5], ":"+ino) && f[6] == "128" {
			return true
		}
	}
	return false
}
