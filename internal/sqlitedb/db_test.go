package sqlitedb_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestOpenMissingDatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "nope.db")
	_, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue"})
	if !errors.Is(err, sqlitedb.ErrNoDatabase) || !strings.Contains(err.Error(), path) {
		t.Fatalf("Open of a missing file = %v; want sqlitedb.ErrNoDatabase naming the path", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatal("Open without Create created the file")
	}
}

func TestOpenNotADatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "junk.db")
	if err := os.WriteFile(path, []byte(strings.Repeat("not sqlite ", 1000)), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue"})
	if err == nil || !strings.Contains(err.Error(), "not a database") {
		t.Fatalf("Open of a junk file = %v; want 'not a database'", err)
	}
}

// startWatch runs Watch with an hour-long fallback poll (only the file
// notification can wake it) and returns once it has seen a commit of db:
// from then on it is watching, whatever the scheduler did.
func startWatch(t *testing.T, s *sqlitedb.DB, db *sql.DB) (wake chan struct{}, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	wake = make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() { done <- s.Watch(ctx, time.Hour, wake) }()
	deadline := time.Now().Add(10 * time.Second)
	for woke := false; !woke; {
		if time.Now().After(deadline) {
			t.Fatal("the watch never woke for a commit")
		}
		testenv.InsertRows(t, db, 1, "pending")
		select {
		case <-wake:
			woke = true
		case <-time.After(50 * time.Millisecond):
		}
	}
	return wake, func() {
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

func TestWatchSeesForeignCommits(t *testing.T) {
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	wake, stop := startWatch(t, s, db)
	defer stop()
	select {
	case <-wake:
		t.Fatal("woke without a commit")
	case <-time.After(200 * time.Millisecond):
	}
	testenv.InsertRows(t, db, 1, "pending")
	select {
	case <-wake:
	case <-time.After(10 * time.Second):
		t.Fatal("no wake-up after a commit")
	}
}

// TestWatchPace: the fallback poll slows once notifications announce
// commits, and speeds up again when the poll finds one they missed.
func TestWatchPace(t *testing.T) {
	p := sqlitedb.NewPace(100 * time.Millisecond)
	steps := []struct {
		notified, polled bool
		next             time.Duration
		change           bool
	}{
		{polled: true}, // untrusted: the poll finding commits changes nothing
		{notified: true, next: time.Second, change: true}, // a notification announced one: trust, slow down
		{notified: true}, // still trusted
		{polled: true, next: 100 * time.Millisecond, change: true}, // one was missed: fast again
		{polled: true},
		{}, // an overflow: no source, no change
		{notified: true, next: time.Second, change: true},
	}
	for i, st := range steps {
		next, change := p.Found(st.notified, st.polled)
		if next != st.next || change != st.change {
			t.Fatalf("step %d: got (%v, %v), want (%v, %v)", i, next, change, st.next, st.change)
		}
	}
}

// TestWatchGathersAFlowOfCommits: a notification that follows the last
// commit found closely (a flow) waits for the commits behind it; one
// after a pause waits only for its own commit's writes, and only when the
// file is served among others (Options.GatherCommitWrites), so that
// sparse commits are announced as soon as they are visible.
func TestWatchGathersAFlowOfCommits(t *testing.T) {
	for _, commitOwn := range []bool{false, true} {
		flow, alone := sqlitedb.Gather(time.Millisecond, commitOwn), sqlitedb.Gather(time.Second, commitOwn)
		if flow <= alone {
			t.Fatalf("gathers %v in a flow and %v alone: a flow should wait longer", flow, alone)
		}
		if flow > 5*time.Millisecond || alone > time.Millisecond {
			t.Fatalf("gathers %v in a flow and %v alone: more than the commit-to-PubAck target allows", flow, alone)
		}
		if (alone > 0) != commitOwn {
			t.Fatalf("a lone commit waits %v with GatherCommitWrites %v", alone, commitOwn)
		}
		for _, gap := range []time.Duration{5 * time.Millisecond, 20 * time.Millisecond} {
			if got := sqlitedb.Gather(gap, commitOwn); got != alone {
				t.Fatalf("%v after a commit gathers %v, want %v as alone: no commit that far behind arrives in the window", gap, got, alone)
			}
		}
	}
}

// TestRecheckIsNotPutOff: a notified look that finds no commit sets a
// recheck 1 ms later; the looks of the same commit's other WAL writes,
// also too early, leave it pending rather than doubling it (which made a
// commit wait up to 8 ms for a look once the watch stopped waiting for a
// commit's writes); each recheck that finds nothing doubles the wait, up
// to a limit, after which only the poll remains.
func TestRecheckIsNotPutOff(t *testing.T) {
	var pending time.Duration
	step := func(recheck bool, want time.Duration, wantReset bool) {
		t.Helper()
		next, reset := sqlitedb.RecheckAfter(pending, recheck)
		if next != want || reset != wantReset {
			t.Fatalf("after %v pending (recheck %v): %v, reset %v; want %v, reset %v", pending, recheck, next, reset, want, wantReset)
		}
		pending = next
	}
	step(false, time.Millisecond, true)  // the commit's first write
	step(false, time.Millisecond, false) // its second and third
	step(false, time.Millisecond, false)
	for _, want := range []time.Duration{2, 4, 8, 16, 32, 64} {
		step(true, want*time.Millisecond, true)
		step(false, want*time.Millisecond, false)
	}
	step(true, 0, false)                // only the poll remains
	step(false, time.Millisecond, true) // the next notification starts over
}

// TestCheckpointSkipsAnUnchangedWAL: a checkpoint copies the WAL into the
// database; the next one, with nothing committed since, does no work; a
// commit makes the one after it run again.
func TestCheckpointSkipsAnUnchangedWAL(t *testing.T) {
	ctx := context.Background()
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	db.SetMaxOpenConns(1)
	testenv.MustExec(t, db, `PRAGMA wal_autocheckpoint = 0`) // only the store checkpoints
	testenv.InsertRows(t, db, 50, "pending")
	pages, done, err := s.Checkpoint(ctx)
	if err != nil || pages == 0 || done != pages {
		t.Fatalf("checkpoint: %d of %d pages (%v)", done, pages, err)
	}
	ran := sqlitedb.CheckpointedAt(s)
	if p, d, err := s.Checkpoint(ctx); err != nil || p != pages || d != done || !sqlitedb.CheckpointedAt(s).Equal(ran) {
		t.Fatalf("an unchanged WAL was checkpointed again (%d of %d, %v)", d, p, err)
	}
	time.Sleep(20 * time.Millisecond) // past the file system's coarse clock tick
	testenv.InsertRows(t, db, 50, "pending")
	if _, d, err := s.Checkpoint(ctx); err != nil || sqlitedb.CheckpointedAt(s).Equal(ran) || d == 0 {
		t.Fatalf("a commit after the checkpoint was not checkpointed (%d pages, %v)", d, err)
	}
}

// TestWatchSeesSynchronousFullCommits: an application with
// synchronous=FULL syncs the WAL before its commit becomes visible, so the
// file notification comes before the commit can be seen; the watch must
// look again rather than wait for its (here hour-long) poll.
func TestWatchSeesSynchronousFullCommits(t *testing.T) {
	s := testenv.MigratedDB(t)
	db, err := sql.Open("sqlite3", "file:"+s.Path()+"?_busy_timeout=5000&_txlock=immediate&_synchronous=FULL")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	wake, stop := startWatch(t, s, db)
	defer stop()
	for i := range 20 {
		testenv.InsertRows(t, db, 1, "pending")
		select {
		case <-wake:
		case <-time.After(5 * time.Second):
			t.Fatalf("commit %d: no wake-up", i)
		}
	}
}

// TestOpenInAMissingDirectory: migrate creates the file, but not its
// directory; the error says the directory is missing, not that the file
// is not writable.
func TestOpenInAMissingDirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "nope")
	path := filepath.Join(dir, "app.db")
	_, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", Create: true})
	if err == nil || !strings.Contains(err.Error(), "directory "+dir+" does not exist") || errors.Is(err, event.ErrNotWritable) {
		t.Fatalf("Open with Create in a missing directory = %v; want the directory named as missing", err)
	}
	_, err = sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue"})
	if !errors.Is(err, sqlitedb.ErrNoDatabase) || !strings.Contains(err.Error(), "nor does its directory "+dir) {
		t.Fatalf("Open in a missing directory = %v; want sqlitedb.ErrNoDatabase naming the directory", err)
	}
}

// TestOpenNamesTheAbsolutePath: a relative database.path is named in full
// in errors (under systemd the working directory is /), and the store
// keeps the absolute path.
func TestOpenNamesTheAbsolutePath(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	abs := filepath.Join(dir, "app.db")
	_, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: "app.db", Table: "event_queue"})
	if err == nil || !strings.Contains(err.Error(), "open database "+abs+":") {
		t.Fatalf("Open of a missing relative path = %v; want the absolute path %s", err, abs)
	}
	s, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: "./app.db", Table: "event_queue", Create: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Path() != abs {
		t.Fatalf("Path() = %q; want %q", s.Path(), abs)
	}
}

// TestWatchTellsItsOwnCommitsApart: a commit by the DB's own writer (a
// relay's heartbeat, say) is announced to the channels that follow every
// commit, not to the one that follows other connections' commits, so an
// idle relay does not look for rows after each of its own heartbeats.
func TestWatchTellsItsOwnCommitsApart(t *testing.T) {
	s := testenv.MigratedDB(t)
	db := testenv.AppDB(t, s.Path())
	ctx, cancel := context.WithCancel(context.Background())
	foreign, all := make(chan struct{}, 1), make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() { done <- s.Watch(ctx, time.Hour, foreign, all) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}()
	waitFor := func(ch chan struct{}, what string, commit func()) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			commit()
			select {
			case <-ch:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("no wake-up on %s", what)
			}
		}
	}
	appCommit := func() { testenv.InsertRows(t, db, 1, "pending") }
	waitFor(foreign, "the application's commit", appCommit) // watching from here on
	<-all
	ownCommit := func() {
		if _, err := s.Exec(context.Background(), `UPDATE event_queue SET attempts = attempts + 1 WHERE id = 1`); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(all, "the writer's own commit", ownCommit)
	select {
	case <-foreign:
		t.Fatal("the writer's own commit was announced as another connection's")
	default:
	}
	waitFor(foreign, "the application's commit after the writer's", appCommit)
}

// TestOpenOneConnection: a read-only look with OneConnection reads on the
// one connection that opened the file, waits for locks as readers do, and
// closes it.
func TestOpenOneConnection(t *testing.T) {
	path := testenv.NewDB(t)
	s, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 3 * time.Second, ReadOnly: true, OneConnection: true})
	if err != nil {
		t.Fatal(err)
	}
	var n, busy int
	if err := s.Reader().QueryRow(`SELECT count(*) FROM event_queue`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if err := s.Reader().QueryRow(`PRAGMA busy_timeout`).Scan(&busy); err != nil || busy != 3000 {
		t.Fatalf("busy_timeout %d (%v), want the readers' 3000", busy, err)
	}
	if open := s.Reader().Stats().OpenConnections; open != 1 {
		t.Fatalf("%d connections open, want 1", open)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if open := s.Reader().Stats().OpenConnections; open != 0 {
		t.Fatalf("%d connections open after Close", open)
	}
}

// TestReadersKeepSmallPageCaches: the read-only pool's connections read
// many pages once each (the backlog's counts, the reconciliation's
// look-ups), which the kernel caches anyway: their page caches are small.
// The writer's, whose claims and settles come back to the same pages,
// is SQLite's default.
func TestReadersKeepSmallPageCaches(t *testing.T) {
	s := testenv.OpenDB(t, testenv.NewDB(t))
	var reader, writer int
	if err := s.Reader().QueryRow(`PRAGMA cache_size`).Scan(&reader); err != nil {
		t.Fatal(err)
	}
	if err := s.InTx(context.Background(), func(tx *sql.Tx) error {
		return tx.QueryRow(`PRAGMA cache_size`).Scan(&writer)
	}); err != nil {
		t.Fatal(err)
	}
	if reader != -512 || writer != -2000 {
		t.Fatalf("cache_size: readers %d, writer %d; want -512 (512 KiB) and SQLite's default -2000", reader, writer)
	}
}
