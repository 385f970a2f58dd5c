package main

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"

	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// groupRow is a row of the outbox table as the group tests read it back.
type groupRow struct {
	id        int64
	group     string // "" : none
	key       string
	eventType string
	status    string
	attempts  int
	lastError string
	streamSeq uint64
	available int64 // available_at, Unix ms
}

// tableRows reads every row of the outbox table in id order.
func tableRows(db *sql.DB) ([]groupRow, error) {
	rows, err := db.Query(`SELECT id, coalesce(atomic_group, ''), coalesce(ordering_key, ''), event_type, status, attempts,
		coalesce(last_error, ''), coalesce(stream_seq, 0), coalesce(available_at, 0) FROM event_queue ORDER BY id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []groupRow
	for rows.Next() {
		var r groupRow
		if err := rows.Scan(&r.id, &r.group, &r.key, &r.eventType, &r.status, &r.attempts, &r.lastError, &r.streamSeq, &r.available); err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// readTable is tableRows for the test's goroutine.
func readTable(t *testing.T, db *sql.DB) []groupRow {
	t.Helper()
	rows, err := tableRows(db)
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

// groupsOf returns the row ids of each atomic group among rows, in id
// order.
func groupsOf(rows []groupRow) map[string][]int64 {
	groups := map[string][]int64{}
	for _, r := range rows {
		if r.group != "" {
			groups[r.group] = append(groups[r.group], r.id)
		}
	}
	return groups
}

// byRowID indexes stream messages by their Outbox-Row-Id.
func byRowID(t *testing.T, msgs []*jetstream.RawStreamMsg) map[int64]*jetstream.RawStreamMsg {
	t.Helper()
	out := map[int64]*jetstream.RawStreamMsg{}
	for _, m := range msgs {
		id, err := strconv.ParseInt(m.Header.Get(publish.HeaderRowID), 10, 64)
		if err != nil {
			t.Fatalf("sequence %d: %s %q", m.Sequence, publish.HeaderRowID, m.Header.Get(publish.HeaderRowID))
		}
		out[id] = m
	}
	return out
}

// partialGroup returns a description of the first atomic group of which
// msgs hold some rows but not all ("" when there is none); groups maps
// each group to its row ids.
func partialGroup(msgs []*jetstream.RawStreamMsg, groups map[string][]int64) string {
	stored := map[int64]uint64{}
	for _, m := range msgs {
		if id, err := strconv.ParseInt(m.Header.Get(publish.HeaderRowID), 10, 64); err == nil {
			stored[id] = m.Sequence
		}
	}
	for name, ids := range groups {
		var in []string
		for _, id := range ids {
			if seq, ok := stored[id]; ok {
				in = append(in, fmt.Sprintf("row %d at %d", id, seq))
			}
		}
		if len(in) > 0 && len(in) < len(ids) {
			return fmt.Sprintf("atomic group %q (rows %v) has %d of its %d rows in the stream: %s", name, ids, len(in), len(ids), strings.Join(in, ", "))
		}
	}
	return ""
}

// checkGroupsWhole fails unless each atomic group of rows whose size is at
// most limit is in the stream (msgs, by row id) whole, done, its rows in
// consecutive sequences in id order and, for a group of two rows or more,
// in one atomic batch (one Nats-Batch-Id, consecutive
// Nats-Batch-Sequence numbers; other whole groups may share the batch); a
// group of one row is in a batch only with other groups. A larger
// group must be dead-lettered whole, none of it in the stream, with a
// reason that says it can never be stored whole. Every row of a group has
// spent as many attempts as the others. It returns the groups of each
// size, stored or not.
func checkGroupsWhole(t *testing.T, rows []groupRow, msgs map[int64]*jetstream.RawStreamMsg, limit int) map[int]int {
	t.Helper()
	byID := map[int64]groupRow{}
	for _, r := range rows {
		byID[r.id] = r
	}
	// A batch holds whole groups (several may share one) or rows of no
	// group, never both.
	batchSize, ungrouped := map[string]int{}, map[string]bool{}
	for id, m := range msgs {
		if b := m.Header.Get(jetstreamext.BatchIDHeader); b != "" {
			batchSize[b]++
			if byID[id].group == "" {
				ungrouped[b] = true
			}
		}
	}
	sizes := map[int]int{}
	for name, ids := range groupsOf(rows) {
		sizes[len(ids)]++
		first := byID[ids[0]]
		for _, id := range ids {
			if r := byID[id]; r.attempts != first.attempts {
				t.Errorf("atomic group %q: row %d spent %d attempts, row %d %d", name, id, r.attempts, first.id, first.attempts)
			}
		}
		if len(ids) > limit {
			for _, id := range ids {
				r := byID[id]
				if r.status != "dead_lettered" || !strings.Contains(r.lastError, "can never be stored whole") {
					t.Errorf("atomic group %q of %d rows (the server's limit is %d): row %d %s (%q), want dead-lettered as never stored whole", name, len(ids), limit, id, r.status, r.lastError)
				}
				if m, ok := msgs[id]; ok {
					t.Errorf("atomic group %q of %d rows (the server's limit is %d): row %d stored at sequence %d", name, len(ids), limit, id, m.Sequence)
				}
			}
			continue
		}
		var start *jetstream.RawStreamMsg
		var batch string
		for i, id := range ids {
			m, ok := msgs[id]
			if r := byID[id]; !ok || r.status != "done" {
				t.Errorf("atomic group %q (rows %v): row %d %s, in the stream: %v", name, ids, id, r.status, ok)
				break
			}
			if i == 0 {
				start, batch = m, m.Header.Get(jetstreamext.BatchIDHeader)
			}
			got := m.Header.Get(jetstreamext.BatchIDHeader)
			switch {
			case m.Sequence != start.Sequence+uint64(i):
				t.Errorf("atomic group %q (rows %v): row %d at sequence %d, its first row at %d", name, ids, id, m.Sequence, start.Sequence)
			case got != "" && ungrouped[got]:
				t.Errorf("atomic group %q (rows %v): row %d in atomic batch %s, which holds rows of no group too", name, ids, id, got)
			case len(ids) == 1 && got != "" && batchSize[got] < 2:
				t.Errorf("atomic group %q of one row stored alone in atomic batch %s", name, got)
			case len(ids) > 1 && (got == "" || got != batch):
				t.Errorf("atomic group %q (rows %v): row %d in atomic batch %q, its first row in %q", name, ids, id, got, batch)
			case len(ids) > 1 && m.Header.Get(jetstreamext.BatchSeqHeader) != strconv.Itoa(batchSeq(start)+i):
				t.Errorf("atomic group %q: row %d is message %s of its batch, want %d", name, id, m.Header.Get(jetstreamext.BatchSeqHeader), batchSeq(start)+i)
			}
		}
	}
	return sizes
}

// batchSeq returns a message's Nats-Batch-Sequence (0: none).
func batchSeq(m *jetstream.RawStreamMsg) int {
	n, _ := strconv.Atoi(m.Header.Get(jetstreamext.BatchSeqHeader))
	return n
}

// checkStreamSeqs fails unless every done row records the sequence its
// message is stored at.
func checkStreamSeqs(t *testing.T, rows []groupRow, msgs map[int64]*jetstream.RawStreamMsg) {
	t.Helper()
	for _, r := range rows {
		if m, ok := msgs[r.id]; r.status == "done" && (!ok || m.Sequence != r.streamSeq) {
			t.Errorf("row %d done at stream sequence %d, its message is at %v", r.id, r.streamSeq, m)
		}
	}
}

// appTx returns the rows of one application transaction in the order it
// writes them, from units: the rows of each atomic group, in order, and
// plain rows (units of one row without a group). The units' rows are
// mixed as a transaction may mix them: between a group's first and last
// row it writes no other row of the group's ordering keys (rows without a
// key and rows of other keys may come between, another group's too).
func appTx(rng *rand.Rand, units [][]testenv.Event) []testenv.Event {
	keysOf := func(u []testenv.Event) []string {
		var keys []string
		for _, ev := range u {
			if ev.OrderingKey != "" && !slices.Contains(keys, ev.OrderingKey) {
				keys = append(keys, ev.OrderingKey)
			}
		}
		return keys
	}
	next := make([]int, len(units))
	locked := map[string]bool{} // the keys of the groups begun and not ended
	var out []testenv.Event
	for {
		var can []int
		for i, u := range units {
			switch {
			case next[i] == len(u):
			case next[i] > 0: // a group begun
				can = append(can, i)
			case !slices.ContainsFunc(keysOf(u), func(k string) bool { return locked[k] }):
				can = append(can, i)
			}
		}
		if len(can) == 0 {
			return out
		}
		i := can[rng.IntN(len(can))]
		u := units[i]
		out = append(out, u[next[i]])
		next[i]++
		if len(u) > 1 && (next[i] == 1 || next[i] == len(u)) {
			for _, k := range keysOf(u) {
				locked[k] = next[i] == 1
			}
		}
	}
}

// TestAtomicGroupsSurviveChaos: the application writes rows of ordering
// keys, rows without a key and atomic groups (1 to 30 rows, some over
// several keys and rows without a key, some without keys at all), each
// group in one transaction with other groups and plain rows, while the
// relay is killed (kill -9) twice, the first time under a standby that
// takes over, the broker goes away and comes back, and the broker refuses
// the rows of one subject, some of them in groups, until the relay's user
// may publish to it. The server takes atomic batches of at most 20
// messages. Meanwhile a reader samples the stream and fails on any group
// it finds in part. At the end every row is done, but the groups over 20
// rows, dead-lettered whole, none of them in the stream; each event is in
// the stream once, each key's messages in row-id order, each group whole in
// consecutive sequences as one atomic batch.
func TestAtomicGroupsSurviveChaos(t *testing.T) {
	const (
		seed  = 20261202
		limit = 20 // the server's atomic batch limit
		keys  = 12
	)
	n := testenv.StartNATS(t, relayUser("events.Restricted"), func(o *server.Options) { o.JetStreamLimits.MaxBatchSize = limit })
	js := n.JetStream(t)
	testenv.EventsStream(t, js, 0)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	// Groups over the limit are dead-lettered; with skip the later rows of
	// their keys go on, so that every other row ends done.
	env := chaosEnv(n, "OUTBOX_RELAY_ORDERING_ON_DEAD_LETTER=skip")
	relay := func() *process {
		return startDaemon(t, env, "run", "--database-path", path)
	}
	var relays []*process
	var phases []string // set below
	defer func() {
		if t.Failed() {
			t.Logf("steps: %s", strings.Join(phases, ", "))
			dumpUnsettled(t, app, relays)
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()

	// The application: a transaction every 100 ms (every 400 ms from the
	// 120th on, should the chaos take long), until a while after the last
	// relay starts. Rows of events.Restricted, refused until the grant,
	// are written from the takeover on.
	var restricted atomic.Bool
	finish := make(chan struct{})
	written := make(chan error, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(seed, 1))
		key := func() string { return fmt.Sprintf("order-%d", rng.IntN(keys)) }
		// group returns the rows of an atomic group over nkeys distinct
		// keys (some of its rows without a key), one of them of
		// events.Restricted if restrict.
		group := func(name string, size, nkeys int, restrict bool) []testenv.Event {
			var gkeys []string
			for _, k := range rng.Perm(keys)[:nkeys] {
				gkeys = append(gkeys, fmt.Sprintf("order-%d", k))
			}
			evs := make([]testenv.Event, size)
			for i := range evs {
				evs[i] = testenv.NewEvent("Thing", []byte(fmt.Sprintf("%s-%d", name, i)))
				evs[i].AtomicGroup = name
				if nkeys > 0 && rng.IntN(4) > 0 {
					evs[i].OrderingKey = gkeys[rng.IntN(nkeys)]
				}
			}
			if pos := rng.IntN(size); restrict {
				evs[pos].EventType = "Restricted"
			}
			return evs
		}
		firstRestricted := true
		after := -1 // transactions left once finish is closed
		for tx := 0; after != 0; tx++ {
			select {
			case <-ctx.Done():
				written <- ctx.Err()
				return
			case <-finish:
				if after < 0 {
					after = 5
				}
			default:
			}
			if after > 0 {
				after--
			}
			restrictedOn := restricted.Load()
			var units [][]testenv.Event
			name := func(i int) string { return fmt.Sprintf("tx%d-g%d", tx, i) }
			switch {
			case tx == 0:
				// One of each: over two keys (and rows without), without
				// keys, over the limit (with keys), of one row.
				units = append(units, group(name(0), 8, 2, false), group(name(1), 5, 0, false), group(name(2), limit+5, 3, false), group(name(3), 1, 1, false))
			case restrictedOn && firstRestricted:
				firstRestricted = false
				units = append(units, group(name(0), 6, 3, true), group(name(1), 4, 0, true))
			}
			for range rng.IntN(3) {
				var size int
				switch r := rng.IntN(100); {
				case r < 8:
					size = limit + 1 + rng.IntN(10)
				case r < 40:
					size = 1 + rng.IntN(3)
				default:
					size = 1 + rng.IntN(limit)
				}
				nkeys := 0
				if rng.IntN(4) > 0 {
					nkeys = 1 + rng.IntN(3)
				}
				restrict := rng.IntN(100) < 15
				units = append(units, group(name(len(units)), size, nkeys, restrict && restrictedOn))
			}
			for range rng.IntN(12) {
				ev := testenv.NewEvent("Thing", []byte("plain"))
				if rng.IntN(10) < 7 {
					ev.OrderingKey = key()
				}
				if rng.IntN(100) < 3 && restrictedOn {
					ev.EventType = "Restricted"
				}
				units = append(units, []testenv.Event{ev})
			}
			if err := testenv.Insert(app, appTx(rng, units)...); err != nil {
				written <- err
				return
			}
			if tx < 120 {
				time.Sleep(100 * time.Millisecond)
			} else {
				time.Sleep(400 * time.Millisecond)
			}
		}
		written <- nil
	}()

	// The reader: the whole stream, again and again, each time checked
	// against the groups in the table (read after the stream, so that it
	// holds every group of which the stream holds a row).
	var samples atomic.Int64
	var broken atomic.Bool // the reader failed the test
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			readCtx, stop := context.WithTimeout(ctx, 20*time.Second)
			msgs, err := testenv.ReadStream(readCtx, js, "EVENTS")
			stop()
			if err != nil {
				time.Sleep(100 * time.Millisecond) // the outage, say
				continue
			}
			rows, err := tableRows(app)
			if err != nil {
				t.Errorf("sample %d: read the table: %v", samples.Load()+1, err)
				broken.Store(true)
				return
			}
			if part := partialGroup(msgs, groupsOf(rows)); part != "" {
				t.Errorf("sample %d of the stream, %d messages: %s", samples.Load()+1, len(msgs), part)
				broken.Store(true)
				return
			}
			samples.Add(1)
			time.Sleep(200 * time.Millisecond)
		}
	}()
	// sampled waits for n more samples of the stream.
	sampled := func(n int64) {
		t.Helper()
		want := samples.Load() + n
		testenv.Eventually(t, 60*time.Second, fmt.Sprintf("%d samples of the stream", want), func() bool { return broken.Load() || samples.Load() >= want })
		if broken.Load() {
			t.FailNow()
		}
	}
	count := func(q string) (n int) {
		t.Helper()
		if err := app.QueryRow(q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// phase records when each step began, for the log.
	start := time.Now()
	phase := func(what string) {
		phases = append(phases, fmt.Sprintf("%s %.1fs", what, time.Since(start).Seconds()))
	}
	first := relay()
	relays = append(relays, first)
	first.waitFor("leading: this relay claims and publishes the rows")
	phase("first relay leads")
	testenv.Eventually(t, 30*time.Second, "a group of keys stored whole", func() bool {
		return count(`SELECT count(*) FROM (SELECT atomic_group FROM event_queue WHERE atomic_group IS NOT NULL GROUP BY atomic_group
			HAVING count(*) > 1 AND count(ordering_key) > 0 AND sum(status = 'done') = count(*))`) > 0
	})
	sampled(2)
	phase("a group stored")
	// A standby takes over from the leader killed under it.
	second := relay()
	relays = append(relays, second)
	second.waitFor("standing by: another relay of this outbox table leads")
	first.Kill()
	second.waitFor("leading: this relay claims and publishes the rows")
	phase("standby took over")
	restricted.Store(true)
	// A group refused for its row of events.Restricted: its other rows
	// spent an attempt too.
	testenv.Eventually(t, 30*time.Second, "a group refused", func() bool {
		return count(`SELECT count(*) FROM event_queue WHERE event_type <> 'Restricted' AND attempts > 0 AND status = 'pending'
			AND atomic_group IN (SELECT atomic_group FROM event_queue WHERE event_type = 'Restricted')`) > 0
	})
	sampled(1)
	phase("a group refused")
	// An outage of 2 s.
	n.Stop()
	second.waitFor("broker unavailable; pausing without spending attempts")
	time.Sleep(2 * time.Second)
	n.Restart()
	second.waitFor("broker recovered; resuming")
	sampled(1)
	phase("outage over")
	second.Kill()
	// The relay may publish the restricted rows from now on.
	n.Reload(relayUser())
	third := relay()
	relays = append(relays, third)
	third.waitFor("leading: this relay claims and publishes the rows")
	phase("granted, third relay leads")
	close(finish)
	if err := <-written; err != nil {
		t.Fatal(err)
	}
	sampled(1)
	phase("written")
	total := count(`SELECT count(*) FROM event_queue`)
	testenv.Eventually(t, 90*time.Second, "every row done or dead-lettered", func() bool {
		c := testenv.Counts(t, app)
		return c["done"]+c["dead_lettered"] == total
	})
	phase("settled")
	third.stop()
	cancel()
	wg.Wait()
	if t.Failed() {
		return // the reader found a group in part
	}
	if s := samples.Load(); s < 5 {
		t.Fatalf("%d samples of the stream, want 5 at least", s)
	}

	rows := readTable(t, app)
	oversized := 0
	for _, ids := range groupsOf(rows) {
		if len(ids) > limit {
			oversized += len(ids)
		}
	}
	perKey := checkKeyOrder(t, js, total-oversized)
	msgs := byRowID(t, testenv.StreamMessages(t, js, "EVENTS"))
	sizes := checkGroupsWhole(t, rows, msgs, limit)
	checkStreamSeqs(t, rows, msgs)
	for _, r := range rows {
		if r.group == "" && r.status != "done" {
			t.Errorf("row %d (no group, key %q) %s: %s", r.id, r.key, r.status, r.lastError)
		}
	}

	// What the run went through.
	var groups, large, keyed, refused, batched int
	for s, k := range sizes {
		groups += k
		if s > limit {
			large += k
		}
	}
	keyed = count(`SELECT count(*) FROM (SELECT 1 FROM event_queue WHERE atomic_group IS NOT NULL GROUP BY atomic_group
		HAVING count(DISTINCT ordering_key) > 1 AND count(*) <= ` + strconv.Itoa(limit) + `)`)
	refused = count(`SELECT count(DISTINCT atomic_group) FROM event_queue WHERE status = 'done' AND attempts > 0 AND atomic_group IS NOT NULL`)
	for _, m := range msgs {
		if m.Header.Get(jetstreamext.BatchIDHeader) != "" {
			batched++
		}
	}
	if large == 0 || keyed == 0 || refused == 0 {
		t.Fatalf("%d groups over the limit, %d stored over several keys, %d stored after a refusal: the run tested too little", large, keyed, refused)
	}
	t.Logf("%d rows, %d groups (%d over the limit, %d over several keys, %d refused before stored), %d keys, %d messages in atomic batches, %d samples of the stream; steps: %s",
		total, groups, large, keyed, refused, len(perKey), batched, samples.Load(), strings.Join(phases, ", "))
}

// dumpUnsettled logs, for a failed test, the rows that are neither done
// nor dead-lettered and the last log lines of each relay.
func dumpUnsettled(t *testing.T, app *sql.DB, relays []*process) {
	rows, err := tableRows(app)
	if err != nil {
		t.Logf("read the table: %v", err)
		return
	}
	shown := 0
	for _, r := range rows {
		if r.status != "done" && r.status != "dead_lettered" && shown < 40 {
			shown++
			t.Logf("row %d: %s, group %q, key %q, type %s, %d attempts, available at %s: %s", r.id, r.status, r.group, r.key, r.eventType,
				r.attempts, time.UnixMilli(r.available).UTC().Format("15:04:05.000"), r.lastError)
		}
	}
	for i, p := range relays {
		// The last lines but those of each row dead-lettered.
		var lines []string
		for _, l := range p.Lines() {
			if l.Msg != "dead-lettered invalid row" {
				lines = append(lines, l.Text)
			}
		}
		t.Logf("relay %d, its last log lines:", i+1)
		for _, l := range lines[max(0, len(lines)-30):] {
			t.Log(l)
		}
	}
}

// TestGroupStoredBeforeACrash: the stream already holds the events of
// atomic groups (and of the rows before them), stored by a relay that
// died between the PubAck and its settle: two groups as the relay stores
// them, in one atomic batch each, and a group of one row. The relay finds
// them in the stream before it publishes (its reconciliation) and sends
// none of them again: each of those rows ends done with the sequence its
// event was stored at, nothing is stored twice, and the groups the stream
// did not hold follow whole.
func TestGroupStoredBeforeACrash(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	testenv.EventsStream(t, js, 0)
	testenv.EditStream(t, js, "EVENTS", func(c *jetstream.StreamConfig) { c.AllowAtomicPublish = true })
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	// tx writes one transaction of rows {key, group} and returns its events
	// and their row ids.
	tx := func(rows ...[2]string) ([]testenv.Event, []int64) {
		evs := make([]testenv.Event, len(rows))
		for i, r := range rows {
			evs[i] = testenv.NewEvent("Thing", []byte(fmt.Sprint("row ", i)))
			evs[i].OrderingKey, evs[i].AtomicGroup = r[0], r[1]
		}
		return evs, testenv.InsertIDs(t, app, evs...)
	}
	before, beforeIDs := tx([2]string{"a", ""}, [2]string{"", ""}, [2]string{"b", ""}, [2]string{"a", ""})
	g1, g1IDs := tx([2]string{"a", "g1"}, [2]string{"b", "g1"}, [2]string{"", "g1"}, [2]string{"a", "g1"}, [2]string{"c", "g1"})
	g2, g2IDs := tx([2]string{"", "g2"}, [2]string{"", "g2"}, [2]string{"", "g2"})
	tx([2]string{"b", "g3"}, [2]string{"", "g3"}, [2]string{"c", "g3"})
	g4, g4IDs := tx([2]string{"a", "g4"})
	tx([2]string{"a", ""}, [2]string{"b", "g5"}, [2]string{"b", "g5"})
	tx([2]string{"a", ""}, [2]string{"b", ""}, [2]string{"c", ""}, [2]string{"", ""})

	ctx := context.Background()
	seqs := map[int64]uint64{}
	batches := map[string]string{} // group -> its batch id
	for i, id := range beforeIDs {
		ack, err := js.PublishMsg(ctx, relayMsg(before[i], id))
		if err != nil {
			t.Fatal(err)
		}
		seqs[id] = ack.Sequence
	}
	for _, g := range []struct {
		name string
		evs  []testenv.Event
		ids  []int64
	}{{"g1", g1, g1IDs}, {"g2", g2, g2IDs}} {
		msgs := make([]*nats.Msg, len(g.evs))
		for i, ev := range g.evs {
			msgs[i] = relayMsg(ev, g.ids[i])
		}
		ack, err := jetstreamext.PublishMsgBatch(ctx, js, msgs)
		if err != nil {
			t.Fatal(err)
		}
		for i, id := range g.ids {
			seqs[id] = ack.Sequence - uint64(len(g.ids)-1-i)
		}
		batches[g.name] = ack.BatchID
	}
	ack, err := js.PublishMsg(ctx, relayMsg(g4[0], g4IDs[0]))
	if err != nil {
		t.Fatal(err)
	}
	seqs[g4IDs[0]] = ack.Sequence

	d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN=127.0.0.1:0", "OUTBOX_RELAY_RELAY_POLL_INTERVAL=200ms"}, "run", "--database-path", path)
	addr := d.waitFor("serving metrics")["listen"].(string)
	total := len(testenv.Strings(t, app, `SELECT id FROM event_queue`))
	testenv.Eventually(t, 30*time.Second, "every row done", func() bool { return testenv.Counts(t, app)["done"] == total })
	page := httpGet(t, "http://"+addr+"/metrics")
	reconciled, _ := metricIn(page, `outbox_relay_reconciled_rows_total`)
	fallbacks, ok := metricIn(page, `outbox_relay_atomic_batch_fallbacks_total{reason="duplicate"}`)
	d.stop()
	if int(reconciled) != len(seqs) || !ok || fallbacks != 0 {
		t.Errorf("%v rows reconciled, %v atomic batches (found: %v) sent again; want the %d rows stored before reconciled, none sent again",
			reconciled, fallbacks, ok, len(seqs))
	}
	checkKeyOrder(t, js, total)
	rows := readTable(t, app)
	msgs := byRowID(t, testenv.StreamMessages(t, js, "EVENTS"))
	checkGroupsWhole(t, rows, msgs, publish.MaxBatch)
	checkStreamSeqs(t, rows, msgs)
	for _, r := range rows {
		if want, stored := seqs[r.id]; stored && r.streamSeq != want {
			t.Errorf("row %d done at stream sequence %d, its event was stored at %d", r.id, r.streamSeq, want)
		}
		if want, stored := batches[r.group]; stored && msgs[r.id].Header.Get(jetstreamext.BatchIDHeader) != want {
			t.Errorf("row %d of group %s in atomic batch %q, stored before in %q", r.id, r.group, msgs[r.id].Header.Get(jetstreamext.BatchIDHeader), want)
		}
	}
}

// metricIn returns the value of the sample named metric (with its labels,
// as /metrics writes them) in body, a /metrics page.
func metricIn(body, metric string) (float64, bool) {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(metric) + ` (\S+)$`).FindStringSubmatch(body)
	if m == nil {
		return 0, false
	}
	v, err := strconv.ParseFloat(m[1], 64)
	return v, err == nil
}

// heldLine is what the relay logs, once, when it holds atomic groups.
const heldLine = "rows with an atomic_group are held, not published in parts: no atomic batches (core NATS, or a stream without allow_atomic, nats-server 2.12 or later); they stay pending, no attempt spent"

// TestGroupsHeldWithoutAtomicBatches: with stream.allow_atomic false,
// atomic groups of two rows or more are held (pending, no attempt spent,
// looked at again 30 s later), none of their rows in the stream, and so
// are the rows of their keys behind them; rows without a group and groups
// of one row are published. The relay says it once, status says it, and
// the held rows count in the deferred metric. Restarted with atomic
// batches on, the relay publishes the held groups whole once they are
// due, nothing lost.
func TestGroupsHeldWithoutAtomicBatches(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	testenv.EventsStream(t, js, 0)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	// Rows {key, group, payload}, a transaction each: the payload says
	// whether the row is published while batches are off or waits, in a
	// group held or behind one in its key.
	for _, tx := range [][][3]string{
		{{"a", "", "flows"}, {"", "", "flows"}},
		{{"a", "held-1", "waits"}, {"", "held-1", "waits"}, {"b", "held-1", "waits"}},
		{{"a", "", "waits"}},
		{{"", "held-2", "waits"}, {"", "held-2", "waits"}},
		{{"c", "one", "flows"}},
		{{"c", "", "flows"}, {"", "", "flows"}, {"d", "", "flows"}},
		{{"d", "held-3", "waits"}, {"d", "held-3", "waits"}, {"", "held-3", "waits"}, {"e", "held-3", "waits"}},
		{{"e", "", "waits"}, {"f", "", "flows"}},
	} {
		evs := make([]testenv.Event, len(tx))
		for i, r := range tx {
			evs[i] = testenv.NewEvent("Thing", []byte(r[2]))
			evs[i].OrderingKey, evs[i].AtomicGroup = r[0], r[1]
		}
		testenv.InsertIDs(t, app, evs...)
	}
	held := testenv.Strings(t, app, `SELECT id FROM event_queue WHERE CAST(payload AS TEXT) = 'waits'`)
	grouped := len(testenv.Strings(t, app, `SELECT id FROM event_queue WHERE atomic_group LIKE 'held-%'`))
	total := len(testenv.Strings(t, app, `SELECT id FROM event_queue`))
	flowing := total - len(held)
	if len(held) != grouped+2 {
		t.Fatalf("%d rows wait, %d of them in groups: the rows are not as the test means", len(held), grouped)
	}

	env := []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_METRICS_LISTEN=127.0.0.1:0", "OUTBOX_RELAY_RELAY_POLL_INTERVAL=200ms"}
	d := startDaemon(t, append(env, "OUTBOX_RELAY_STREAM_ALLOW_ATOMIC=false"), "run", "--database-path", path)
	relays := []*process{d}
	defer func() {
		if t.Failed() {
			dumpUnsettled(t, app, relays)
		}
	}()
	addr := d.waitFor("serving metrics")["listen"].(string)
	d.waitFor("atomic batches off (stream.allow_atomic is false): an ordering key's rows go one at a time, and rows of atomic groups are held, pending")
	d.waitFor(heldLine)
	// Every held group is looked at, and released for 30 s.
	heldUntil := time.Now().Add(20 * time.Second).UnixMilli()
	testenv.Eventually(t, 30*time.Second, "the rows flowing done, the groups held", func() bool {
		return testenv.Counts(t, app)["done"] == flowing &&
			len(testenv.Strings(t, app, `SELECT id FROM event_queue WHERE atomic_group LIKE 'held-%' AND status = 'pending' AND available_at > ?`, heldUntil)) == grouped
	})
	statusSays(t, path, "rows of atomic groups held")
	if v, ok := metricIn(httpGet(t, "http://"+addr+"/metrics"), `outbox_relay_deferred_total{reason="atomic_groups_held"}`); !ok || v < float64(grouped) {
		t.Errorf("deferred_total{reason=\"atomic_groups_held\"} %v (found: %v), want the %d rows of the groups held at least", v, ok, grouped)
	}
	d.stop()
	if got := len(d.Find(heldLine)); got != 1 {
		t.Errorf("the relay said %d times that it holds groups, want once", got)
	}
	for _, r := range readTable(t, app) {
		if slices.Contains(held, strconv.FormatInt(r.id, 10)) && (r.status != "pending" || r.attempts != 0) {
			t.Errorf("held row %d (group %q, key %q): %s after %d attempts, want pending without one", r.id, r.group, r.key, r.status, r.attempts)
		}
	}
	checkKeyOrder(t, js, flowing)
	for _, m := range testenv.StreamMessages(t, js, "EVENTS") {
		if b := m.Header.Get(jetstreamext.BatchIDHeader); b != "" {
			t.Fatalf("message %d stored in atomic batch %s while batches are off", m.Sequence, b)
		}
	}

	// Atomic batches on: the held groups go whole once they are due.
	d = startDaemon(t, env, "run", "--database-path", path)
	relays = append(relays, d)
	d.waitFor("atomic batches on: an ordering key's due rows go as one batch, all or none")
	testenv.Eventually(t, 45*time.Second, "every row done", func() bool { return testenv.Counts(t, app)["done"] == total })
	d.stop()
	checkKeyOrder(t, js, total)
	rows := readTable(t, app)
	msgs := byRowID(t, testenv.StreamMessages(t, js, "EVENTS"))
	if sizes := checkGroupsWhole(t, rows, msgs, publish.MaxBatch); sizes[1] != 1 || sizes[2]+sizes[3]+sizes[4] != 3 {
		t.Errorf("groups of each size %v, want 1 of one row and 3 of two to four", sizes)
	}
	checkStreamSeqs(t, rows, msgs)
	for _, r := range rows {
		if r.attempts != 0 {
			t.Errorf("row %d spent %d attempts", r.id, r.attempts)
		}
	}
}
