//go:build fault

// Package fault is the fault-injection suite: it drives the real
// outbox-relay binary, a real nats-server process and a writer process
// through crashes, outages, contention and an operator's changes to the
// server (a permission granted, a stream sealed and replaced), and checks
// that every row ends done (or dead_lettered where expected) with exactly
// one message per event_id in the stream.
//
//	go test -tags fault -v -timeout 30m ./test/fault/
package fault

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	_ "github.com/mattn/go-sqlite3"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

var bin struct{ relay, natsServer, writer string }

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "outbox-relay-fault-")
	if err != nil {
		panic(err)
	}
	bin.relay = filepath.Join(dir, "outbox-relay")
	bin.natsServer = filepath.Join(dir, "nats-server")
	bin.writer = filepath.Join(dir, "writer")
	for target, pkg := range map[string]string{
		bin.relay:      "github.com/outbox-relay/outbox-relay/cmd/outbox-relay",
		bin.natsServer: "github.com/nats-io/nats-server/v2",
		bin.writer:     "github.com/outbox-relay/outbox-relay/test/fault/writer",
	} {
		if out, err := exec.Command("go", "build", "-o", target, pkg).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build %s: %v\n%s", pkg, err, out)
			os.Exit(1)
		}
	}
	code := m.Run()
	printSummaries()
	os.RemoveAll(dir)
	os.Exit(code)
}

// summary is one scenario's result line.
type summary struct {
	name                           string
	rows, kills                    int
	outage                         time.Duration
	lost, duplicates, deadLettered int
	maxRecovery                    time.Duration
	elapsed                        time.Duration
	notes                          string
}

var summaries []summary

func printSummaries() {
	if len(summaries) == 0 {
		return
	}
	fmt.Println()
	fmt.Println("| scenario | rows | kills | outage s | lost | duplicates | dead-lettered | max recovery s | wall s |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, s := range summaries {
		fmt.Printf("| %s | %d | %d | %.0f | %d | %d | %d | %.1f | %.0f |\n", s.name, s.rows, s.kills, s.outage.Seconds(),
			s.lost, s.duplicates, s.deadLettered, s.maxRecovery.Seconds(), s.elapsed.Seconds())
	}
}

// env is one scenario's world: a database, a nats-server process, relays.
type env struct {
	t        *testing.T
	dir      string
	db       string
	port     int
	natsConf string // the broker's configuration file; "" for none
	nats     *child.Process
	relays   map[string]*child.Process // the latest relay of each name, running or not
	started  time.Time
}

// stopTimeout bounds a process's exit after SIGTERM: a relay's shutdown
// takes at most its shutdown_timeout (30 s in TestSignals) and a few
// seconds of writes.
const stopTimeout = time.Minute

// newEnv makes a scenario's world; opts change it before the broker
// starts.
func newEnv(t *testing.T, opts ...func(*env)) *env {
	e := &env{t: t, dir: t.TempDir(), relays: map[string]*child.Process{}, started: time.Now()}
	e.db = filepath.Join(e.dir, "app.db")
	e.port = testenv.FreePort(t)
	for _, o := range opts {
		o(e)
	}
	if out, err := exec.Command(bin.relay, "migrate", "--database-path", e.db).CombinedOutput(); err != nil {
		t.Fatalf("migrate: %v %s", err, out)
	}
	e.startNATS()
	t.Cleanup(func() {
		for name := range e.relays {
			e.killRelay(name)
		}
		e.stopNATS()
		if t.Failed() {
			for _, name := range slices.Sorted(maps.Keys(e.relays)) {
				lines := e.relays[name].Lines()
				var tail []string
				for _, l := range lines[max(0, len(lines)-15):] {
					tail = append(tail, l.Text)
				}
				t.Logf("last log lines of relay %s:\n%s", name, strings.Join(tail, "\n"))
			}
		}
	})
	return e
}

func (e *env) natsURL() string { return fmt.Sprintf("nats://127.0.0.1:%d", e.port) }

func (e *env) startNATS() {
	e.t.Helper()
	args := []string{"-js", "-a", "127.0.0.1", "-p", strconv.Itoa(e.port), "-sd", filepath.Join(e.dir, "nats")}
	if e.natsConf != "" {
		args = append(args, "-c", e.natsConf) // the flags above still win
	}
	p, err := child.Start(exec.Command(bin.natsServer, args...))
	if err != nil {
		e.t.Fatal(err)
	}
	e.nats = p
	deadline := time.Now().Add(20 * time.Second)
	for {
		nc, err := nats.Connect(e.natsURL())
		if err == nil {
			nc.Close()
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("nats-server did not start: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// withNATSConfig starts the broker with the configuration conf, in a file
// that reloadNATS rewrites.
func withNATSConfig(conf string) func(*env) {
	return func(e *env) {
		e.natsConf = filepath.Join(e.dir, "nats.conf")
		e.writeNATSConfig(conf)
	}
}

func (e *env) writeNATSConfig(conf string) {
	e.t.Helper()
	if err := os.WriteFile(e.natsConf, []byte(conf), 0o600); err != nil {
		e.t.Fatal(err)
	}
}

// natsLogCount counts the broker's log lines that contain text.
func (e *env) natsLogCount(text string) int {
	n := 0
	for _, l := range e.nats.Lines() {
		if strings.Contains(l.Text, text) {
			n++
		}
	}
	return n
}

// reloadNATS rewrites the broker's configuration file as conf and has the
// running broker reload it (SIGHUP, as nats-server --signal reload does),
// returning once the broker has logged that it reloaded: by then every
// connection has the new permissions.
func (e *env) reloadNATS(conf string) {
	e.t.Helper()
	const done, failed = "Reloaded server configuration", "Failed to reload server configuration"
	before, failedBefore := e.natsLogCount(done), e.natsLogCount(failed)
	e.writeNATSConfig(conf)
	if err := e.nats.Signal(syscall.SIGHUP); err != nil {
		e.t.Fatalf("signal nats-server to reload: %v", err)
	}
	testenv.Eventually(e.t, 30*time.Second, "nats-server to reload its configuration", func() bool {
		if e.natsLogCount(failed) > failedBefore {
			e.t.Fatalf("nats-server refused the new configuration:\n%s", conf)
		}
		return e.natsLogCount(done) > before
	})
}

// stopNATS stops the broker (SIGTERM) and waits for it.
func (e *env) stopNATS() {
	if e.nats == nil {
		return
	}
	e.nats.Stop(syscall.SIGTERM, stopTimeout)
	e.nats = nil
}

// startRelay starts a relay process named name with extra environment.
func (e *env) startRelay(name string, extraEnv ...string) {
	e.t.Helper()
	cmd := exec.Command(bin.relay, "run")
	cmd.Env = append(os.Environ(),
		"OUTBOX_RELAY_DATABASE_PATH="+e.db,
		"NATS_URL="+e.natsURL(),
		"OUTBOX_RELAY_METRICS_LISTEN=127.0.0.1:0",
		"OUTBOX_RELAY_LOG_LEVEL=info",
	)
	cmd.Env = append(cmd.Env, extraEnv...)
	p, err := child.Start(cmd)
	if err != nil {
		e.t.Fatal(err)
	}
	e.relays[name] = p
}

// killRelay kills a relay with SIGKILL: no drain, no release.
func (e *env) killRelay(name string) {
	if p := e.relays[name]; p != nil {
		p.Kill()
	}
}

// stopRelay stops a relay with SIGTERM and expects exit code 0.
func (e *env) stopRelay(name string) {
	e.t.Helper()
	if err := e.relays[name].Stop(syscall.SIGTERM, stopTimeout); err != nil {
		e.t.Errorf("relay %s after SIGTERM: %v", name, err)
	}
}

// logCount counts the log lines with message msg of the latest relay
// named name.
func (e *env) logCount(name, msg string) int {
	return len(e.relays[name].Find(msg))
}

// reconciledRows sums the rows the latest relay named name found
// published already and settled when it began to lead, as its log says
// (its log outlives it).
func (e *env) reconciledRows(name string) int {
	n := 0
	for _, l := range e.relays[name].Find("reconciled the outbox with the stream; publishing") {
		settled, _ := l.Fields["settled"].(float64)
		n += int(settled)
	}
	return n
}

// metricsAddr is the address a running relay serves /metrics and its
// probes on, as it logged it.
func (e *env) metricsAddr(name string) string {
	e.t.Helper()
	line, err := e.relays[name].WaitFor("serving metrics", 30*time.Second)
	if err != nil {
		e.t.Fatalf("relay %s %v", name, err)
	}
	return line.Fields["listen"].(string)
}

// readyz asks a running relay's /readyz: the status code and the body.
func (e *env) readyz(name string) (int, string) {
	e.t.Helper()
	resp, err := http.Get("http://" + e.metricsAddr(name) + "/readyz")
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(body))
}

// waitReadyz waits up to 30 s for a running relay's /readyz to answer
// code with a body containing text, and returns the body. A relay's
// probe can say another thing for a moment (an acknowledgement that
// timed out under load pauses it): what it settles on is what counts.
func (e *env) waitReadyz(name string, code int, text string) string {
	e.t.Helper()
	var got int
	var body string
	deadline := time.Now().Add(30 * time.Second)
	for {
		if got, body = e.readyz(name); got == code && strings.Contains(body, text) {
			return body
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("/readyz of relay %s answers %d %q, want %d with %q", name, got, body, code, text)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// metric scrapes one metric value from a running relay's /metrics.
func (e *env) metric(name, metric string) float64 {
	e.t.Helper()
	resp, err := http.Get("http://" + e.metricsAddr(name) + "/metrics")
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(metric) + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		e.t.Fatalf("metric %s not found", metric)
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// writer is the application process; it prints a writerSummary.
type writer struct {
	*child.Process
	out bytes.Buffer
}

// writer starts the application process.
func (e *env) writer(args ...string) *writer {
	e.t.Helper()
	return e.writerOn(e.db, args...)
}

// writerOn starts the application process on the database file db.
func (e *env) writerOn(db string, args ...string) *writer {
	e.t.Helper()
	w := &writer{}
	cmd := exec.Command(bin.writer, append([]string{"-db", db}, args...)...)
	cmd.Stdout = &w.out
	p, err := child.Start(cmd)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(p.Kill)
	w.Process = p
	return w
}

type writerSummary struct {
	Written    int     `json:"written"`
	PoisonBig  int     `json:"poison_big"`
	PoisonType int     `json:"poison_type"`
	Holds      int     `json:"holds"`
	MaxWaitMs  float64 `json:"max_commit_wait_ms"`
	Keyed      int     `json:"keyed"`
	Restricted int     `json:"restricted"`
	Groups     int     `json:"groups"`
}

func (e *env) waitWriter(w *writer) writerSummary {
	e.t.Helper()
	if err := w.Wait(); err != nil {
		e.t.Fatalf("writer: %v", err)
	}
	var s writerSummary
	raw := w.out.Bytes()
	if err := json.Unmarshal(raw, &s); err != nil {
		e.t.Fatalf("writer output %q: %v", raw, err)
	}
	return s
}

func (e *env) open() *sql.DB {
	e.t.Helper()
	db, err := sql.Open("sqlite3", "file:"+e.db+"?_busy_timeout=30000")
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { db.Close() })
	return db
}

// stream creates the relay's stream refusing messages over maxMsgSize
// bytes, or sets that limit on it (testenv.EventsStream).
func (e *env) stream(maxMsgSize int32) {
	e.t.Helper()
	js := e.jetStream()
	testenv.EventsStream(e.t, js, maxMsgSize)
}

// waitSettled waits until no row is pending or processing.
func (e *env) waitSettled(db *sql.DB, timeout time.Duration) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		c := testenv.Counts(e.t, db)
		if c["pending"]+c["processing"] == 0 {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("rows not settled after %v: %v", timeout, c)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// verify checks the end state: every row done or dead_lettered (the number
// expected), one stream message per done row's event_id, none without a
// row, and the messages of each ordering key in row-id order. It returns
// lost and duplicate counts for the summary.
func (e *env) verify(db *sql.DB, wantDead int) (lost, duplicates, dead int) {
	e.t.Helper()
	return e.verifyReplaced(db, wantDead, nil)
}

// verifyReplaced is verify for a stream that replaced an earlier one of
// the name: the rows whose event ids are in gone were done before, their
// messages went with the earlier stream, and none may be in this one (a
// row published again counts as a duplicate).
func (e *env) verifyReplaced(db *sql.DB, wantDead int, gone map[string]bool) (lost, duplicates, dead int) {
	e.t.Helper()
	c := testenv.Counts(e.t, db)
	dead = c["dead_lettered"]
	lost = c["pending"] + c["processing"]
	done := map[string]bool{}
	// With retention.done_rows: delete a done row is a record.
	rows, err := db.Query(`SELECT event_id FROM event_queue WHERE status = 'done' UNION ALL SELECT event_id FROM outbox_relay_done_event_queue`)
	if err != nil {
		e.t.Fatal(err)
	}
	for rows.Next() {
		var id string
		rows.Scan(&id)
		done[id] = true
	}
	rows.Close()
	seen := map[string]int{}
	lastRow := map[string]int64{} // per ordering key
	e.eachMessage(1, func(h nats.Header) {
		seen[h.Get("Nats-Msg-Id")]++
		if key := h.Get("Outbox-Ordering-Key"); key != "" {
			row, _ := strconv.ParseInt(h.Get("Outbox-Row-Id"), 10, 64)
			if row <= lastRow[key] {
				e.t.Errorf("ordering key %s: row %d stored after row %d", key, row, lastRow[key])
			}
			lastRow[key] = row
		}
	})
	for id, k := range seen {
		if k > 1 {
			duplicates += k - 1
		}
		if !done[id] {
			e.t.Errorf("stream message %s has no done row", id)
		}
	}
	for id := range done {
		switch {
		case gone[id] && seen[id] > 0:
			duplicates += seen[id]
			e.t.Errorf("row of event %s was done before the stream was replaced, and published again", id)
		case !gone[id] && seen[id] == 0:
			lost++
		}
	}
	if lost != 0 || duplicates != 0 || dead != wantDead {
		e.t.Errorf("lost %d, duplicates %d, dead-lettered %d (want %d); counts %v", lost, duplicates, dead, wantDead, c)
	}
	return lost, duplicates, dead
}

// eachMessage calls fn with the headers of each message of the stream
// from sequence from on, in stream order.
func (e *env) eachMessage(from uint64, fn func(nats.Header)) {
	e.t.Helper()
	e.eachStored(from, func(_ uint64, h nats.Header) { fn(h) })
}

// eachStored is eachMessage telling fn each message's sequence too.
func (e *env) eachStored(from uint64, fn func(seq uint64, h nats.Header)) {
	e.t.Helper()
	js := e.jetStream()
	ctx := context.Background()
	s, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	from = max(from, info.State.FirstSeq)
	if info.State.Msgs == 0 || from > info.State.LastSeq {
		return
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: from})
	if err != nil {
		e.t.Fatal(err)
	}
	// A fetch waits until it has as many messages as it asked for: ask
	// for no more than are left, which each message tells.
	for left := info.State.LastSeq - from + 1; left > 0; {
		batch, err := cons.Fetch(int(min(left, 1000)), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			e.t.Fatal(err)
		}
		got := 0
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				e.t.Fatal(err)
			}
			fn(md.Sequence.Stream, m.Headers())
			left = md.NumPending
			got++
		}
		if batch.Error() != nil {
			e.t.Fatal(batch.Error())
		}
		if got == 0 {
			e.t.Fatalf("stream EVENTS gave no message within 5 s with %d left to read", left)
		}
	}
}

// pendingIDs lists the rows that are pending right now: the rows a relay
// holds in flight (claims live in its memory; the rows stay pending until
// settled) and those it has not taken yet.
func pendingIDs(t *testing.T, db *sql.DB) []int64 {
	return rowIDs(t, db, `SELECT id FROM event_queue WHERE status = 'pending'`)
}

// rowIDs runs a query for row ids.
func rowIDs(t *testing.T, db *sql.DB, q string, args ...any) []int64 {
	t.Helper()
	rows, err := db.Query(q, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var ids []int64
	for rows.Next() {
		var id int64
		rows.Scan(&id)
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// waitRowsSettled waits until every row of ids is done or dead-lettered and
// returns how long that took since since; it fails the test naming what
// the rows are when they are not settled within limit of since.
func waitRowsSettled(t *testing.T, db *sql.DB, ids []int64, since time.Time, limit time.Duration, what string) time.Duration {
	t.Helper()
	list, err := json.Marshal(ids)
	if err != nil {
		t.Fatal(err)
	}
	for {
		var open int
		if err := db.QueryRow(`SELECT count(*) FROM event_queue WHERE id IN (SELECT value FROM json_each(?))
			AND status NOT IN ('done', 'dead_lettered')`, string(list)).Scan(&open); err != nil {
			t.Fatal(err)
		}
		if open == 0 {
			return time.Since(since)
		}
		if time.Since(since) > limit {
			t.Fatalf("%d of %d %s not published within %v", open, len(ids), what, limit)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestKill9 kills the relay with SIGKILL six times while 30,000 rows are
// written; every row pending when it died (those it held in flight among
// them) is published within 10 s of the restart: the restarted relay
// leads once it has judged the dead one's heartbeat stale.
func TestKill9(t *testing.T) {
	kill9(t, "relay kill -9", 30000, 6)
}

// TestKill9DeleteDone is TestKill9 with retention.done_rows: delete: a
// kill between the PubAck and the settle leaves the row in the table, a
// settle deletes the row and writes its record together, and every event
// is in the stream once.
func TestKill9DeleteDone(t *testing.T) {
	db, written := kill9(t, "relay kill -9, done rows deleted", 15000, 4, "OUTBOX_RELAY_RETENTION_DONE_ROWS=delete")
	var marked, records int
	if err := db.QueryRow(`SELECT (SELECT count(*) FROM event_queue WHERE status = 'done'), (SELECT count(*) FROM outbox_relay_done_event_queue)`).Scan(&marked, &records); err != nil {
		t.Fatal(err)
	}
	if marked != 0 || records != written {
		t.Errorf("%d rows marked done and %d records, want none marked and %d records", marked, records, written)
	}
}

// kill9 kills the relay (started with env) with SIGKILL kills times while
// rows are written, and checks that every row pending at each kill is
// published within 10 s of the restart, and the end state. It returns the
// database and the rows written.
func kill9(t *testing.T, name string, rows, kills int, env ...string) (*sql.DB, int) {
	e := newEnv(t)
	db := e.open()
	// Slow enough that the writer runs through every kill and recovery.
	w := e.writer("-rows", strconv.Itoa(rows), "-rate", "600")
	e.startRelay("relay", env...)
	rng := rand.New(rand.NewPCG(7, 7))
	var maxRecovery time.Duration
	for k := 0; k < kills; {
		time.Sleep(time.Duration(1000+rng.IntN(1000)) * time.Millisecond)
		// Kill while the relay holds rows, so every kill strands some; every
		// other time with the broker frozen first, so it holds many.
		frozen := k%2 == 1
		if frozen {
			e.nats.Signal(syscall.SIGSTOP)
		}
		want := 1
		if frozen {
			want = 100
		}
		for deadline := time.Now().Add(3 * time.Second); e.metric("relay", "outbox_relay_in_flight_rows") < float64(want) && time.Now().Before(deadline); {
			time.Sleep(2 * time.Millisecond)
		}
		e.killRelay("relay")
		if frozen {
			e.nats.Signal(syscall.SIGCONT)
		}
		k++
		held := pendingIDs(t, db) // what the dead relay held, and more
		time.Sleep(time.Duration(rng.IntN(500)) * time.Millisecond)
		restarted := time.Now()
		e.startRelay("relay", env...)
		rec := waitRowsSettled(t, db, held, restarted, 30*time.Second, fmt.Sprintf("rows held at kill %d", k))
		t.Logf("kill %d: %d rows pending, the relay's in flight among them; all published %v after the restart", k, len(held), rec.Round(time.Millisecond))
		maxRecovery = max(maxRecovery, rec)
	}
	s := e.waitWriter(w)
	e.waitSettled(db, 60*time.Second)
	e.stopRelay("relay")
	lost, dups, dead := e.verify(db, 0)
	if maxRecovery > 10*time.Second {
		t.Errorf("slowest recovery %v, want at most 10 s", maxRecovery)
	}
	summaries = append(summaries, summary{name: name, rows: s.Written, kills: kills, lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: maxRecovery, elapsed: time.Since(e.started)})
	return db, s.Written
}

// TestBrokerOutage stops nats-server for 20 s mid-run: no attempt is spent
// and nothing is dead-lettered.
func TestBrokerOutage(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.startRelay("relay")
	w := e.writer("-rows", "20000", "-rate", "1000")
	time.Sleep(5 * time.Second)
	e.stopNATS()
	stopped := time.Now()
	time.Sleep(20 * time.Second)
	e.startNATS()
	outage := time.Since(stopped)
	s := e.waitWriter(w)
	e.waitSettled(db, 120*time.Second)
	var attempts int
	db.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue`).Scan(&attempts)
	if attempts != 0 {
		t.Errorf("the outage spent %d attempts", attempts)
	}
	deferred := e.metric("relay", `outbox_relay_deferred_total{reason="outage"}`)
	e.stopRelay("relay")
	down, up := e.logCount("relay", "broker unavailable; pausing without spending attempts"), e.logCount("relay", "broker recovered; resuming")
	if down != up || down < 1 || down > 2 {
		t.Errorf("%d 'unavailable' and %d 'recovered' lines for one outage; want one each", down, up)
	}
	lost, dups, dead := e.verify(db, 0)
	if deferred == 0 {
		t.Error("no row was deferred for the outage")
	}
	summaries = append(summaries, summary{name: "broker stopped 20 s", rows: s.Written, outage: outage, lost: lost, duplicates: dups, deadLettered: dead, elapsed: time.Since(e.started)})
}

// TestTwoRelays runs two relays on the same file for the whole run: one
// leads and publishes every row, the other stands by; neither takes the
// other's claims.
func TestTwoRelays(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.startRelay("a")
	e.startRelay("b")
	s := e.waitWriter(e.writer("-rows", "20000", "-rate", "2000"))
	e.waitSettled(db, 60*time.Second)
	reclaimed, published := e.oneLeader(float64(s.Written))
	if reclaimed != 0 {
		t.Errorf("live relays reclaimed %v rows from each other", reclaimed)
	}
	e.stopRelay("a")
	e.stopRelay("b")
	lost, dups, dead := e.verify(db, 0)
	summaries = append(summaries, summary{name: "two relays, one file", rows: s.Written, lost: lost, duplicates: dups, deadLettered: dead, elapsed: time.Since(e.started),
		notes: fmt.Sprintf("published %v", published)})
}

// oneLeader checks that of relays a and b exactly one leads and published
// every one of rows, and returns the rows both reclaimed and published.
func (e *env) oneLeader(rows float64) (reclaimed, published float64) {
	e.t.Helper()
	var leaders []string
	for _, name := range []string{"a", "b"} {
		reclaimed += e.metric(name, "outbox_relay_leases_reclaimed_total")
		p := e.metric(name, "outbox_relay_published_total")
		published += p
		if e.metric(name, "outbox_relay_leader") == 1 {
			leaders = append(leaders, name)
			if p < rows {
				e.t.Errorf("the leader %s published %v of %v rows", name, p, rows)
			}
		} else if p != 0 {
			e.t.Errorf("relay %s stood by but published %v rows", name, p)
		}
	}
	if len(leaders) != 1 {
		e.t.Errorf("leaders %v, want one", leaders)
	}
	return reclaimed, published
}

// TestWriterHoldsLock: the application holds BEGIN IMMEDIATE for 3 s at
// random moments.
func TestWriterHoldsLock(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.startRelay("relay")
	s := e.waitWriter(e.writer("-rows", "20000", "-rate", "1500", "-hold-every", "4s", "-hold-for", "3s"))
	if s.Holds < 2 {
		t.Errorf("writer held the lock only %d times", s.Holds)
	}
	e.waitSettled(db, 60*time.Second)
	e.stopRelay("relay")
	lost, dups, dead := e.verify(db, 0)
	summaries = append(summaries, summary{name: fmt.Sprintf("writer holds lock 3 s (%d times)", s.Holds), rows: s.Written, lost: lost, duplicates: dups, deadLettered: dead, elapsed: time.Since(e.started)})
}

// TestPoisonRows: payloads above the stream's max_msg_size (dead-lettered
// on their first try, with their size and the limit) and invalid event
// types end dead_lettered with a reason; the rest are delivered.
func TestPoisonRows(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.stream(16 << 10)
	e.startRelay("relay", "EVENT_QUEUE_MAX_ATTEMPTS=2")
	s := e.waitWriter(e.writer("-rows", "20000", "-rate", "2000", "-poison-big", "5", "-big-size", "65536", "-poison-type", "5"))
	e.waitSettled(db, 60*time.Second)
	e.stopRelay("relay")
	want := s.PoisonBig + s.PoisonType
	lost, dups, dead := e.verify(db, want)
	rows, err := db.Query(`SELECT length(payload), event_type, attempts, last_error FROM event_queue WHERE status = 'dead_lettered'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var size, attempts int
		var typ, reason string
		rows.Scan(&size, &typ, &attempts, &reason)
		switch {
		case size == 65536 && strings.Contains(reason, "more than the stream's max_msg_size of 16384") && attempts == 1:
		case size < 65536 && strings.Contains(reason, "cannot form a subject"):
		default:
			t.Errorf("dead letter type %q size %d attempts %d reason %q", typ, size, attempts, reason)
		}
	}
	summaries = append(summaries, summary{name: "poison rows (5 too big, 5 bad types)", rows: s.Written, lost: lost, duplicates: dups, deadLettered: dead, elapsed: time.Since(e.started)})
}

// TestOrderedKeys: 70% of 20,000 rows carry one of 50 ordering keys, and
// three rows are too large for the stream. The relay is killed twice and
// the broker stopped for 5 s meanwhile. Each large row with a key parks
// its key (ordering.on_dead_letter: hold): exactly those keys' later rows
// wait, everything else is published. Once the stream takes large
// messages, dead-letters retry un-parks them, and at the end each key's
// messages are in row-id order.
func TestOrderedKeys(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.stream(16 << 10)
	e.startRelay("relay", "EVENT_QUEUE_MAX_ATTEMPTS=2")
	w := e.writer("-rows", "20000", "-rate", "1000", "-keys", "50", "-poison-big", "3", "-big-size", "65536")
	kills := 0
	for _, step := range []string{"kill", "outage", "kill"} {
		time.Sleep(4 * time.Second)
		switch step {
		case "kill":
			e.killRelay("relay")
			e.startRelay("relay", "EVENT_QUEUE_MAX_ATTEMPTS=2")
			kills++
		case "outage":
			e.stopNATS()
			time.Sleep(5 * time.Second)
			e.startNATS()
		}
	}
	s := e.waitWriter(w)
	// Everything settles but the rows behind a parked key.
	parked := func() (keys []string, waiting int) {
		keys = testenv.Strings(t, db, `SELECT DISTINCT ordering_key FROM event_queue WHERE status = 'dead_lettered' AND ordering_key IS NOT NULL ORDER BY 1`)
		db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'pending' AND ordering_key IN
			(SELECT ordering_key FROM event_queue WHERE status = 'dead_lettered')`).Scan(&waiting)
		return keys, waiting
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		c := testenv.Counts(t, db)
		keys, waiting := parked()
		// Each large row is dead-lettered, or waits behind an earlier one
		// of its key (the writer may give two of them one key).
		var loose int
		db.QueryRow(`SELECT count(*) FROM event_queue AS b WHERE length(b.payload) >= 65536 AND b.status <> 'dead_lettered'
			AND NOT (b.status = 'pending' AND EXISTS (SELECT 1 FROM event_queue AS d
				WHERE d.status = 'dead_lettered' AND d.ordering_key = b.ordering_key AND d.id < b.id))`).Scan(&loose)
		if c["pending"] == waiting && c["dead_lettered"] > 0 && loose == 0 {
			t.Logf("parked keys %v hold %d rows; counts %v", keys, waiting, c)
			var passed int
			db.QueryRow(`SELECT count(*) FROM event_queue AS r JOIN event_queue AS d ON r.ordering_key = d.ordering_key
				WHERE d.status = 'dead_lettered' AND r.status = 'done' AND r.id > d.id`).Scan(&passed)
			if passed != 0 {
				t.Errorf("%d rows were published past the dead letter that parks their key", passed)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 90 s: counts %v, parked keys %v holding %d rows", c, keys, waiting)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Let the stream take large messages, and put the dead letters back.
	e.stream(1 << 20)
	if out, err := exec.Command(bin.relay, "dead-letters", "retry", "--all", "--database-path", e.db).CombinedOutput(); err != nil {
		t.Fatalf("dead-letters retry: %v %s", err, out)
	}
	e.waitSettled(db, 60*time.Second)
	e.stopRelay("relay")
	lost, dups, dead := e.verify(db, 0)
	summaries = append(summaries, summary{name: "ordering keys (50 keys, 3 parked, then retried)", rows: s.Written, kills: kills, outage: 5 * time.Second,
		lost: lost, duplicates: dups, deadLettered: dead, elapsed: time.Since(e.started), notes: fmt.Sprintf("%d keyed", s.Keyed)})
}

// TestSignals: SIGTERM drains and exits 0, leaving no heartbeat; with the
// broker frozen (acks never come) a second SIGTERM exits at once, and the
// next relay recovers the rows the first one held.
func TestSignals(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.startRelay("relay", "OUTBOX_RELAY_RELAY_SHUTDOWN_TIMEOUT=30s")
	w := e.writer("-rows", "6000", "-rate", "1000")
	time.Sleep(2 * time.Second)
	start := time.Now()
	e.stopRelay("relay") // SIGTERM; expects exit 0
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("graceful stop took %v", d)
	}
	var instances, claimed int
	db.QueryRow(`SELECT count(*) FROM outbox_relay_instances`).Scan(&instances)
	db.QueryRow(`SELECT count(*) FROM event_queue WHERE status = 'processing' OR claimed_at IS NOT NULL`).Scan(&claimed)
	if instances != 0 || claimed != 0 {
		t.Errorf("after a graceful stop: %d heartbeat rows (the next relay would wait for them to go stale), %d rows claimed", instances, claimed)
	}
	// Freeze the broker: publishes are accepted by the socket, never acked.
	e.startRelay("relay", "OUTBOX_RELAY_RELAY_SHUTDOWN_TIMEOUT=30s")
	time.Sleep(time.Second)
	e.nats.Signal(syscall.SIGSTOP)
	// Acks that left before the freeze settle their rows within moments;
	// rows claimed after it stay held for as long as the broker is frozen.
	time.Sleep(500 * time.Millisecond)
	for deadline := time.Now().Add(5 * time.Second); e.metric("relay", "outbox_relay_in_flight_rows") < 10 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	held := pendingIDs(t, db) // the rows in flight, and those not taken yet
	if e.metric("relay", "outbox_relay_in_flight_rows") == 0 {
		t.Fatal("the relay holds no rows with the broker frozen: nothing to test")
	}
	relay := e.relays["relay"]
	relay.Signal(syscall.SIGTERM)
	time.Sleep(500 * time.Millisecond)
	start = time.Now()
	relay.Signal(syscall.SIGTERM)
	err := relay.Wait()
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("second signal took %v to exit", d)
	}
	if code := relay.State().ExitCode(); code != 1 {
		t.Errorf("exit code after the second signal: %d (%v), want 1", code, err)
	}
	e.nats.Signal(syscall.SIGCONT)
	e.startRelay("relay")
	restarted := time.Now()
	recovery := waitRowsSettled(t, db, held, restarted, 30*time.Second, "rows held at the second signal")
	t.Logf("a relay stopped by a second signal held %d rows; published again %v after the restart", len(held), recovery.Round(time.Millisecond))
	s := e.waitWriter(w)
	e.waitSettled(db, 60*time.Second)
	e.stopRelay("relay")
	lost, dups, dead := e.verify(db, 0)
	var attempts int
	db.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue`).Scan(&attempts)
	if attempts != 0 {
		t.Errorf("stopping relays spent %d attempts", attempts)
	}
	if recovery > 10*time.Second {
		t.Errorf("recovery after the second signal took %v", recovery)
	}
	summaries = append(summaries, summary{name: "SIGTERM, then SIGTERM twice with the broker frozen", rows: s.Written, kills: 1, lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: recovery, elapsed: time.Since(e.started)})
}

// TestTwoRelaysLongLocks: two relays share the file while the application
// holds the write lock for 8 s at a time, longer than busy_timeout and the
// heartbeat staleness: both relays' heartbeats are held up, and neither may
// take the other for dead. (A relay once judged the other right after a
// hold, before the other had had its turn at the lock; a relay now judges
// only after beating on time for a whole staleness window itself.)
func TestTwoRelaysLongLocks(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.startRelay("a")
	e.startRelay("b")
	s := e.waitWriter(e.writer("-rows", "15000", "-rate", "500", "-hold-every", "4s", "-hold-for", "8s"))
	if s.Holds < 2 {
		t.Errorf("writer held the lock only %d times", s.Holds)
	}
	e.waitSettled(db, 60*time.Second)
	// Neither took the other for dead: the leader never changed.
	reclaimed, _ := e.oneLeader(float64(s.Written))
	if reclaimed != 0 {
		t.Errorf("live relays took %v of each other's rows during long locks", reclaimed)
	}
	e.stopRelay("a")
	e.stopRelay("b")
	lost, dups, dead := e.verify(db, 0)
	summaries = append(summaries, summary{name: fmt.Sprintf("two relays, writer holds lock 8 s (%d times)", s.Holds), rows: s.Written, lost: lost, duplicates: dups, deadLettered: dead, elapsed: time.Since(e.started)})
}

// TestStoppedLeaderWritesNothing: the leader is frozen (SIGSTOP) while it
// holds rows in flight; the standby takes over and settles every row;
// when the old leader resumes, the acknowledgements waiting in its socket
// settle nothing (its settle transaction finds it no longer leads), and it
// stands by.
func TestStoppedLeaderWritesNothing(t *testing.T) {
	e := newEnv(t)
	db := e.open()
	e.startRelay("a")
	time.Sleep(time.Second) // a starts first, and leads
	e.startRelay("b")
	w := e.writer("-rows", "10000", "-rate", "1000")
	time.Sleep(2 * time.Second)
	// Freeze the broker so that a holds many rows, then a, then let the
	// broker store what a sent and acknowledge it into a's socket.
	e.nats.Signal(syscall.SIGSTOP)
	for deadline := time.Now().Add(3 * time.Second); e.metric("a", "outbox_relay_in_flight_rows") < 100 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	held := e.metric("a", "outbox_relay_in_flight_rows")
	e.relays["a"].Signal(syscall.SIGSTOP)
	e.nats.Signal(syscall.SIGCONT)
	stopped := time.Now()
	s := e.waitWriter(w)
	e.waitSettled(db, 60*time.Second)
	tookOver := time.Since(stopped)
	if e.metric("b", "outbox_relay_leader") != 1 {
		t.Fatal("b does not lead after a was stopped")
	}
	snapshot := func() (n, processed, attempts int64) {
		db.QueryRow(`SELECT count(*), coalesce(sum(processed_at), 0), coalesce(sum(attempts), 0) FROM event_queue WHERE status = 'done'`).Scan(&n, &processed, &attempts)
		return
	}
	n0, p0, a0 := snapshot()
	e.relays["a"].Signal(syscall.SIGCONT)
	// Its heartbeat and its settle run side by side: wait for both.
	deadline := time.Now().Add(20 * time.Second)
	for e.logCount("a", "standing by: another relay of this outbox table leads") == 0 ||
		e.logCount("a", "rows not settled: this relay lost the lead, or the rows changed meanwhile; the leader publishes what is still pending") == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("a resumed holding %v rows, and within 20 s did not both stand by and report them unsettled", held)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n1, p1, a1 := snapshot(); n1 != n0 || p1 != p0 || a1 != a0 {
		t.Errorf("the resumed leader wrote: done rows %d -> %d, sum(processed_at) %d -> %d, sum(attempts) %d -> %d", n0, n1, p0, p1, a0, a1)
	}
	e.stopRelay("a")
	e.stopRelay("b")
	lost, dups, dead := e.verify(db, 0)
	summaries = append(summaries, summary{name: "leader SIGSTOPped, standby takes over", rows: s.Written, lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: tookOver, elapsed: time.Since(e.started),
		notes: fmt.Sprintf("a held %v rows", held)})
}

// chaosSteps runs steps in turn, 1 to 2 s apart (rng): "outage" stops
// the broker for outage; "kill" kills the relay once it holds a row in
// flight and restarts it on the rows pending; "kill under a frozen
// broker" freezes the broker (SIGSTOP), kills the relay once it holds 100
// rows, sent and not stored, thaws the broker and restarts the relay; any
// other step is other's. kill kills the relay and returns the rows
// pending; restart starts the next relay and waits for them. It returns
// how long the broker was stopped.
func (e *env) chaosSteps(rng *rand.Rand, steps []string, outage time.Duration, kill func() []int64, restart func([]int64), other func(step string)) (stopped time.Duration) {
	for _, step := range steps {
		time.Sleep(time.Duration(1000+rng.IntN(1000)) * time.Millisecond)
		switch step {
		case "outage":
			e.stopNATS()
			at := time.Now()
			time.Sleep(outage)
			e.startNATS()
			stopped = time.Since(at)
		case "kill":
			e.waitInFlight(1)
			restart(kill())
		case "kill under a frozen broker":
			e.nats.Signal(syscall.SIGSTOP)
			e.waitInFlight(100)
			held := kill()
			e.nats.Signal(syscall.SIGCONT)
			restart(held)
		default:
			other(step)
		}
	}
	return stopped
}

// restartOn starts the next relay pause after kill number kill, so that it
// starts on a backlog, and waits up to limit for the rows held at the
// kill (see waitRowsSettled); it logs and returns how long they took.
func (e *env) restartOn(db *sql.DB, held []int64, kill int, pause, limit time.Duration) time.Duration {
	e.t.Helper()
	time.Sleep(pause)
	restarted := time.Now()
	e.startRelay("relay")
	rec := waitRowsSettled(e.t, db, held, restarted, limit, fmt.Sprintf("rows held at kill %d", kill))
	e.t.Logf("kill %d: %d rows pending, all published %v after the restart", kill, len(held), rec.Round(time.Millisecond))
	return rec
}
