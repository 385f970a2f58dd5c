package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/housekeeping"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// fleetHarness is a relay serving a directory of tenant files, as
// outbox-relay run serves a database.path pattern.
type fleetHarness struct {
	dir    string
	url    string // of its /readyz
	logs   *observer.ObservedLogs
	cancel context.CancelFunc
	done   chan error
}

func startFleet(t *testing.T, dir, natsURL string, idleAfter time.Duration) *fleetHarness {
	t.Helper()
	return startFleetWith(t, dir, natsURL, idleAfter, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto // a new file is given the table
	})
}

// startFleetWith starts a fleet on dir/*.db whose files close after
// idleAfter idle (0: the default), with the configuration edit changed,
// and the test hooks too.
func startFleetWith(t *testing.T, dir, natsURL string, idleAfter time.Duration, edit func(*config.Config), hooks ...func(*daemon.TestHooks)) *fleetHarness {
	t.Helper()
	return startFleetOptions(t, dir, natsURL, idleAfter, edit, daemon.Options{}, hooks...)
}

// startFleetOptions is startFleetWith with the fleet's options oo (its
// version, listener and test hooks are the harness's).
func startFleetOptions(t *testing.T, dir, natsURL string, idleAfter time.Duration, edit func(*config.Config), oo daemon.Options, hooks ...func(*daemon.TestHooks)) *fleetHarness {
	t.Helper()
	cfg := harnessConfig(filepath.Join(dir, "*.db"), natsURL, harnessOptions{})
	cfg.Stream.SubjectTemplate = "{tenant}.{event_type}"
	edit(&cfg)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.DebugLevel)
	th := &daemon.TestHooks{IdleAfter: idleAfter, Tune: func(o *relay.Options, k *housekeeping.Options) {
		o.HeartbeatInterval, o.StaleAfter = 100*time.Millisecond, 2*time.Second
		k.StatsInterval = 50 * time.Millisecond
	}}
	for _, h := range hooks {
		h(th)
	}
	oo.Version, oo.Listener, oo.Test = "test", ln, th
	f, err := daemon.OpenFleet(context.Background(), cfg, zap.New(core), oo)
	if err != nil {
		t.Fatal(err)
	}
	h := &fleetHarness{dir: dir, url: "http://" + ln.Addr().String() + "/readyz", logs: logs, done: make(chan error, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-h.done; err != nil {
			t.Errorf("fleet run: %v", err)
		}
		f.Close()
		if t.Failed() {
			for _, e := range logs.All() {
				t.Logf("%s %s %s %v", e.Time.Format("15:04:05.000"), e.Level, e.Message, e.ContextMap())
			}
		}
	})
	return h
}

// waitMetrics waits until /metrics holds every one of the samples want.
func (h *fleetHarness) waitMetrics(t *testing.T, want ...string) string {
	t.Helper()
	url := strings.TrimSuffix(h.url, "/readyz") + "/metrics"
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		missing := ""
		for _, w := range want {
			if !strings.Contains(string(body), w+"\n") {
				missing = w
				break
			}
		}
		if missing == "" {
			return string(body)
		}
		if time.Now().After(deadline) {
			t.Fatalf("/metrics has no %q", missing)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// readyz returns /readyz's status and body.
func (h *fleetHarness) readyz(t *testing.T) (int, string) {
	t.Helper()
	resp, err := http.Get(h.url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// waitReadyz waits until /readyz answers 200 with a body holding every
// one of want.
func (h *fleetHarness) waitReadyz(t *testing.T, want ...string) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, body := h.readyz(t)
		ok := code == http.StatusOK
		for _, w := range want {
			ok = ok && strings.Contains(body, w)
		}
		if ok {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz %d %q, want 200 holding %q", code, body, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// tenantFile creates dir/name.db with the outbox table, the way an
// application's migration does, and n keyed rows in it.
func tenantFile(t *testing.T, dir, name string, n int) *sql.DB {
	t.Helper()
	db := testenv.AppDB(t, filepath.Join(dir, name+".db"))
	// IF NOT EXISTS: a fleet in schema.mode auto may have given a file
	// created while it runs the table first (docs/operations.md).
	testenv.MustExec(t, db, `CREATE TABLE IF NOT EXISTS event_queue (
	id INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL UNIQUE, event_type TEXT NOT NULL,
	payload BLOB NOT NULL, status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
	created_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
	claimed_at INTEGER, claimed_by TEXT, published_at INTEGER, last_error TEXT, ordering_key TEXT)`)
	insertKeyed(t, db, name, n)
	return db
}

// notADatabase writes a file at path that SQLite cannot open.
func notADatabase(t *testing.T, path string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(strings.Repeat("not a database ", 300)), 0o600); err != nil {
		t.Fatal(err)
	}
}

// insertKeyed inserts n rows of ordering key "k", one transaction each.
func insertKeyed(t *testing.T, db *sql.DB, tenant string, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		e := testenv.NewEvent("order.placed", []byte(tenant))
		e.OrderingKey = "k"
		if err := testenv.Insert(db, e); err != nil {
			t.Fatal(err)
		}
	}
}

// waitDone waits until rows rows of db are done.
func waitDone(t *testing.T, db *sql.DB, rows int) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("%d rows done", rows), func() bool {
		return testenv.Counts(t, db)["done"] == rows
	})
}

// TestFleetServesFilesAsTheyComeAndGo: one relay on a directory serves the
// files there at start, a file created while it runs, lets go of a removed
// one and serves a file replaced by a restored backup as a new file (the
// backup's rows, published already, are reconciled, not published again).
// A file that is not a database is named in /readyz, and the others are
// served meanwhile. Every row of every file is in the stream once, on its
// tenant's subject with its Outbox-Tenant, each key's rows in order.
func TestFleetServesFilesAsTheyComeAndGo(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 40)
	globex := tenantFile(t, dir, "globex", 30)
	notADatabase(t, filepath.Join(dir, "broken.db"))
	backup := filepath.Join(t.TempDir(), "acme-backup.db")
	testenv.MustExec(t, acme, `VACUUM INTO ?`, backup) // all 40 pending in it
	h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto // a new file is given the table
		cfg.Metrics.TenantLabel = true
	})
	waitDone(t, acme, 40)
	waitDone(t, globex, 30)
	h.waitReadyz(t, "serving 2 database files", "leading 2", "broken (")

	initech := tenantFile(t, dir, "initech", 25) // created while it runs
	waitDone(t, initech, 25)

	// globex leaves: its file is removed, and later rows in it (written
	// by a connection still open) are not published.
	for _, suffix := range []string{"", "-wal", "-shm"} {
		os.Remove(filepath.Join(dir, "globex.db"+suffix))
	}
	h.waitReadyz(t, "serving 2 database files")
	insertKeyed(t, globex, "globex", 5)
	if body := h.waitMetrics(t, `outbox_relay_tenant_backlog_rows{status="pending",tenant="initech"} 0`); strings.Contains(body, `tenant="globex"`) {
		t.Errorf("/metrics still has the removed file's tenant")
	}

	// acme is restored from the backup taken before anything was
	// published: its rows are found in the stream and settled.
	acme.Close()
	for _, suffix := range []string{"-wal", "-shm"} {
		os.Remove(filepath.Join(dir, "acme.db"+suffix))
	}
	if err := os.Rename(backup, filepath.Join(dir, "acme.db")); err != nil {
		t.Fatal(err)
	}
	acme = testenv.AppDB(t, filepath.Join(dir, "acme.db"))
	insertKeyed(t, acme, "acme", 10)
	waitDone(t, acme, 50)
	if got := logCountOf(h.logs, "database file replaced; serving the new one"); got != 1 {
		t.Errorf("%d replacement log lines, want 1", got)
		dumpLogs(t, h.logs)
	}

	checkFleetStream(t, n, map[string]int{"acme": 50, "globex": 30, "initech": 25})
}

// TestFleetReconcilesTheStreamOnce: a fleet's first files start together
// on a server without the stream. One of them reconciles it (creating it);
// the others wait for that and find the stream there, so the fleet says
// once that it created the stream, and every file's rows are published.
func TestFleetReconcilesTheStreamOnce(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	var dbs []*sql.DB
	for _, tenant := range strings.Fields("a b c d e f g h i j k l m n o p") {
		dbs = append(dbs, tenantFile(t, dir, tenant, 1))
	}
	h := startFleet(t, dir, n.URL(), 0)
	for _, db := range dbs {
		waitDone(t, db, 1)
	}
	if got := logCountOf(h.logs, "created stream"); got != 1 {
		t.Errorf("%d log lines say the stream was created, want 1", got)
	}
}

// TestSharedSubjectsAreWarnedOf: a fleet whose template does not give
// each tenant subjects of their own serves its files, and says once what
// that costs; with the tenant first it says nothing, nor in core NATS
// mode, where no reconciliation reads the stream.
func TestSharedSubjectsAreWarnedOf(t *testing.T) {
	n := testenv.StartNATS(t)
	for _, tc := range []struct {
		template, mode string
		warned         int
	}{
		{"{event_type}", config.ModeJetStream, 1},
		{"{event_type}.{tenant}", config.ModeJetStream, 1},
		{"{tenant}.{event_type}", config.ModeJetStream, 0},
		{"{event_type}", config.ModeCore, 0},
	} {
		t.Run(tc.template+" "+tc.mode, func(t *testing.T) {
			dir := t.TempDir()
			a, b := tenantFile(t, dir, "a", 1), tenantFile(t, dir, "b", 1)
			h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) {
				cfg.Schema.Mode = config.SchemaAuto
				cfg.NATS.Mode = tc.mode
				cfg.Stream.SubjectTemplate = tc.template
				cfg.Stream.Name = "EVENTS_" + strings.NewReplacer("{", "", "}", "", ".", "_").Replace(tc.template+"_"+tc.mode)
				cfg.Stream.SubjectPrefix = strings.ToLower(cfg.Stream.Name)
				cfg.Stream.Subjects = []string{cfg.Stream.SubjectPrefix + ".>"}
			})
			waitDone(t, a, 1)
			waitDone(t, b, 1)
			if got := h.logs.FilterMessageSnippet("the tenants share subjects").Len(); got != tc.warned {
				t.Errorf("%d warnings that the tenants share subjects, want %d", got, tc.warned)
			}
		})
	}
}

// TestNewFilesAreFoundByTheirNotifications: with the fleet's periodic
// rescans and retries an hour apart, the directory's notifications alone
// bring a file moved in to be served (its rows, written elsewhere, are
// published) and a removed file to be let go. How soon is for bench
// --fleet to measure (its new files).
func TestNewFilesAreFoundByTheirNotifications(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 2)
	migrate(t, dir, "acme")
	h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaVerify
	}, func(th *daemon.TestHooks) { th.Rescan = time.Hour })
	waitDone(t, acme, 2)
	h.waitReadyz(t, "serving 1 database files")

	elsewhere := t.TempDir()
	globex := tenantFile(t, elsewhere, "globex", 3)
	migrate(t, elsewhere, "globex")
	globex.Close() // its last connection: the WAL is checkpointed into the file and removed
	if err := os.Rename(filepath.Join(elsewhere, "globex.db"), filepath.Join(dir, "globex.db")); err != nil {
		t.Fatal(err)
	}
	globex = testenv.AppDB(t, filepath.Join(dir, "globex.db"))
	waitDone(t, globex, 3)
	h.waitReadyz(t, "serving 2 database files")

	acme.Close()
	for _, suffix := range []string{"", "-wal", "-shm"} {
		os.Remove(filepath.Join(dir, "acme.db"+suffix))
	}
	h.waitReadyz(t, "serving 1 database files")
	checkFleetStream(t, n, map[string]int{"acme": 2, "globex": 3})
}

// TestFileMendedWhileTriedIsTriedAgain: a file's try fails (its outbox
// table lacks the relay's columns) and its application mends it (runs the
// migration) before the fleet takes note, so that the write's notification
// came while the file was being tried: the fleet tries it again at once,
// not at its next periodic retry (an hour away here).
func TestFileMendedWhileTriedIsTriedAgain(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	initech := tenantFile(t, dir, "initech", 2)
	path := filepath.Join(dir, "initech.db")
	var once sync.Once
	startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaVerify
	}, func(th *daemon.TestHooks) {
		th.Rescan = time.Hour
		th.Tried = func(p string, err error) {
			if p != path || err == nil {
				return
			}
			once.Do(func() {
				// Not the test's goroutine: errors, not t.Fatal.
				s, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second})
				if err != nil {
					t.Errorf("open %s: %v", path, err)
					return
				}
				defer s.Close()
				if _, err := schema.Migrate(context.Background(), s); err != nil {
					t.Errorf("migrate: %v", err)
				}
			})
		}
	})
	waitDone(t, initech, 2)
	checkFleetStream(t, n, map[string]int{"initech": 2})
}

// checkFleetStream checks that the stream holds want[tenant] messages of
// each tenant and no other's, each event once, on its tenant's subject with
// its Outbox-Tenant and the tenant as payload, each tenant's rows (one key)
// in order.
func checkFleetStream(t *testing.T, n *testenv.NATS, want map[string]int) {
	t.Helper()
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	perTenant := map[string][]int64{}
	seen := map[string]bool{}
	for _, m := range msgs {
		id, tenant := m.Header.Get(publish.HeaderMsgID), m.Header.Get(publish.HeaderTenant)
		if seen[id] {
			t.Errorf("event %s stored twice", id)
		}
		seen[id] = true
		if want := "events." + tenant + ".order.placed"; m.Subject != want || string(m.Data) != tenant {
			t.Errorf("message on %s with tenant %q and payload %q, want subject %s", m.Subject, tenant, m.Data, want)
		}
		row, _ := strconv.ParseInt(m.Header.Get(publish.HeaderRowID), 10, 64)
		perTenant[tenant] = append(perTenant[tenant], row)
	}
	for tenant, want := range want {
		rows := perTenant[tenant]
		if len(rows) != want {
			t.Errorf("%s: %d messages, want %d", tenant, len(rows), want)
		}
		for i := 1; i < len(rows); i++ {
			if rows[i] <= rows[i-1] {
				t.Errorf("%s: row %d stored after row %d: key k out of order", tenant, rows[i], rows[i-1])
			}
		}
	}
	if len(perTenant) != len(want) {
		t.Errorf("tenants in the stream: %d, want %d", len(perTenant), len(want))
	}
}

// migrate gives the tenants' files in dir the relay's tables, as
// outbox-relay migrate does before a relay in schema.mode verify starts.
func migrate(t *testing.T, dir string, tenants ...string) {
	t.Helper()
	for _, tenant := range tenants {
		path := filepath.Join(dir, tenant+".db")
		s := testenv.OpenDB(t, path)
		if _, err := schema.Migrate(context.Background(), s); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		s.Close()
	}
}

func logCountOf(logs *observer.ObservedLogs, msg string) int {
	return logs.FilterMessage(msg).Len()
}

func dumpLogs(t *testing.T, logs *observer.ObservedLogs) {
	for _, e := range logs.All() {
		t.Log(e.Message, e.ContextMap())
	}
}

// TestIdleFilesCloseAndWakeOnTheirCommits: files idle for IdleAfter are
// closed (no connection, heartbeat or goroutine of theirs); a commit to
// one opens it again and its row is published, and a file whose next row
// is due later (a retry's backoff) is opened when it comes due. Each
// start is counted in fleet_file_start_seconds.
func TestIdleFilesCloseAndWakeOnTheirCommits(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	dbs := map[string]*sql.DB{}
	for _, name := range []string{"acme", "globex", "initech"} {
		dbs[name] = tenantFile(t, dir, name, 3)
	}
	// A row of initech's due in 2 s, as a retry in its backoff is.
	testenv.MustExec(t, dbs["initech"], `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES ('later', 'order.placed', 'initech', ?)`,
		time.Now().Add(2*time.Second).UnixMilli())
	// And a dead letter of acme's, which stays counted while acme is closed.
	testenv.MustExec(t, dbs["acme"], `INSERT INTO event_queue (event_id, event_type, payload, status) VALUES ('dead', 'order.placed', 'acme', 'dead_lettered')`)
	h := startFleet(t, dir, n.URL(), 300*time.Millisecond)
	for _, db := range dbs {
		waitDone(t, db, 3)
	}
	waitDone(t, dbs["initech"], 4) // opened again when its row came due, if it was closed meanwhile
	h.waitReadyz(t, ": 0 open (leading 0), 3 idle")
	body := h.waitMetrics(t, `outbox_relay_fleet_files{state="idle"} 3`, `outbox_relay_fleet_files{state="open"} 0`,
		`outbox_relay_backlog_rows{status="dead_lettered"} 1`, `outbox_relay_backlog_rows{status="pending"} 0`, `outbox_relay_leader 0`)
	const starts = "outbox_relay_fleet_file_start_seconds_count"
	before := sampleOf(t, body, starts)
	if before < 3 {
		t.Errorf("%s %v after three files were served", starts, before)
	}

	insertKeyed(t, dbs["globex"], "globex", 1)
	waitDone(t, dbs["globex"], 4)
	h.waitReadyz(t, ": 0 open (leading 0), 3 idle") // and closed again
	body = h.waitMetrics(t)
	if strings.Contains(body, "tenant=") {
		t.Errorf("/metrics has a tenant label without metrics.tenant_label")
	}
	if after := sampleOf(t, body, starts); after != before+1 {
		t.Errorf("%s %v after one file was woken, %v before", starts, after, before)
	}
	if got := len(testenv.StreamMessages(t, n.JetStream(t), "EVENTS")); got != 11 {
		t.Fatalf("%d messages, want 11", got)
	}
}

// TestBrokenFilesAffectOnlyThemselves: among healthy files, one is held
// locked by its application (its write lock, rows due meanwhile), one
// is not a database, one lacks the outbox table (schema.mode verify) and
// one's name cannot be a subject's token.
// The healthy files' rows are published while the lock is held, /readyz
// stays ready and names the three, and once the lock is let go the
// locked file's rows are published too.
func TestBrokenFilesAffectOnlyThemselves(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	healthy := map[string]*sql.DB{}
	for _, name := range []string{"acme", "globex", "initech", "umbrella"} {
		healthy[name] = tenantFile(t, dir, name, 5)
	}
	migrate(t, dir, "acme", "globex", "initech", "umbrella")
	locked := healthy["umbrella"]
	delete(healthy, "umbrella")
	notADatabase(t, filepath.Join(dir, "corrupt.db"))
	testenv.MustExec(t, testenv.AppDB(t, filepath.Join(dir, "bare.db")), `CREATE TABLE notes (body TEXT)`)
	tenantFile(t, dir, "acme.corp", 1) // its tenant cannot be a subject token
	migrate(t, dir, "acme.corp")
	h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaVerify
		cfg.Database.BusyTimeout = time.Second
	})
	waitDone(t, locked, 5)
	for _, db := range healthy {
		waitDone(t, db, 5)
	}

	// Three rows come due while the application holds the file's write
	// lock: the relay publishes them and cannot settle them.
	for i := 0; i < 3; i++ {
		testenv.MustExec(t, locked, `INSERT INTO event_queue (event_id, event_type, payload, available_at) VALUES (?, 'order.placed', 'umbrella', ?)`,
			fmt.Sprint("later-", i), time.Now().Add(1500*time.Millisecond).UnixMilli())
	}
	hold, err := locked.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hold.ExecContext(context.Background(), `BEGIN IMMEDIATE`); err != nil {
		t.Fatal(err)
	}
	defer hold.Close()

	for name, db := range healthy {
		insertKeyed(t, db, name, 5)
	}
	for _, db := range healthy {
		waitDone(t, db, 10) // while the lock is held
	}
	body := h.waitReadyz(t, "umbrella (", "corrupt (", "bare (", `tenant "acme.corp" cannot be a subject token`)
	t.Logf("/readyz: %s", body)
	if strings.Contains(body, "acme (") || strings.Contains(body, "globex (") {
		t.Errorf("/readyz names a healthy file in trouble: %s", body)
	}

	if _, err := hold.ExecContext(context.Background(), `ROLLBACK`); err != nil {
		t.Fatal(err)
	}
	hold.Close()
	waitDone(t, locked, 8)
	for deadline := time.Now().Add(20 * time.Second); strings.Contains(h.waitReadyz(t), "umbrella ("); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("/readyz still names the file that was locked: %s", h.waitReadyz(t))
		}
	}
	if got := len(testenv.StreamMessages(t, n.JetStream(t), "EVENTS")); got != 3*10+8 {
		t.Errorf("%d messages, want %d", got, 3*10+8)
	}
}

// TestTwoFleetsOnOneDirectory: two relays serve one directory. Each file
// is led by one of them, every row is published once, and once the files
// are idle both close them all: the relays' heartbeats, commits to each
// other, do not keep a file open. A later commit opens the file again in
// both, and its row is published once.
func TestTwoFleetsOnOneDirectory(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	dbs := map[string]*sql.DB{}
	for _, name := range []string{"acme", "globex", "initech"} {
		dbs[name] = tenantFile(t, dir, name, 20)
	}
	a := startFleet(t, dir, n.URL(), 300*time.Millisecond)
	b := startFleet(t, dir, n.URL(), 300*time.Millisecond)
	for name, db := range dbs {
		insertKeyed(t, db, name, 10) // while both run
	}
	for _, db := range dbs {
		waitDone(t, db, 30)
	}
	for _, h := range []*fleetHarness{a, b} {
		h.waitReadyz(t, ": 0 open (leading 0), 3 idle")
	}
	insertKeyed(t, dbs["globex"], "globex", 1)
	waitDone(t, dbs["globex"], 31)
	for _, h := range []*fleetHarness{a, b} {
		h.waitReadyz(t, ": 0 open (leading 0), 3 idle")
	}
	seen := map[string]bool{}
	for _, m := range testenv.StreamMessages(t, n.JetStream(t), "EVENTS") {
		id := m.Header.Get(publish.HeaderMsgID)
		if seen[id] {
			t.Errorf("event %s stored twice", id)
		}
		seen[id] = true
	}
	if len(seen) != 91 {
		t.Errorf("%d events in the stream, want 91", len(seen))
	}
}

// TestFilesTheirApplicationClosedStayClosed: files whose application
// closed its last connection (SQLite then removes the -wal and -shm) and
// which have nothing due are not opened at start; one whose row is due
// is, and its row is published.
func TestFilesTheirApplicationClosedStayClosed(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	for _, name := range []string{"acme", "globex", "initech"} {
		tenantFile(t, dir, name, 0).Close()
	}
	migrate(t, dir, "acme", "globex", "initech")
	for _, name := range []string{"acme", "globex", "initech"} {
		db := testenv.AppDB(t, filepath.Join(dir, name+".db"))
		insertKeyed(t, db, name, 2)
		testenv.MustExec(t, db, `UPDATE event_queue SET status = 'done'`) // nothing pending...
		if name == "initech" {
			insertKeyed(t, db, name, 1) // ... but initech's new row
		}
		db.Close()
	}
	for _, name := range []string{"acme", "globex", "initech"} {
		if _, err := os.Stat(filepath.Join(dir, name+".db-wal")); !os.IsNotExist(err) {
			t.Fatalf("%s.db-wal is there (%v): the test needs files their application closed", name, err)
		}
	}
	h := startFleet(t, dir, n.URL(), time.Minute)
	waitDone(t, testenv.AppDB(t, filepath.Join(dir, "initech.db")), 3)
	h.waitReadyz(t, ": 1 open (leading 1), 2 idle")
}

// TestFleetCounterSeriesStartAtZero: a fleet whose files are all closed
// (here, none yet) has the series of its known label values at 0, as a
// single file's relay has them, so that rate() and alerts see the first
// increase.
func TestFleetCounterSeriesStartAtZero(t *testing.T) {
	h := startFleet(t, t.TempDir(), testenv.StartNATS(t).URL(), 0)
	h.waitMetrics(t, `outbox_relay_stream_config_patched_total{field="duplicate_window"} 0`, `outbox_relay_stream_config_patched_total{field="ack_wait"} 0`,
		`outbox_relay_deferred_total{reason="atomic_groups_held"} 0`, `outbox_relay_deferred_total{reason="outage"} 0`)
}

// TestFleetBrokerConnected: broker_connected is the fleet's, with every
// file closed too: 0 while the broker is down (a row committed meanwhile
// opens its file, paused without spending an attempt), 1 once it is back
// and the row published.
func TestFleetBrokerConnected(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 1)
	globex := tenantFile(t, dir, "globex", 1)
	h := startFleet(t, dir, n.URL(), 300*time.Millisecond)
	// Served and closed again: before its first looks, the fleet counts
	// both files idle too.
	waitDone(t, acme, 1)
	waitDone(t, globex, 1)
	h.waitReadyz(t, ": 0 open (leading 0), 2 idle")
	h.waitMetrics(t, `outbox_relay_broker_connected 1`)

	n.Stop()
	h.waitMetrics(t, `outbox_relay_broker_connected 0`)
	insertKeyed(t, acme, "acme", 1)
	h.waitMetrics(t, `outbox_relay_fleet_files{state="open"} 1`, `outbox_relay_broker_connected 0`)
	n.Restart()
	waitDone(t, acme, 2)
	h.waitMetrics(t, `outbox_relay_broker_connected 1`)
	var attempts int
	if err := acme.QueryRow(`SELECT max(attempts) FROM event_queue`).Scan(&attempts); err != nil || attempts != 0 {
		t.Errorf("attempts %d (%v): the outage spent attempts", attempts, err)
	}
}

// TestFleetFilesShareOneConnection: every file a fleet serves publishes on
// the fleet's one broker connection: with four files open and leading, and
// a fifth created meanwhile, the server has one client.
func TestFleetFilesShareOneConnection(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	dbs := map[string]*sql.DB{}
	for _, name := range []string{"acme", "globex", "initech", "umbrella"} {
		dbs[name] = tenantFile(t, dir, name, 5)
	}
	h := startFleet(t, dir, n.URL(), time.Minute)
	dbs["hooli"] = tenantFile(t, dir, "hooli", 5)
	for _, db := range dbs {
		waitDone(t, db, 5)
	}
	h.waitReadyz(t, ": 5 open (leading 5)")
	if got := n.Srv.NumClients(); got != 1 {
		t.Errorf("%d broker connections with 5 files open, want 1", got)
	}
}
