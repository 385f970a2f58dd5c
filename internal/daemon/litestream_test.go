package daemon_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/child"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// litestreamVersion is the Litestream release the restore test runs;
// .ci/run installs it and names it in LITESTREAM.
const litestreamVersion = "v0.5.16"

// TestLitestreamRestoreMidRun: Litestream replicates the application's
// file to a file replica while the application places orders (each with
// its event, in one transaction) and the relay publishes them. Everything
// stops, the replica is restored to a point in the middle, where rows the
// relay had published were still pending, and rows written later are
// missing. Past the stream's duplicate window (1 s), a relay on the
// restored file settles the pending rows from the messages the stream
// holds, counts the missing rows' messages as orphans and publishes only
// the rows written since: the stream holds each event once. Without the
// reconciliation the same run stores every row pending in the backup twice.
func TestLitestreamRestoreMidRun(t *testing.T) {
	bin := litestreamBin(t)
	t.Parallel()
	for _, reconciled := range []bool{true, false} {
		t.Run(fmt.Sprint("reconciled=", reconciled), func(t *testing.T) {
			t.Parallel()
			n := testenv.StartNATS(t)
			js := n.JetStream(t)
			testenv.EventsStream(t, js, 0)
			path := testenv.NewDB(t)
			app := testenv.AppDB(t, path)
			testenv.MustExec(t, app, `CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)`)
			ls := startLitestream(t, bin, path)
			var hold sync.RWMutex
			h := startRelay(t, path, n.URL(), harnessOptions{wrapStore: func(s relay.Store) relay.Store { return heldSettles{s, &hold} }})
			stopOrders := placeOrders(t, app)

			// The application writes and the relay publishes.
			testenv.Eventually(t, 30*time.Second, "150 rows done", func() bool { return testenv.Counts(t, app)["done"] >= 150 })
			// The relay's settles wait (once the one under way ends): it
			// goes on publishing, and its rows stay pending.
			hold.Lock()
			held := true
			defer func() {
				if held { // the test failed: let the relay stop
					hold.Unlock()
				}
			}()
			done := testenv.Counts(t, app)["done"]
			testenv.Eventually(t, 30*time.Second, "50 rows published and pending", func() bool { return streamLen(t, js) >= done+50 })
			// The point in time: the second local sync after the one seen
			// now begins after it, so it holds those rows, pending; it is
			// in the replica before a settle can go on.
			point := ls.localTXID() + 2
			testenv.Eventually(t, 30*time.Second, fmt.Sprintf("transaction %x in the replica", point), func() bool { return ls.replicaTXID() >= point })
			var lastBefore int64
			if err := app.QueryRow(`SELECT max(id) FROM event_queue`).Scan(&lastBefore); err != nil {
				t.Fatal(err)
			}
			hold.Unlock()
			held = false
			// Rows written from now on are after the point in time.
			testenv.Eventually(t, 30*time.Second, "100 rows written later done", func() bool {
				var k int
				if err := app.QueryRow(`SELECT count(*) FROM event_queue WHERE id > ? AND status = 'done'`, lastBefore).Scan(&k); err != nil {
					t.Fatal(err)
				}
				return k >= 100
			})
			stopOrders()
			var total int
			if err := app.QueryRow(`SELECT count(*) FROM event_queue`).Scan(&total); err != nil {
				t.Fatal(err)
			}
			waitAllSettled(t, app, total, 30*time.Second)
			if err := h.stop(); err != nil {
				t.Fatal(err)
			}
			ls.stop()
			final := storedRows(t, app)
			if k := streamLen(t, js); k != len(final) {
				t.Fatalf("before the restore the stream holds %d messages, want one per row (%d)", k, len(final))
			}

			restored := filepath.Join(t.TempDir(), "restored.db")
			began := time.Now()
			ls.restore(point, restored)
			restoredIn := time.Since(began)
			rapp := testenv.AppDB(t, restored)
			backup := storedRows(t, rapp)
			pending := fromTheMiddle(t, rapp, backup, final)

			pastTheWindow(t, js)
			// The application goes on, on the restored file.
			const later = 50
			for range later {
				if err := placeOrder(rapp); err != nil {
					t.Fatal(err)
				}
			}
			ho := harnessOptions{window: time.Second}
			if !reconciled {
				ho.mutateOpt = func(o *relay.Options) { o.Reconcile = nil }
			}
			began2 := time.Now()
			h2 := startRelay(t, restored, n.URL(), ho)
			waitAllSettled(t, rapp, len(backup)+later, 30*time.Second)
			settledIn := time.Since(began2)
			msgs := readHeaders(t, js)
			stored := map[string]int{}
			for _, m := range msgs {
				stored[m.msgID]++
			}
			if !reconciled {
				twice := 0
				for _, k := range stored {
					if k == 2 {
						twice++
					}
				}
				if len(msgs) != len(final)+pending+later || twice != pending {
					t.Fatalf("without reconciliation the stream holds %d messages, %d events twice; want every row pending in the backup twice (%d messages, %d twice)",
						len(msgs), twice, len(final)+pending+later, pending)
				}
				return
			}
			if len(msgs) != len(final)+later || len(stored) != len(msgs) {
				t.Fatalf("the stream holds %d messages of %d events, want each of the %d events once", len(msgs), len(stored), len(final)+later)
			}
			// Every row is done at the sequence of its own message.
			var origin string
			if err := rapp.QueryRow(`SELECT origin FROM outbox_relay_published`).Scan(&origin); err != nil {
				t.Fatal(err)
			}
			bySeq := map[uint64]streamed{}
			for _, m := range msgs {
				bySeq[m.seq] = m
			}
			for _, r := range storedRows(t, rapp) {
				if m := bySeq[r.seq]; r.status != "done" || m != (streamed{r.seq, r.eventID, strconv.FormatInt(r.id, 10), origin}) {
					t.Fatalf("row %d (%s) of the restored file is %s at sequence %d, which holds %+v", r.id, r.eventID, r.status, r.seq, m)
				}
			}
			if err := h2.stop(); err != nil {
				t.Fatal(err)
			}
			orphans := len(final) - len(backup)
			if got := metrics.Value(h2.metrics.Reconciled); got != float64(pending) {
				t.Errorf("reconciled_rows_total %v, want the %d rows pending in the backup", got, pending)
			}
			if got := metrics.Value(h2.metrics.ReconcileOrphans); got != float64(orphans) {
				t.Errorf("reconcile_orphans_total %v, want the %d rows missing from the backup", got, orphans)
			}
			if got := metrics.Value(h2.metrics.Published); got != later {
				t.Errorf("published_total %v, want the %d rows written after the restore", got, later)
			}
			ended := h2.logs.FilterMessage("reconciled the outbox with the stream; publishing").All()
			if len(ended) != 1 {
				t.Fatalf("%d lines saying the reconciliation ended, want 1", len(ended))
			}
			f := ended[0].ContextMap()
			if fmt.Sprint(f["settled"]) != fmt.Sprint(pending) || fmt.Sprint(f["orphans"]) != fmt.Sprint(orphans) {
				t.Errorf("the reconciliation's line says %v, want %d settled and %d orphans", f, pending, orphans)
			}
			if logCount(h2, "messages of this outbox in the stream whose rows are not in the file: rows written after the point in time of a restored backup, say; not re-created") != 1 {
				t.Errorf("no warning of the orphans")
			}
			var led time.Duration
			if l := h2.logs.FilterMessage("leading: this relay claims and publishes the rows").All(); len(l) > 0 {
				led = l[0].Time.Sub(began2)
			}
			t.Logf("restored %d of %d rows (%d pending, %d missing) in %v; the relay led %v after it started, read %v messages and settled %v rows in %v, and had every row settled %v after it started",
				len(backup), len(final), pending, orphans, restoredIn.Round(time.Millisecond), led.Round(time.Millisecond), f["read"], f["settled"], f["took"], settledIn.Round(time.Millisecond))
		})
	}
}

// fromTheMiddle checks that backup, the rows of the restored file rapp,
// is the start of final, the rows once everything had stopped: the first
// rows, each with its event id; some done, others pending that were done
// in the end; and not all of them. Each order is there with its event, no
// more. It returns how many rows are pending.
func fromTheMiddle(t *testing.T, rapp *sql.DB, backup, final []storedRow) (pending int) {
	t.Helper()
	if len(backup) >= len(final) {
		t.Fatalf("the backup holds %d rows, the file held %d in the end: not from the middle", len(backup), len(final))
	}
	done := 0
	for i, r := range backup {
		if f := final[i]; r.id != f.id || r.eventID != f.eventID || f.status != "done" {
			t.Fatalf("row %d of the backup is %+v, the file's was %+v", r.id, r, f)
		}
		switch r.status {
		case "done":
			done++
		case "pending":
			pending++
		default:
			t.Fatalf("row %d of the backup is %s", r.id, r.status)
		}
	}
	if done < 150 || pending < 50 {
		t.Fatalf("the backup holds %d rows done and %d pending, want at least 150 and 50", done, pending)
	}
	var orders int
	if err := rapp.QueryRow(`SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		t.Fatal(err)
	}
	if orders != len(backup) {
		t.Fatalf("the backup holds %d orders and %d events", orders, len(backup))
	}
	return pending
}

// heldSettles holds the relay's settles while hold is locked, as a relay
// whose messages are stored but whose writes wait: its rows stay pending.
type heldSettles struct {
	relay.Store
	hold *sync.RWMutex
}

func (s heldSettles) Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) ([]int, error) {
	s.hold.RLock()
	defer s.hold.RUnlock()
	return s.Store.Settle(ctx, outs, scanFrom)
}

// placeOrders is the application: it places orders, each with its event
// in one transaction, until the function it returns is called (or the
// test ends), which returns once it has stopped.
func placeOrders(t *testing.T, app *sql.DB) (stopOrders func()) {
	stop, stopped := make(chan struct{}), make(chan struct{})
	var once sync.Once
	stopOrders = func() {
		once.Do(func() { close(stop) })
		<-stopped
	}
	t.Cleanup(stopOrders)
	go func() {
		defer close(stopped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := placeOrder(app); err != nil {
				t.Error(err)
				return
			}
			time.Sleep(2 * time.Millisecond) // the application's pace, leaving the relay the lock
		}
	}()
	return stopOrders
}

func placeOrder(app *sql.DB) error {
	tx, err := app.Begin()
	if err != nil {
		return err
	}
	defer tx.Rollback()
	res, err := tx.Exec(`INSERT INTO orders (item) VALUES ('book')`)
	if err != nil {
		return err
	}
	id, err := res.LastInsertId()
	if err != nil {
		return err
	}
	if _, err := tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'OrderPlaced', ?)`,
		event.NewID(), fmt.Sprintf(`{"order":%d}`, id)); err != nil {
		return err
	}
	return tx.Commit()
}

// streamLen is how many messages the stream EVENTS holds.
func streamLen(t *testing.T, js jetstream.JetStream) int {
	t.Helper()
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return int(info.State.Msgs)
}

// streamed is a message of the stream EVENTS: its sequence and the
// headers that say whose it is.
type streamed struct {
	seq                  uint64
	msgID, rowID, origin string
}

// readHeaders reads the headers of every message of the stream EVENTS in
// order, with an ordered consumer (faster than a request a message).
func readHeaders(t *testing.T, js jetstream.JetStream) []streamed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs == 0 {
		return nil
	}
	c, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{HeadersOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	var out []streamed
	for len(out) == 0 || out[len(out)-1].seq < info.State.LastSeq {
		b, err := c.FetchNoWait(500)
		if err != nil {
			t.Fatal(err)
		}
		for m := range b.Messages() {
			meta, err := m.Metadata()
			if err != nil {
				t.Fatal(err)
			}
			h := m.Headers()
			out = append(out, streamed{meta.Sequence.Stream, h.Get(publish.HeaderMsgID), h.Get(publish.HeaderRowID), h.Get(publish.HeaderOrigin)})
		}
		if err := b.Error(); err != nil {
			t.Fatal(err)
		}
		if ctx.Err() != nil {
			t.Fatalf("reading the stream: %d messages in 30 s, short of sequence %d", len(out), info.State.LastSeq)
		}
	}
	return out
}

// litestreamBin returns the Litestream binary: $LITESTREAM, else
// litestream on the PATH. CI must have it; elsewhere the test is skipped
// without it.
func litestreamBin(t *testing.T) string {
	t.Helper()
	install := "GOBIN=<dir> go install github.com/benbjohnson/litestream/cmd/litestream@" + litestreamVersion
	missing := func(why string) {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s; CI must install Litestream %s (.ci/run: %s, LITESTREAM=<dir>/litestream)", why, litestreamVersion, install)
		}
		t.Skipf("%s; install Litestream %s with %s and put it on the PATH or name it in LITESTREAM", why, litestreamVersion, install)
	}
	bin := os.Getenv("LITESTREAM")
	if bin == "" {
		var err error
		if bin, err = exec.LookPath("litestream"); err != nil {
			missing("litestream is not on the PATH and LITESTREAM is not set")
		}
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		missing(fmt.Sprintf("%s version: %v", bin, err))
	}
	// The test speaks the command line of 0.5 (LTX files, -txid).
	if v := strings.TrimSpace(string(out)); !strings.HasPrefix(v, "v0.5.") {
		missing(fmt.Sprintf("%s is Litestream %s", bin, v))
	}
	return bin
}

// litestream is `litestream replicate` running on one database, to a
// file replica.
type litestream struct {
	t      *testing.T
	bin    string
	db     string
	config string
	p      *child.Process
}

// startLitestream starts replicating db to a file replica, syncing every
// 100 ms, and waits for its first sync to reach the replica.
func startLitestream(t *testing.T, bin, db string) *litestream {
	t.Helper()
	dir := t.TempDir()
	l := &litestream{t: t, bin: bin, db: db, config: filepath.Join(dir, "litestream.yml")}
	config := fmt.Sprintf(`logging:
  level: info
  type: json
  stderr: true
dbs:
  - path: %s
    monitor-interval: 100ms
    replica:
      type: file
      path: %s
      sync-interval: 100ms
`, strconv.Quote(db), strconv.Quote(filepath.Join(dir, "replica")))
	if err := os.WriteFile(l.config, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := child.Start(exec.Command(bin, "replicate", "-no-expand-env", "-config", l.config))
	if err != nil {
		t.Fatal(err)
	}
	l.p = p
	t.Cleanup(func() {
		if p.State() == nil {
			p.Kill()
		}
	})
	testenv.Eventually(t, 30*time.Second, "Litestream's first sync in the replica", func() bool {
		select {
		case <-p.Exited():
			t.Fatal(p.ExitedEarly("its first sync"))
		default:
		}
		return l.replicaTXID() > 0
	})
	return l
}

// run runs a litestream command on l's configuration and returns what it
// wrote on stdout.
func (l *litestream) run(args ...string) []byte {
	l.t.Helper()
	cmd := exec.Command(l.bin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		l.t.Fatalf("litestream %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.Bytes())
	}
	return out
}

// localTXID is the last transaction Litestream has synced from the
// database's WAL (the replica gets it at its next sync).
func (l *litestream) localTXID() uint64 {
	l.t.Helper()
	var st []struct {
		LocalTXID string `json:"local_txid"`
	}
	out := l.run("status", "-no-expand-env", "-config", l.config, "-json", l.db)
	if err := json.Unmarshal(out, &st); err != nil || len(st) != 1 {
		l.t.Fatalf("litestream status: %v\n%s", err, out)
	}
	return parseTXID(l.t, st[0].LocalTXID)
}

// replicaTXID is the last transaction in the replica; 0 before the first.
func (l *litestream) replicaTXID() uint64 {
	l.t.Helper()
	var files []struct {
		MaxTXID string `json:"max_txid"`
	}
	out := l.run("ltx", "-no-expand-env", "-config", l.config, "-json", "-level", "0", l.db)
	if err := json.Unmarshal(out, &files); err != nil {
		l.t.Fatalf("litestream ltx: %v\n%s", err, out)
	}
	var last uint64
	for _, f := range files {
		last = max(last, parseTXID(l.t, f.MaxTXID))
	}
	return last
}

func parseTXID(t *testing.T, s string) uint64 {
	t.Helper()
	id, err := strconv.ParseUint(s, 16, 64)
	if err != nil {
		t.Fatalf("transaction id %q: %v", s, err)
	}
	return id
}

// stop stops replicating (SIGINT: Litestream syncs once more and exits).
func (l *litestream) stop() {
	l.t.Helper()
	if err := l.p.Stop(os.Interrupt, 30*time.Second); err != nil {
		l.t.Fatalf("litestream replicate: %v", err)
	}
}

// restore restores the replica as it was at transaction txid to out.
func (l *litestream) restore(txid uint64, out string) {
	l.t.Helper()
	l.run("restore", "-no-expand-env", "-config", l.config, "-txid", fmt.Sprintf("%016x", txid), "-integrity-check", "full", "-o", out, l.db)
}
