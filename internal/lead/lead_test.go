package lead

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func newLease(t testing.TB) *Lease {
	t.Helper()
	return New(testenv.MigratedDB(t))
}

// openLease returns a Lease on the database at path: another relay's.
func openLease(t testing.TB, path string) *Lease {
	t.Helper()
	return New(testenv.OpenDB(t, path))
}

// TestReclaimReadsTheProcessingIndex: taking back rows left processing
// reads the index of processing rows, not the table.
func TestReclaimReadsTheProcessingIndex(t *testing.T) {
	l := newLease(t)
	testenv.InsertRows(t, testenv.AppDB(t, l.db.Path()), 1000, "done")
	now := time.Now().UnixMilli()
	plan := testenv.QueryPlan(t, l.db, l.reclaim, now, "x")
	if !strings.Contains(plan, "USING INDEX event_queue_processing") || strings.Contains(plan, "SCAN event_queue\x00") {
		t.Errorf("reclaim plan %q: want the processing index", plan)
	}
}

func TestHeartbeatReclaimsOnlyDeadOwners(t *testing.T) {
	ctx := context.Background()
	live := newLease(t)
	dead := openLease(t, live.db.Path())
	other := openLease(t, live.db.Path())
	db := testenv.AppDB(t, live.db.Path())
	testenv.InsertRows(t, db, 6, "pending")
	for _, s := range []*Lease{live, dead} {
		if _, err := s.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil {
			t.Fatal(err)
		}
		if n := testenv.LegacyClaim(t, db, s.Instance(), 3); n != 3 {
			t.Fatal(n)
		}
	}
	// Both owners are alive: nothing is taken before the lease.
	if n, err := other.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil || n != 0 {
		t.Fatalf("reclaimed %d (%v) while both owners are alive", n, err)
	}
	// dead stopped heartbeating a minute ago (kill -9), as other saw it:
	// its claims come back at once, to a relay that has been heartbeating
	// on time for a staleness window.
	other.beatingSince = time.Now().Add(-time.Minute)
	s := other.seen[dead.Instance()]
	s.since = time.Now().Add(-time.Minute)
	other.seen[dead.Instance()] = s
	n, err := other.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second)
	if err != nil || n != 3 {
		t.Fatalf("reclaimed %d (%v), want the dead owner's 3", n, err)
	}
	var pending, liveHeld, instances int
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'pending'`).Scan(&pending)
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'processing' AND claimed_by = ?`, live.Instance()).Scan(&liveHeld)
	db.QueryRow(`SELECT count(*) FROM ` + schema.InstancesTable).Scan(&instances)
	if pending != 3 || liveHeld != 3 || instances != 2 {
		t.Fatalf("pending %d, live holds %d, instances %d; want 3, 3, 2", pending, liveHeld, instances)
	}
	if err := live.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	db.QueryRow(`SELECT count(*) FROM ` + schema.InstancesTable).Scan(&instances)
	if instances != 1 {
		t.Fatalf("%d instances after Leave", instances)
	}
}

// TestHeldUpHeartbeatJudgesNobody: when the application held the write lock
// longer than the staleness limit, every relay's heartbeat waited; the first
// one through must not take the others for dead.
func TestHeldUpHeartbeatJudgesNobody(t *testing.T) {
	ctx := context.Background()
	a := newLease(t)
	b := openLease(t, a.db.Path())
	db := testenv.AppDB(t, a.db.Path())
	testenv.InsertRows(t, db, 5, "pending")
	const stale = 1500 * time.Millisecond
	for _, s := range []*Lease{a, b} {
		if _, err := s.Heartbeat(ctx, "t", 0, time.Hour, stale); err != nil {
			t.Fatal(err)
		}
	}
	if n := testenv.LegacyClaim(t, db, b.Instance(), 5); n != 5 {
		t.Fatal(n)
	}
	tx, err := db.Begin() // the application's long transaction
	if err != nil {
		t.Fatal(err)
	}
	tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES ('long', 'T', 'x')`)
	time.AfterFunc(2*time.Second, func() { tx.Commit() })
	n, err := a.Heartbeat(ctx, "t", 0, time.Hour, stale) // waits 2 s for the lock
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("a held-up heartbeat reclaimed %d rows of a relay that was only held up too", n)
	}
	// b really is dead now: the next, timely heartbeats take its rows.
	time.Sleep(stale)
	if _, err := a.Heartbeat(ctx, "t", 0, time.Hour, stale); err != nil {
		t.Fatal(err)
	}
	var reclaimed int64
	step := func() bool {
		n, err := a.Heartbeat(ctx, "t", 0, time.Hour, stale)
		if err != nil {
			t.Fatal(err)
		}
		reclaimed += n
		return reclaimed == 5
	}
	deadline := time.Now().Add(10 * time.Second)
	for !step() {
		if time.Now().After(deadline) {
			t.Fatalf("dead relay's rows not reclaimed (%d)", reclaimed)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestJudgeOnlyAfterBeatingOnTime: a relay that has just started (or just
// got the lock back) does not take another for dead until it has itself
// been heartbeating on time for a staleness window.
func TestJudgeOnlyAfterBeatingOnTime(t *testing.T) {
	ctx := context.Background()
	const stale = 600 * time.Millisecond
	dead := newLease(t)
	db := testenv.AppDB(t, dead.db.Path())
	testenv.InsertRows(t, db, 2, "pending")
	if _, err := dead.Heartbeat(ctx, "t", 0, time.Hour, stale); err != nil {
		t.Fatal(err)
	}
	if n := testenv.LegacyClaim(t, db, dead.Instance(), 2); n != 2 {
		t.Fatal(n)
	}
	testenv.MustExec(t, db, `UPDATE `+schema.InstancesTable+` SET heartbeat_at = heartbeat_at - 60000`)
	judge := openLease(t, dead.db.Path())
	start := time.Now() // before the first heartbeat, which starts the judge's clock
	if n, err := judge.Heartbeat(ctx, "t", 0, time.Hour, stale); err != nil || n != 0 {
		t.Fatalf("a relay's first heartbeat reclaimed %d (%v)", n, err)
	}
	var n int64
	for n == 0 && time.Since(start) < 5*time.Second {
		time.Sleep(50 * time.Millisecond)
		k, err := judge.Heartbeat(ctx, "t", 0, time.Hour, stale)
		if err != nil {
			t.Fatal(err)
		}
		n = k
	}
	if n != 2 || time.Since(start) < stale {
		t.Fatalf("reclaimed %d after %v; want 2, not before %v", n, time.Since(start), stale)
	}
}

// TestEachOutboxTableHasItsLeader: two relays on one file serving two
// outbox tables both lead (before, the second stood by forever behind the
// first), and a standby of either table stands by behind its own leader
// only.
func TestEachOutboxTableHasItsLeader(t *testing.T) {
	ctx := context.Background()
	events := newLease(t)
	path := events.db.Path()
	ordersDB, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: "orders_outbox", BusyTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ordersDB.Close() })
	if _, err := schema.Migrate(ctx, ordersDB); err != nil {
		t.Fatal(err)
	}
	orders := New(ordersDB)
	standby := openLease(t, path) // a second relay of event_queue
	for _, l := range []*Lease{events, orders, standby} {
		if _, err := l.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if !events.Leads() || !orders.Leads() || standby.Leads() {
		t.Fatalf("leads: event_queue %v, orders_outbox %v, event_queue's second relay %v; want true, true, false",
			events.Leads(), orders.Leads(), standby.Leads())
	}
}

// TestDeadPredecessorOnTheSameHostIsBuried: a relay killed with -9 leaves
// its heartbeat row; a relay started on the same host sees that its pid is
// gone and leads on its first heartbeat, instead of waiting for the row to
// go stale. A row whose pid is alive, or from another host or pid
// namespace, is left to go stale.
func TestDeadPredecessorOnTheSameHostIsBuried(t *testing.T) {
	ctx := context.Background()
	next := newLease(t)
	db := testenv.AppDB(t, next.db.Path())
	exited := exec.Command("true")
	if err := exited.Run(); err != nil {
		t.Fatal(err)
	}
	deadPid := exited.Process.Pid
	now := time.Now().UnixMilli()
	insert := func(id string, pid int, scope string) {
		testenv.MustExec(t, db, `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, outbox_table, process_scope)
			VALUES (?, ?, ?, 'h', ?, 'old', 'event_queue', ?)`, id, now-60000, now, pid, scope)
	}
	insert("elsewhere", deadPid, "another-boot/pid:[1]")
	if _, err := next.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if next.Leads() {
		t.Fatal("a relay took the lead from a live-looking relay of another pid namespace")
	}
	testenv.MustExec(t, db, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = 'elsewhere'`)
	insert("alive", os.Getppid(), next.scope)
	insert("killed", deadPid, next.scope)
	if _, err := next.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	left := testenv.Strings(t, db, `SELECT instance_id FROM `+schema.InstancesTable+` WHERE instance_id <> ? ORDER BY instance_id`, next.Instance())
	if strings.Join(left, ",") != "alive" {
		t.Fatalf("heartbeat rows %v: want the live process's and this relay's", left)
	}
	testenv.MustExec(t, db, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = 'alive'`)
	insert("killed", deadPid, next.scope)
	if _, err := next.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil || !next.Leads() {
		t.Fatalf("after a dead predecessor: leads %v (%v), want the lead at once", next.Leads(), err)
	}
}

// TestNewcomerInTheLeadersMillisecondStandsBy: a relay whose row has the
// leader's started_at, registered after it, stands by, whatever its
// instance id: the lead does not move to a relay that has just started.
func TestNewcomerInTheLeadersMillisecondStandsBy(t *testing.T) {
	ctx := context.Background()
	leader := newLease(t)
	if _, err := leader.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	db := testenv.AppDB(t, leader.db.Path())
	started := testenv.Strings(t, db, `SELECT started_at FROM `+schema.InstancesTable+` WHERE instance_id = ?`, leader.Instance())
	// "!" sorts before any instance id the relay makes.
	testenv.MustExec(t, db, `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version, outbox_table, process_scope)
		VALUES ('!newcomer', ?1, ?1, 'elsewhere', 1, 'test', 'event_queue', 'another-boot/pid:[1]')`, started[0])
	if _, err := leader.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if !leader.Leads() {
		t.Fatal("the leader lost the lead to a relay registered after it in the same millisecond")
	}
}

// TestRelayJudgedDeadDoesNotLeadAtOnce: a leader paused past the
// staleness loses its row to a standby's judgement; the standby dies in
// turn. The paused relay, resumed, heartbeats alone: its row is written
// again, but it does not lead at that heartbeat (another relay may have
// led since), and leads at the next, so that it begins to lead anew.
func TestRelayJudgedDeadDoesNotLeadAtOnce(t *testing.T) {
	ctx := context.Background()
	paused := newLease(t)
	db := testenv.AppDB(t, paused.db.Path())
	beat := func(l *Lease) {
		t.Helper()
		if _, err := l.Heartbeat(ctx, "test", 0, time.Hour, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	beat(paused)
	if !paused.Leads() {
		t.Fatal("the only relay does not lead")
	}
	// The standby judged it dead and led; then the standby was killed and
	// its row buried.
	testenv.MustExec(t, db, `DELETE FROM `+schema.InstancesTable)
	if leads, err := paused.StillLeads(ctx); err != nil || leads {
		t.Fatalf("StillLeads with its row removed: %v, %v; want false", leads, err)
	}
	beat(paused)
	if paused.Leads() {
		t.Fatal("a relay whose row was removed leads at once at its next heartbeat, as if it had led all along")
	}
	// Its new row alone is in the table: read now, between the heartbeat
	// that joined again and the one that leads, it must not say it leads
	// (its claim loop, resumed, read the lead so and published again).
	if leads, err := paused.StillLeads(ctx); err != nil || leads {
		t.Fatalf("StillLeads after joining again, before a heartbeat says it leads: %v, %v; want false", leads, err)
	}
	beat(paused)
	if !paused.Leads() {
		t.Fatal("the relay alone does not lead at the heartbeat after it joined again")
	}
	if leads, err := paused.StillLeads(ctx); err != nil || !leads {
		t.Fatalf("StillLeads once a heartbeat says it leads: %v, %v; want true", leads, err)
	}
}

// TestClockStepsDoNotDecideWhoIsDead: relays whose wall clocks disagree
// by a minute (one stepped back or forward: NTP, a restored VM snapshot)
// judge each other by whether their heartbeats change, on their own
// monotonic clocks. A dead relay whose last heartbeat reads a minute in
// the standby's future is judged dead after the staleness, not a minute
// later; a live one whose heartbeats read a minute in the past is not
// judged dead.
func TestClockStepsDoNotDecideWhoIsDead(t *testing.T) {
	ctx := context.Background()
	const stale = 600 * time.Millisecond
	for _, tc := range []struct {
		name  string
		skew  time.Duration // the other relay's clock against the standby's
		alive bool
	}{
		{"a dead relay's clock ahead", time.Minute, false},
		{"a live relay's clock behind", -time.Minute, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			other := newLease(t)
			other.scope = "" // in another container: no pid to look at
			other.now = func() int64 { return sqlitedb.NowMs() + tc.skew.Milliseconds() }
			standby := openLease(t, other.db.Path())
			beat := func(l *Lease) {
				t.Helper()
				if _, err := l.Heartbeat(ctx, "t", 0, time.Hour, stale); err != nil {
					t.Fatal(err)
				}
			}
			beat(other)
			start := time.Now()
			for time.Since(start) < 4*stale {
				beat(standby)
				if tc.alive && standby.Leads() {
					t.Fatalf("the standby took the lead from a live relay after %v", time.Since(start))
				}
				if tc.alive {
					beat(other)
				}
				time.Sleep(50 * time.Millisecond)
			}
			if !tc.alive && !standby.Leads() {
				t.Fatalf("the standby does not lead %v after the other relay died", 4*stale)
			}
		})
	}
}

// TestHeartbeatOfAnotherTypeIsRead: a heartbeat row whose heartbeat_at
// another implementation wrote as REAL seconds stops no relay's heartbeat,
// and its changes count as heartbeats.
func TestHeartbeatOfAnotherTypeIsRead(t *testing.T) {
	ctx := context.Background()
	const stale = 600 * time.Millisecond
	l := newLease(t)
	db := testenv.AppDB(t, l.db.Path())
	foreign := func() {
		testenv.MustExec(t, db, `INSERT INTO `+schema.InstancesTable+` (instance_id, started_at, heartbeat_at, hostname, pid, version)
VALUES ('foreign', 0, ?1, 'elsewhere', 1, 'other') ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at`,
			float64(time.Now().UnixMilli())/1000)
	}
	foreign()
	for start := time.Now(); time.Since(start) < 4*stale; time.Sleep(50 * time.Millisecond) {
		if _, err := l.Heartbeat(ctx, "test", 0, time.Hour, stale); err != nil {
			t.Fatal(err)
		}
		foreign() // alive: its value changes
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM ` + schema.InstancesTable + ` WHERE instance_id = 'foreign'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the live foreign relay's row: %d (%v), want it kept", n, err)
	}
	if l.Leads() {
		t.Fatal("the relay leads beside the longest-running one")
	}
}

// TestHeartbeatRowGoneBack: a backup written into the file in place
// brings this relay's heartbeat row back to an earlier heartbeat. The
// next heartbeat finds it so, joins again with a new started_at and does
// not lead, as a relay judged dead does; the one after leads anew.
func TestHeartbeatRowGoneBack(t *testing.T) {
	ctx := context.Background()
	l := newLease(t)
	db := testenv.AppDB(t, l.db.Path())
	beat := func() {
		t.Helper()
		if _, err := l.Heartbeat(ctx, "t", 0, time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	beat()
	beat()
	if !l.Leads() {
		t.Fatal("a relay alone does not lead")
	}
	started := testenv.Strings(t, db, `SELECT started_at FROM `+schema.InstancesTable)
	_, _, fence := l.ClaimFence()
	testenv.MustExec(t, db, `UPDATE `+schema.InstancesTable+` SET heartbeat_at = ? WHERE instance_id = ?`, fence-1000, l.Instance())
	time.Sleep(2 * time.Millisecond) // the new started_at differs
	beat()
	if l.Leads() {
		t.Fatal("the relay leads on at the heartbeat that found its row gone back")
	}
	if now := testenv.Strings(t, db, `SELECT started_at FROM `+schema.InstancesTable); len(now) != 1 || now[0] == started[0] {
		t.Fatalf("started_at %v after the row went back, %v before; want one row, started again", now, started)
	}
	beat()
	if !l.Leads() {
		t.Fatal("the relay alone does not lead at the heartbeat after it joined again")
	}
}

// TestClockStepBackKeepsHeartbeatsInTheFuture: a relay whose clock ran an
// hour ahead when it started (a VM resumed, a bad NTP source) and was
// then stepped back keeps writing heartbeat_at an hour ahead (last+1 ms
// per beat). Once it crashes, status (and anything judging by
// heartbeat_at against the wall clock, such as ledger.TableSource's
// relay check) takes it for alive for that hour instead of staleAfter.
func TestClockStepBackKeepsHeartbeatsInTheFuture(t *testing.T) {
	ctx := context.Background()
	l := newLease(t)
	skew := time.Hour.Milliseconds()
	l.now = func() int64 { return sqlitedb.NowMs() + skew }
	beat := func() {
		t.Helper()
		if _, err := l.Heartbeat(ctx, "t", 0, time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	beat()
	skew = 0 // NTP steps the clock back to the truth
	for range 5 {
		beat()
		time.Sleep(20 * time.Millisecond)
	}
	// The relay is killed now: its row stays.
	time.Sleep(700 * time.Millisecond)
	st, err := admin.ReadStatus(ctx, testenv.OpenDB(t, l.db.Path()), admin.StatusOptions{StaleAfter: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Relays) != 1 {
		t.Fatalf("relays %v", st.Relays)
	}
	r := st.Relays[0]
	t.Logf("heartbeat_at %v, wall clock %v", r.HeartbeatAt, time.Now())
	if !r.PresumedDead {
		t.Fatalf("a relay silent for 700ms past a 500ms staleness reads alive (leader %v): its heartbeat_at %v is %v ahead of the clock it was written by",
			r.Leader, r.HeartbeatAt.Format(time.RFC3339), time.Until(r.HeartbeatAt).Round(time.Second))
	}
}
