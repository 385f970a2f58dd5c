package sqlitedb_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// readOnlyChild names the database a re-run of this test binary opens
// read-only, as a user who may read it but not write its directory.
const readOnlyChild = "SQLITEDB_TEST_READ_ONLY_OPEN"

func TestMain(m *testing.M) {
	if path := os.Getenv(readOnlyChild); path != "" {
		s, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: time.Second, ReadOnly: true})
		if err == nil {
			var n int
			err = s.Reader().QueryRow(`SELECT count(*) FROM event_queue`).Scan(&n)
			s.Close()
			if err == nil {
				fmt.Printf("ok: %d rows\n", n)
				os.Exit(0)
			}
		}
		fmt.Printf("error: %v\n", err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// openAsReader opens the database at path read-only in another process,
// as a user who may read the file but not write its directory, and
// returns what it printed. Run as root (which no permission stops), it
// runs a copy of this test binary as nobody (uid 65534) and opens the
// directories on the way for reading; run as another user, it takes the
// write permission off the directory for the while.
func openAsReader(t *testing.T, path string) string {
	t.Helper()
	dir := filepath.Dir(path)
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		cred = &syscall.Credential{Uid: 65534, Gid: 65534}
		// t.TempDir's parent is private to its owner.
		for _, d := range []string{filepath.Dir(dir), dir} {
			if err := os.Chmod(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		bin = copyExecutable(t, bin, dir)
	} else {
		if err := os.Chmod(dir, 0o555); err != nil {
			t.Fatal(err)
		}
		defer os.Chmod(dir, 0o755)
	}
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), readOnlyChild+"="+path)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	out, err := cmd.CombinedOutput()
	if err != nil {
		if cred != nil && strings.Contains(err.Error(), "operation not permitted") {
			t.Skipf("cannot run a process as nobody here: %v", err)
		}
		t.Fatalf("read-only open in another process: %v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// copyExecutable copies the binary at bin to a directory anyone may read
// beside dir (the go tool builds tests in a private one).
func copyExecutable(t *testing.T, bin, dir string) string {
	t.Helper()
	binDir := filepath.Join(filepath.Dir(dir), "bin")
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(binDir, "sqlitedb.test")
	if _, err := os.Stat(dst); err == nil {
		return dst
	}
	src, err := os.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, src); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return dst
}

// TestReadOnlyUserOpensAWALDatabase: a user who may read the database but
// not write its directory can only read a database in WAL mode while its
// -wal and -shm files exist. The relay leaves them in place when it closes
// the database last, so status works after migrate or after the relay
// stopped; where the application closed it last (its SQLite removes
// them), the error says why and what to do.
func TestReadOnlyUserOpensAWALDatabase(t *testing.T) {
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertRows(t, app, 3, "pending")
	app.Close() // the last to close: its SQLite removes the -wal and -shm files
	s := testenv.OpenDB(t, path)
	s.Close() // now the relay's handle is the last to close
	for _, suffix := range []string{"-wal", "-shm"} {
		if _, err := os.Stat(path + suffix); err != nil {
			t.Fatalf("the relay closed the database last and left no %s file: %v", suffix, err)
		}
	}
	if fi, _ := os.Stat(path + "-wal"); fi.Size() != 0 {
		t.Errorf("the relay closed the database last and left %d bytes in its -wal file; want it copied into the database and emptied", fi.Size())
	}
	if out := openAsReader(t, path); out != "ok: 3 rows" {
		t.Fatalf("read-only open after the relay closed the database: %s", out)
	}
}

// TestReadOnlyUserWithoutWALFiles: the application closed the database
// last, and its SQLite removed the -wal and -shm files: the read-only open
// fails, saying which files are missing and what to do.
func TestReadOnlyUserWithoutWALFiles(t *testing.T) {
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertRows(t, app, 1, "pending")
	app.Close()
	if _, err := os.Stat(path + "-shm"); err == nil {
		t.Fatal("the application's SQLite left its -shm file")
	}
	out := openAsReader(t, path)
	for _, want := range []string{"error: open database " + path, "WAL mode", "neither exists", "may not create them in " + filepath.Dir(path), "while the relay or the application has the database open"} {
		if !strings.Contains(out, want) {
			t.Errorf("read-only open without -wal and -shm: %s\nwant %q in it", out, want)
		}
	}
}
