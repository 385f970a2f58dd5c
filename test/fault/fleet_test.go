//go:build fault

package fault

import (
	"context"
	"database/sql"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestFleet: two relays serve a directory of tenant files (a
// database.path pattern) while an application writes keyed rows into
// four of them. Meanwhile a fifth file is created and written, a sixth,
// all of its rows published, is removed, each relay is killed with
// SIGKILL once and started again, and the broker is stopped for 3 s. A
// seventh file, with rows to publish, is held locked by its application
// (its write lock) from before the relays start until 30 s have passed
// and every other file's rows are published: it affects itself alone.
// Every row of every file ends done and in the stream once, with its
// file's tenant, each file's keys in row order.
func TestFleet(t *testing.T) {
	e := newEnv(t)
	tenants := filepath.Join(e.dir, "tenants")
	if err := os.Mkdir(tenants, 0o755); err != nil {
		t.Fatal(err)
	}
	files := map[string]*sql.DB{}
	migrate := func(tenant string) string {
		path := filepath.Join(tenants, tenant+".db")
		if out, err := exec.Command(bin.relay, "migrate", "--database-path", path).CombinedOutput(); err != nil {
			t.Fatalf("migrate %s: %v %s", tenant, err, out)
		}
		db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=30000")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		files[tenant] = db
		return path
	}
	for _, tenant := range []string{"acme", "globex", "initech", "umbrella", "gone", "locked"} {
		migrate(tenant)
	}
	const lockedRows = 300
	for i := 0; i < lockedRows; i++ {
		ev := testenv.NewEvent("Locked", []byte("locked"))
		ev.OrderingKey = "k" + strconv.Itoa(i%5)
		if err := testenv.Insert(files["locked"], ev); err != nil {
			t.Fatal(err)
		}
	}
	hold, err := files["locked"].Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	if _, err := hold.ExecContext(context.Background(), `BEGIN IMMEDIATE`); err != nil {
		t.Fatal(err)
	}
	lockedAt := time.Now()
	relayEnv := []string{"OUTBOX_RELAY_DATABASE_PATH=" + filepath.Join(tenants, "*.db"),
		"OUTBOX_RELAY_STREAM_SUBJECT_TEMPLATE={tenant}.{event_type}"}
	e.startRelay("a", relayEnv...)
	e.startRelay("b", relayEnv...)

	// gone's rows are published, then its file is removed.
	e.waitWriter(e.writerOn(filepath.Join(tenants, "gone.db"), "-rows", "300", "-rate", "1000", "-keys", "5"))
	e.waitSettled(files["gone"], 30*time.Second)
	goneIDs := eventIDs(t, files["gone"])
	for _, suffix := range []string{"", "-wal", "-shm"} {
		os.Remove(filepath.Join(tenants, "gone.db"+suffix))
	}
	delete(files, "gone")

	var writers []*writer
	for _, tenant := range []string{"acme", "globex", "initech", "umbrella"} {
		writers = append(writers, e.writerOn(filepath.Join(tenants, tenant+".db"), "-rows", "4000", "-rate", "400", "-keys", "20"))
	}
	time.Sleep(2 * time.Second)
	writers = append(writers, e.writerOn(migrate("late"), "-rows", "3000", "-rate", "400", "-keys", "20"))
	time.Sleep(time.Second)
	e.killRelay("a")
	time.Sleep(time.Second)
	e.startRelay("a", relayEnv...)
	time.Sleep(time.Second)
	e.stopNATS()
	stopped := time.Now()
	time.Sleep(3 * time.Second)
	e.startNATS()
	outage := time.Since(stopped)
	time.Sleep(time.Second)
	e.killRelay("b")
	time.Sleep(time.Second)
	e.startRelay("b", relayEnv...)

	written := 0
	for _, w := range writers {
		written += e.waitWriter(w).Written
	}
	for tenant, db := range files {
		if tenant != "locked" {
			e.waitSettled(db, 60*time.Second) // while locked is held
		}
	}
	time.Sleep(30*time.Second - time.Since(lockedAt))
	if c := testenv.Counts(t, files["locked"]); c["pending"] != lockedRows {
		t.Errorf("the locked file's rows %v while its lock was held, want %d pending", c, lockedRows)
	}
	if _, err := hold.ExecContext(context.Background(), `ROLLBACK`); err != nil {
		t.Fatal(err)
	}
	hold.Close()
	e.waitSettled(files["locked"], 60*time.Second)
	e.stopRelay("a")
	e.stopRelay("b")

	// Every done row's event once in the stream, from its own file.
	tenantOf := map[string]string{}
	dead := 0
	for tenant, db := range files {
		for _, id := range eventIDs(t, db) {
			tenantOf[id] = tenant
		}
		dead += testenv.Counts(t, db)["dead_lettered"]
	}
	for _, id := range goneIDs {
		tenantOf[id] = "gone"
	}
	seen := map[string]int{}
	lastRow := map[string]int64{} // per tenant and key
	duplicates := 0
	e.eachMessage(1, func(h nats.Header) {
		id, tenant := h.Get("Nats-Msg-Id"), h.Get("Outbox-Tenant")
		if seen[id]++; seen[id] > 1 {
			duplicates++
		}
		if tenantOf[id] != tenant {
			t.Errorf("message %s carries tenant %q, its row is in %q", id, tenant, tenantOf[id])
		}
		if key := h.Get("Outbox-Ordering-Key"); key != "" {
			row, _ := strconv.ParseInt(h.Get("Outbox-Row-Id"), 10, 64)
			if row <= lastRow[tenant+"/"+key] {
				t.Errorf("%s, key %s: row %d stored after row %d", tenant, key, row, lastRow[tenant+"/"+key])
			}
			lastRow[tenant+"/"+key] = row
		}
	})
	lost := 0
	for id := range tenantOf {
		if seen[id] == 0 {
			lost++
		}
	}
	if lost != 0 || duplicates != 0 || dead != 0 {
		t.Errorf("lost %d, duplicates %d, dead-lettered %d", lost, duplicates, dead)
	}
	summaries = append(summaries, summary{name: "fleet: 2 relays on 7 files, one added, one removed, one held locked by its application for 30 s, each relay kill -9 once, broker stopped 3 s",
		rows: written + len(goneIDs) + lockedRows, kills: 2, outage: outage, lost: lost, duplicates: duplicates, deadLettered: dead, elapsed: time.Since(e.started)})
}

// eventIDs lists the event ids of db's done rows.
func eventIDs(t *testing.T, db *sql.DB) []string {
	t.Helper()
	rows, err := db.Query(`SELECT event_id FROM event_queue WHERE status = 'done'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	return ids
}
