package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestTwoFleetRelaysKill9: two relays serve one directory of tenant files
// while an application writes keyed rows into each. Three times the
// relay that leads the files is killed (kill -9) and started again: the
// other takes over every file within 10 s of the kill (a row written
// into each file just after the kill is published by then), every row of
// every file is stored once, with its tenant, and each file's key in
// order. On one host the survivor sees that the killed relay's process is
// gone; relays on two hosts (here: each in a pid namespace of its own,
// as in containers of their own) wait for its heartbeats to go stale.
func TestTwoFleetRelaysKill9(t *testing.T) {
	t.Run("one host", func(t *testing.T) { twoFleetRelaysKill9(t, false) })
	t.Run("two hosts", func(t *testing.T) { twoFleetRelaysKill9(t, true) })
}

func twoFleetRelaysKill9(t *testing.T, hosts bool) {
	if hosts {
		if err := ownPIDNamespaceAllowed(); err != nil {
			t.Skipf("cannot start a relay in a pid namespace of its own: %v", err)
		}
	}
	n := testenv.StartNATS(t)
	dir := t.TempDir()
	tenants := []string{"acme", "globex", "initech", "umbrella", "hooli", "stark"}
	dbs := map[string]*sql.DB{}
	for _, tenant := range tenants {
		path := filepath.Join(dir, tenant+".db")
		if err := os.Rename(testenv.NewDB(t), path); err != nil {
			t.Fatal(err)
		}
		dbs[tenant] = testenv.AppDB(t, path)
	}
	env := []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN=", "OUTBOX_RELAY_RELAY_POLL_INTERVAL=200ms",
		"OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE={tenant}.{event_type}"}
	pattern := filepath.Join(dir, "*.db")
	start := func() *process {
		cmd := exec.Command(buildBinary(t), "run", "--database-path", pattern)
		cmd.Env = append(append(os.Environ(), "OUTBOX_RELAY_LOG_LEVEL=debug"), env...)
		if hosts {
			inOwnPIDNamespace(cmd)
		}
		p := startProcess(t, cmd)
		p.waitFor("relay starting for a fleet of database files")
		return p
	}
	relays := []*process{start(), start()}

	// The application: a keyed row into every file every 20 ms.
	ctx, stopWriting := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	written := map[string]*int{}
	var mu sync.Mutex
	for _, tenant := range tenants {
		n := new(int)
		written[tenant] = n
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				e := testenv.NewEvent("order.placed", []byte(tenant))
				e.OrderingKey = "k"
				if err := testenv.Insert(dbs[tenant], e); err == nil {
					mu.Lock()
					*n++
					mu.Unlock()
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	// Each file's row written after a kill is done once the other relay
	// took the file over.
	allDoneAfter := func(killed time.Time) {
		t.Helper()
		for _, tenant := range tenants {
			var id int64
			testenv.Eventually(t, 30*time.Second, tenant+"'s row written after the kill", func() bool {
				return dbs[tenant].QueryRow(`SELECT max(id) FROM event_queue WHERE created_at > ?`, killed.UnixMilli()).Scan(&id) == nil && id > 0
			})
			testenv.Eventually(t, 30*time.Second, tenant+"'s row done", func() bool {
				var status string
				return dbs[tenant].QueryRow(`SELECT status FROM event_queue WHERE id = ?`, id).Scan(&status) == nil && status == "done"
			})
		}
		took := time.Since(killed)
		t.Logf("every file published again %v after the kill", took.Round(10*time.Millisecond))
		if took > 10*time.Second {
			t.Errorf("the other relay took %v to publish every file's rows after the kill, more than 10 s", took)
		}
	}
	// leaderOf returns the relay that leads most files (the longest-running
	// heartbeat row of each file names its process: its pid in its pid
	// namespace), and how many it leads, once every file has a leader.
	leaderOf := func() (int, int) {
		t.Helper()
		var counts [2]int
		testenv.Eventually(t, 30*time.Second, "every file led", func() bool {
			counts = [2]int{}
			for _, tenant := range tenants {
				var pid int
				var scope string
				if dbs[tenant].QueryRow(`SELECT pid, process_scope FROM outbox_relay_instances ORDER BY started_at, rowid LIMIT 1`).Scan(&pid, &scope) != nil {
					return false
				}
				for i, r := range relays {
					if (!hosts && r.Pid() == pid) || (hosts && strings.HasSuffix(scope, "/"+pidNamespace(t, r.Pid()))) {
						counts[i]++
					}
				}
			}
			return counts[0]+counts[1] == len(tenants)
		})
		if counts[0] >= counts[1] {
			return 0, counts[0]
		}
		return 1, counts[1]
	}
	for range 3 {
		time.Sleep(time.Second) // rows flow through the leaders
		i, led := leaderOf()
		victim := relays[i]
		t.Logf("killing the relay that leads %d files of %d", led, len(tenants))
		if err := victim.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		<-victim.Exited()
		allDoneAfter(killed)
		relays[i] = start()
	}
	stopWriting()
	wg.Wait()

	total := 0
	for _, tenant := range tenants {
		total += *written[tenant]
		want := *written[tenant]
		testenv.Eventually(t, 30*time.Second, tenant+"'s rows done", func() bool { return testenv.Counts(t, dbs[tenant])["done"] == want })
	}
	msgs := testenv.StreamMessages(t, n.JetStream(t), "EVENTS")
	seen := map[string]bool{}
	last := map[string]int64{}
	for _, m := range msgs {
		id, tenant := m.Header.Get(publish.HeaderMsgID), m.Header.Get(publish.HeaderTenant)
		if seen[id] {
			t.Errorf("event %s stored twice", id)
		}
		seen[id] = true
		if m.Subject != "events."+tenant+".order.placed" || string(m.Data) != tenant {
			t.Errorf("message on %s with tenant %q and payload %q", m.Subject, tenant, m.Data)
		}
		row, _ := strconv.ParseInt(m.Header.Get(publish.HeaderRowID), 10, 64)
		if row <= last[tenant] {
			t.Errorf("%s: row %d stored after row %d: key k out of order", tenant, row, last[tenant])
		}
		last[tenant] = row
	}
	if len(seen) != total {
		t.Errorf("%d events in the stream, %d written", len(seen), total)
	}
	t.Log(fmt.Sprintf("%d rows in %d files, 3 kills", total, len(tenants)))
}
