package daemon_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// insertBulk inserts n rows of tenant in transactions of 100, keys k0..k4.
func insertBulk(t *testing.T, db *sql.DB, tenant string, n int) {
	t.Helper()
	for done := 0; done < n; {
		var evs []testenv.Event
		for i := 0; i < 100 && done < n; i++ {
			e := testenv.NewEvent("order.placed", []byte(tenant))
			e.OrderingKey = fmt.Sprint("k", done%5)
			evs = append(evs, e)
			done++
		}
		if err := testenv.Insert(db, evs...); err != nil {
			t.Fatal(err)
		}
	}
}

// streamOnce checks the stream holds want events, each once.
func streamOnce(t *testing.T, n *testenv.NATS, want int) {
	t.Helper()
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	seen := map[string]int{}
	for _, m := range msgs {
		seen[m.Header.Get(publish.HeaderMsgID)]++
	}
	dups := 0
	for _, c := range seen {
		if c > 1 {
			dups++
		}
	}
	if len(seen) != want || dups > 0 {
		t.Errorf("stream holds %d distinct events (%d messages, %d duplicated), want %d once each", len(seen), len(msgs), dups, want)
	}
}

// TestFleetBrokerOutage: backlogs, trickles and an idle file woken
// during an outage of the broker (stopped, then started again on the same
// port). Afterwards every row is published once, no attempt was spent,
// no file is in trouble and every file closes again, with no restart.
func TestFleetBrokerOutage(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	dbs := map[string]*sql.DB{}
	for _, name := range []string{"acme", "globex", "initech", "umbrella", "hooli"} {
		dbs[name] = tenantFile(t, dir, name, 0)
	}
	insertBulk(t, dbs["acme"], "acme", 3000)
	insertBulk(t, dbs["globex"], "globex", 3000)
	insertBulk(t, dbs["hooli"], "hooli", 1)
	h := startFleet(t, dir, n.URL(), 300*time.Millisecond)
	waitDone(t, dbs["hooli"], 1)
	stopI := writeEvery(t, dbs["initech"], "initech", 20*time.Millisecond)
	stopU := writeEvery(t, dbs["umbrella"], "umbrella", 20*time.Millisecond)
	testenv.Eventually(t, 30*time.Second, "acme half-drained", func() bool { return testenv.Counts(t, dbs["acme"])["done"] >= 300 })
	n.Stop()
	h.waitMetrics(t, `outbox_relay_broker_connected 0`)
	insertBulk(t, dbs["hooli"], "hooli", 10) // wakes a closed file during the outage
	time.Sleep(3 * time.Second)              // the outage lasts (not an assertion)
	n.Restart()
	time.Sleep(time.Second)
	wi, wu := stopI(), stopU()
	want := map[string]int{"acme": 3000, "globex": 3000, "hooli": 11, "initech": wi, "umbrella": wu}
	total := 0
	for name, db := range dbs {
		total += want[name]
		testenv.Eventually(t, 60*time.Second, name+" all done", func() bool { return testenv.Counts(t, db)["done"] == want[name] })
		nothingSpent(t, db, name+" after an outage")
	}
	streamOnce(t, n, total)
	body := waitAllClosed(t, h, 5)
	if strings.Contains(body, "trouble") {
		t.Errorf("/readyz: %s", body)
	}
	h.waitMetrics(t, `outbox_relay_broker_connected 1`, `outbox_relay_backlog_rows{status="pending"} 0`, `outbox_relay_backlog_rows{status="processing"} 0`, `outbox_relay_in_flight_rows 0`, `outbox_relay_leader 0`)
	if c := logCountOf(h.logs, "cannot serve this database file"); c > 0 {
		t.Errorf("%d files logged in trouble after a broker outage", c)
	}
}

// TestClosedFileGaugesFollowDiscard: a closed (idle) file's dead
// letters are discarded by the operator (dead-letters discard: a DELETE
// committed to the file). backlog_rows{status="dead_lettered"} and the
// tenant's series should drop to 0; the alert on dead letters clears.
func TestClosedFileGaugesFollowDiscard(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 2)
	testenv.MustExec(t, acme, `INSERT INTO event_queue (event_id, event_type, payload, status) VALUES ('dead', 'order.placed', 'acme', 'dead_lettered')`)
	h := startFleetWith(t, dir, n.URL(), 300*time.Millisecond, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
		cfg.Metrics.TenantLabel = true
	})
	waitDone(t, acme, 2)
	h.waitReadyz(t, ": 0 open (leading 0), 1 idle")
	h.waitMetrics(t, `outbox_relay_backlog_rows{status="dead_lettered"} 1`, `outbox_relay_tenant_backlog_rows{status="dead_lettered",tenant="acme"} 1`)

	// dead-letters discard --all, as the command does it.
	testenv.MustExec(t, acme, `DELETE FROM event_queue WHERE status = 'dead_lettered'`)
	deadline := time.Now().Add(15 * time.Second)
	for {
		body := h.waitMetrics(t)
		if strings.Contains(body, `outbox_relay_backlog_rows{status="dead_lettered"} 0`+"\n") &&
			strings.Contains(body, `outbox_relay_tenant_backlog_rows{status="dead_lettered",tenant="acme"} 0`+"\n") {
			return
		}
		if time.Now().After(deadline) {
			for _, l := range strings.Split(body, "\n") {
				if strings.Contains(l, "backlog_rows{") {
					t.Log(l)
				}
			}
			t.Fatalf("15 s after the dead letter was discarded from an idle file, the gauges still count it (/readyz: %s)", h.waitReadyz(t))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestIdleFilesAtStartAreCounted: a file whose key is parked behind
// a dead letter (ordering.on_dead_letter: hold, the default) has nothing
// due, so the fleet does not open it at start. Its dead letter, its
// parked key and the rows waiting behind it should still be counted in
// backlog_rows and parked_keys (and the tenant's series): after a restart
// of the relay, a stuck tenant must not vanish from the metrics.
func TestIdleFilesAtStartAreCounted(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	parked := tenantFile(t, dir, "parked", 0)
	testenv.MustExec(t, parked, `INSERT INTO event_queue (event_id, event_type, payload, status, ordering_key) VALUES ('dead', 'order.placed', 'parked', 'dead_lettered', 'k')`)
	insertKeyed(t, parked, "parked", 2) // behind the dead letter
	busy := tenantFile(t, dir, "busy", 3)
	h := startFleetWith(t, dir, n.URL(), time.Minute, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
		cfg.Metrics.TenantLabel = true
	})
	waitDone(t, busy, 3)
	h.waitReadyz(t, ": 1 open (leading 1), 1 idle")
	want := []string{`outbox_relay_backlog_rows{status="dead_lettered"} 1`, `outbox_relay_backlog_rows{status="pending"} 2`, `outbox_relay_parked_keys 1`,
		`outbox_relay_tenant_backlog_rows{status="dead_lettered",tenant="parked"} 1`}
	deadline := time.Now().Add(10 * time.Second)
	for {
		body := h.waitMetrics(t)
		missing := ""
		for _, w := range want {
			if !strings.Contains(body, w+"\n") {
				missing = w
			}
		}
		if missing == "" {
			return
		}
		if time.Now().After(deadline) {
			for _, l := range strings.Split(body, "\n") {
				if strings.Contains(l, "backlog_rows{") || strings.HasPrefix(l, "outbox_relay_parked_keys") {
					t.Log(l)
				}
			}
			t.Fatalf("10 s after start, /metrics has no %q: the idle file's dead letter and parked key are not counted", missing)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestTableDroppedWhileServed: the outbox table of an open, busy
// file is dropped (its application reset its schema). The healthy file
// goes on; /readyz names the broken one, and fleet_files{state="trouble"}
// counts it, as it counts a file that could not be opened. Once the
// table is back (outbox-relay migrate), its new rows are published with
// no restart.
func TestTableDroppedWhileServed(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 3)
	globex := tenantFile(t, dir, "globex", 3)
	migrate(t, dir, "acme", "globex")
	h := startFleetWith(t, dir, n.URL(), time.Minute, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaVerify
	})
	waitDone(t, acme, 3)
	waitDone(t, globex, 3)
	testenv.MustExec(t, globex, `DROP TABLE event_queue`)
	insertKeyed(t, acme, "acme", 2)
	waitDone(t, acme, 5)
	body := h.waitReadyz(t, "globex (")
	t.Logf("/readyz: %s", body)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(h.waitMetrics(t), `outbox_relay_fleet_files{state="trouble"} 1`+"\n") {
		if time.Now().After(deadline) {
			t.Errorf(`/readyz names globex in trouble, but fleet_files{state="trouble"} does not count it: %s`,
				grepLines(h.waitMetrics(t), "fleet_files{"))
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Mended: the table is made again, and a row committed.
	migrate(t, dir, "globex") // creates the whole table
	insertKeyed(t, globex, "globex", 2)
	waitDone(t, globex, 2)
}

func grepLines(body, sub string) string {
	var out []string
	for _, l := range strings.Split(body, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "; ")
}

// TestExclusiveLockedFileIsNamed: a file its application holds in
// locking_mode=EXCLUSIVE, with rows due, beside a healthy file. The docs
// list "held locked by its application" among the files in trouble that
// /readyz names with why; the relay waits for the lock and says so in the
// log. /readyz should name it (and fleet_files count it) while it is held;
// once let go, its rows are published with no restart.
func TestExclusiveLockedFileIsNamed(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 3)
	locked := tenantFile(t, dir, "locked", 3)
	migrate(t, dir, "acme", "locked")
	conn, err := locked.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, q := range []string{`PRAGMA locking_mode = EXCLUSIVE`, `INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES ('held', 'order.placed', 'locked', 'k')`} {
		if _, err := conn.ExecContext(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaVerify })
	waitDone(t, acme, 3)
	testenv.Eventually(t, 20*time.Second, "the relay waiting for the lock", func() bool {
		return logCountOf(h.logs, "database locked against this process; waiting until it is free") >= 1
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, body := h.readyz(t)
		if strings.Contains(body, "locked (") && strings.Contains(h.waitMetrics(t), `outbox_relay_fleet_files{state="trouble"} 1`) {
			t.Logf("/readyz: %s", body)
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("10 s after the relay began waiting for locked.db's lock, /readyz does not name it: %s (fleet_files: %s)", body,
				grepLines(h.waitMetrics(t), "fleet_files{"))
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	conn.Close()
	locked.Close() // the pool's connection holds the exclusive lock until it closes
	waitDone(t, testenv.AppDB(t, filepath.Join(dir, "locked.db")), 4)
	if _, body := h.readyz(t); strings.Contains(body, "in trouble") {
		t.Errorf("/readyz once the lock is let go: %s", body)
	}
}

// TestReplacedOpenFileIsServedSoon: an open file is replaced by a
// restore (another file renamed over it) holding a due row. The new file
// is served without waiting for a periodic rescan (none comes here).
func TestReplacedOpenFileIsServedSoon(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 1)
	h := startFleetWith(t, dir, n.URL(), time.Minute, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto },
		func(th *daemon.TestHooks) { th.Rescan = time.Hour })
	waitDone(t, acme, 1)
	h.waitReadyz(t, ": 1 open (leading 1), 0 idle")
	staged := t.TempDir()
	s := tenantFile(t, staged, "acme", 0)
	e := testenv.NewEvent("order.placed", []byte("acme"))
	if err := testenv.Insert(s, e); err != nil {
		t.Fatal(err)
	}
	s.Close()
	for _, suffix := range []string{"-wal", "-shm"} {
		os.Remove(filepath.Join(staged, "acme.db"+suffix))
	}
	acme.Close() // the application stops, and its -wal and -shm go with the old file
	for _, suffix := range []string{"-wal", "-shm"} {
		os.Remove(filepath.Join(dir, "acme.db"+suffix))
	}
	if err := os.Rename(filepath.Join(staged, "acme.db"), filepath.Join(dir, "acme.db")); err != nil {
		t.Fatal(err)
	}
	waitDone(t, testenv.AppDB(t, filepath.Join(dir, "acme.db")), 1)
}

// TestFileRemovedMidDrain: a file is removed (with its -wal and
// -shm) while its backlog drains. The healthy file goes on; the removed
// file's figures leave the totals (backlog, in flight, leader), and
// /readyz no longer counts it.
func TestFileRemovedMidDrain(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 0)
	gone := tenantFile(t, dir, "gone", 0)
	insertBulk(t, gone, "gone", 5000)
	testenv.MustExec(t, gone, `INSERT INTO event_queue (event_id, event_type, payload, status) VALUES ('dead', 'order.placed', 'gone', 'dead_lettered')`)
	h := startFleetWith(t, dir, n.URL(), time.Minute, func(cfg *config.Config) {
		cfg.Schema.Mode = config.SchemaAuto
		cfg.Metrics.TenantLabel = true
	})
	testenv.Eventually(t, 30*time.Second, "gone draining", func() bool { return testenv.Counts(t, gone)["done"] >= 200 })
	h.waitMetrics(t, `outbox_relay_tenant_backlog_rows{status="dead_lettered",tenant="gone"} 1`)
	gone.Close()
	for _, suffix := range []string{"", "-wal", "-shm"} {
		os.Remove(filepath.Join(dir, "gone.db"+suffix))
	}
	insertKeyed(t, acme, "acme", 5)
	waitDone(t, acme, 5)
	h.waitReadyz(t, "serving 1 database files")
	body := h.waitMetrics(t, `outbox_relay_backlog_rows{status="pending"} 0`, `outbox_relay_backlog_rows{status="processing"} 0`,
		`outbox_relay_backlog_rows{status="dead_lettered"} 0`, `outbox_relay_in_flight_rows 0`, `outbox_relay_leader 1`)
	if strings.Contains(body, `tenant="gone"`) {
		t.Errorf("the removed file's tenant series remain: %s", grepLines(body, `tenant="gone"`))
	}
}

// TestOutageWhileServedInTurn: more busy files than slots (served in
// turn) through a broker outage: no attempt spent, every row once, every
// file closes again afterwards with no trouble.
func TestOutageWhileServedInTurn(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	dbs := map[string]*sql.DB{}
	var stops []func() int
	names := []string{}
	for i := 0; i < 8; i++ {
		name := fmt.Sprint("t", i)
		names = append(names, name)
		dbs[name] = tenantFile(t, dir, name, 0)
		insertBulk(t, dbs[name], name, 300)
	}
	h := startFleetWith(t, dir, n.URL(), 500*time.Millisecond, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto },
		func(th *daemon.TestHooks) { th.MaxOpen = 3 })
	for _, name := range names {
		stops = append(stops, writeEvery(t, dbs[name], name, 40*time.Millisecond))
	}
	time.Sleep(1500 * time.Millisecond)
	n.Stop()
	h.waitMetrics(t, `outbox_relay_broker_connected 0`)
	time.Sleep(3 * time.Second)
	n.Restart()
	time.Sleep(2 * time.Second)
	want, total := map[string]int{}, 0
	for i, name := range names {
		want[name] = 300 + stops[i]()
		total += want[name]
	}
	for _, name := range names {
		db := dbs[name]
		testenv.Eventually(t, 90*time.Second, name+" all done", func() bool { return testenv.Counts(t, db)["done"] == want[name] })
		nothingSpent(t, db, name+" after an outage")
	}
	streamOnce(t, n, total)
	waitAllClosed(t, h, 8)
	if c := logCountOf(h.logs, "cannot serve this database file"); c > 0 {
		t.Errorf("%d files logged in trouble after a broker outage", c)
	}
}

// TestFleetNamesSubjectsHeldAtTheirLimit: in a fleet, one tenant's
// subject at the stream's max_msgs_per_subject holds that tenant's rows
// of it, and /readyz names the tenant and the subject; the other
// tenants' rows go out.
func TestFleetNamesSubjectsHeldAtTheirLimit(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour,
		MaxMsgsPerSubject: 2, Discard: jetstream.DiscardNew, DiscardNewPerSubject: true}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 3) // one more than the subject takes
	globex := tenantFile(t, dir, "globex", 2)
	h := startFleetWith(t, dir, n.URL(), time.Minute, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaAuto })
	waitDone(t, globex, 2)
	waitDone(t, acme, 2)
	h.waitReadyz(t, "1 with subjects the stream refuses at its max_msgs_per_subject: acme: 1 subject held", "(events.acme.order.placed)")
	nothingSpent(t, acme, "on a subject at its limit")
}

// TestTroubledFileLockedOnRetryCountedOnce: a file in trouble (its
// schema fails verification) is tried again every 5 s; at a retry its
// application holds it in exclusive locking mode. It is one file in
// trouble: fleet_files{state="trouble"} says 1, and /readyz names it once,
// as it is now (locked).
func TestTroubledFileLockedOnRetryCountedOnce(t *testing.T) {
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	acme := tenantFile(t, dir, "acme", 3)
	bad := tenantFile(t, dir, "bad", 1)
	migrate(t, dir, "acme")
	bad.Close()
	h := startFleetWith(t, dir, n.URL(), 0, func(cfg *config.Config) { cfg.Schema.Mode = config.SchemaVerify })
	waitDone(t, acme, 3)
	testenv.Eventually(t, 20*time.Second, "bad.db in trouble", func() bool {
		_, body := h.readyz(t)
		return strings.Contains(body, "bad (")
	})
	db, err := sql.Open("sqlite3", "file:"+filepath.Join(dir, "bad.db")+"?_locking_mode=EXCLUSIVE")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	conn, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var c int
	if err := conn.QueryRowContext(context.Background(), `SELECT count(*) FROM event_queue`).Scan(&c); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the retry waiting for the lock", func() bool {
		return logCountOf(h.logs, "database locked against this process; waiting until it is free") >= 1
	})
	testenv.Eventually(t, 10*time.Second, "/readyz naming the lock", func() bool {
		_, body := h.readyz(t)
		return strings.Contains(body, "waiting until it is free")
	})
	metrics := h.waitMetrics(t)
	_, body := h.readyz(t)
	if !strings.Contains(metrics, `outbox_relay_fleet_files{state="trouble"} 1`+"\n") {
		t.Errorf("one file in trouble, fleet_files says: %s", grepLines(metrics, "fleet_files{"))
	}
	if strings.Count(body, "bad (") != 1 {
		t.Errorf("/readyz names bad.db %d times: %s", strings.Count(body, "bad ("), body)
	}
}

// waitAllClosed waits for /readyz to say every one of the fleet's files
// is closed as idle, and returns its body. A file that deferred rows in
// an outage and has none left to try stays open, its outage half open,
// for up to a minute (relay.maxDefer) before it may close.
func waitAllClosed(t *testing.T, h *fleetHarness, files int) string {
	t.Helper()
	want := fmt.Sprintf(": 0 open (leading 0), %d idle", files)
	var body string
	testenv.Eventually(t, 75*time.Second, "every file closed again", func() bool {
		_, body = h.readyz(t)
		return strings.Contains(body, want)
	})
	return body
}
