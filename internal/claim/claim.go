// Package claim owns the relay's rows in flight: taking due rows (read,
// held in memory, not written) in the order their ordering keys allow, and
// settling each once when its outcome is known, fenced by the lead (see
// package lead) in the same transaction.
package claim

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Options tune a Store.
type Options struct {
	// Rescan is how often, at least, a claim reads the whole pending index
	// while rows are in flight (see Store.Claim); DefaultRescan when 0.
	Rescan time.Duration
	// SkipDeadLetters lets the rows of an ordering key go on past a
	// dead-lettered row of the key (ordering.on_dead_letter: skip); by
	// default a dead letter holds its key's later rows until it is retried
	// or deleted.
	SkipDeadLetters bool
	// KeyDepth is how many rows of one ordering key are held in flight at
	// most (0: no limit), so that a busy key cannot fill the pipeline that
	// the other keys share.
	KeyDepth int
	// DeleteDone deletes a row settled as done from the outbox table and
	// records it in the table's records table (schema.DoneTable), in the
	// same transaction (retention.done_rows: delete): a row of any size
	// then costs the settle a few hundred bytes of writes, where marking
	// it done rewrites its whole record. The table's ids must never be
	// reused (schema.IDsNeverReused): a claim reads past the highest row
	// in flight.
	DeleteDone bool
	// Fence, when set, is asked inside every settle transaction whether
	// this relay may write (*lead.Lease): one that lost the lead writes
	// nothing. Without it the store writes whenever asked.
	Fence Fence
	// Stream is the stream whose scan_from (schema.PublishedTable) a
	// settle with a scanFrom writes.
	Stream string
}

// Fence says whether a settle may write, inside its transaction, and
// which heartbeat row a claim must find to read rows (*lead.Lease).
type Fence interface {
	LeadsIn(ctx context.Context, tx *sql.Tx) (bool, error)
	// ClaimFence returns the relay's instance id, the started_at and the
	// least heartbeat_at its heartbeat row must hold for a claim to read
	// rows; "" when claims are not fenced.
	ClaimFence() (instance string, started, beat int64)
}

// maxReads bounds the reads of one claim that find only rows of keys
// that wait, and maxReadRows the rows each reads (see Claim): each read
// reads twice the rows of the one before, so a claim of one row finds a
// due row behind tens of thousands of waiting keys' rows.
const (
	maxReads    = 32
	maxReadRows = 4096
)

// DefaultRescan is Options.Rescan's default.
const DefaultRescan = time.Second

// Store takes and settles the outbox table's rows on db. Its rows in
// flight are its own: one Store per relay.
type Store struct {
	db       *sqlitedb.DB
	q        queries
	fence    Fence
	rescan   time.Duration // a claim reads the whole pending index at least this often
	keyDepth int           // rows of one ordering key held at most; 0: no limit
	// skipDeadLetters: a dead letter does not keep its key's later rows.
	skipDeadLetters bool
	stream          string // Options.Stream

	mu   sync.Mutex
	held held // the rows in flight (see Claim)
	// rowsRead counts the rows claims read, for tests of what a claim
	// reads again.
	rowsRead atomic.Int64
	// lastRead is how many rows the latest read of a claim found: the
	// room the next one's result is given at first (see readRows).
	lastRead atomic.Int64
	// claimedWith is the started_at of the heartbeat row the latest claim
	// that took rows was fenced by (Fence.ClaimFence; 0: none, or nothing
	// in flight): settles write only while the row is still that one (see
	// leadsIn). Written under mu.
	claimedWith atomic.Int64
}

// New returns a Store on db. It does not touch the schema; closing db is
// the caller's.
func New(db *sqlitedb.DB, opts Options) *Store {
	s := &Store{db: db, q: newQueries(db.Table(), opts.DeleteDone), fence: opts.Fence, rescan: opts.Rescan, keyDepth: opts.KeyDepth, skipDeadLetters: opts.SkipDeadLetters, stream: opts.Stream}
	s.held = newHeld()
	if s.rescan <= 0 {
		s.rescan = DefaultRescan
	}
	return s
}

// queries are the statements on the outbox table, built once for its name.
type queries struct {
	due, takeAfter, takeRescan, groupRest, groupHeld, assignID, settledAt, retry, deadLetter, release, deadLetters, nextDue string
	// done are the statements that settle rows as done, in order: the
	// rows they change, added up, are the rows settled.
	done []string
	// doneRecord, when set, writes the records of the rows about to be
	// deleted as done, before done runs (Options.DeleteDone).
	doneRecord string
}

// pendingRow is the condition of every settle write: the row is still
// pending. A row someone else settled, took (a claimer that marks rows
// processing) or deleted meanwhile is left alone.
const pendingRow = `id = ? AND status = 'pending'`

// takeSQL reads due pending rows in id order that pass cond (?1): up to
// ?3 rows and, past the first, those that begin within ?4 bytes of
// payload. The innermost subquery walks the pending index in id order and
// stops at the limit, so payloads past the budget are never read. Rows of
// the ordering keys in ?5 (a JSON array) are left alone. Unless ?6 is
// empty, it reads nothing unless the heartbeat row of instance ?6 holds
// started_at ?8 and a heartbeat_at of ?7 or more (see Fence).
//
// The limit is +?3, not ?3: SQLite (3.54) reads a bare parameter in LIMIT
// as a hint to the planner and then compiles the statement again every
// time a value is bound to it, which made every claim parse and plan this
// query anew; the unary plus hides the value from the planner.
//
// With each row that has an ordering key comes the row before it of the
// same key (prev: its id and status), found by one seek of the ordering
// index. Store.order decides from it.
func takeSQL(t, cond string) string {
	return rowsSQL(t, fmt.Sprintf(`r.id IN (SELECT id FROM (
	SELECT id, sum(len) OVER (ORDER BY id) - len AS before FROM (
		SELECT id, coalesce(octet_length(payload), 0) AS len FROM %[1]s
		WHERE status = 'pending' AND %[3]s AND %[2]s AND (coalesce(ordering_key, '') = '' OR ordering_key NOT IN (SELECT value FROM json_each(?5)))
			AND (?6 = '' OR EXISTS (SELECT 1 FROM %[4]s WHERE instance_id = ?6 AND started_at = ?8 AND heartbeat_at >= ?7))
		ORDER BY id LIMIT +?3))
	WHERE before < ?4)`, t, schema.DueSQL("?2"), cond, schema.InstancesTable))
}

// rowsSQL reads the rows of t that pass where, in id order, as readRows
// reads them: each with the row before it of its ordering key.
func rowsSQL(t, where string) string {
	return fmt.Sprintf(`SELECT r.id, r.event_id, r.event_type, r.payload, CAST(r.attempts AS INTEGER),
	%[2]s, r.created_at IS NOT NULL, %[3]s, r.available_at IS NOT NULL, r.ordering_key, r.headers, r.atomic_group, p.id, p.status
FROM %[1]s AS r LEFT JOIN %[1]s AS p ON coalesce(r.ordering_key, '') <> '' AND p.id =
	(SELECT max(e.id) FROM %[1]s AS e WHERE e.ordering_key = r.ordering_key AND e.id < r.id)
WHERE %[4]s
ORDER BY r.id`, t, schema.MsSQL("r.created_at"), schema.MsSQL("r.available_at"), where)
}

func newQueries(t string, deleteDone bool) queries {
	q := queries{
		due: fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE status = 'pending' AND %s)`, t, schema.DueSQL("?1")),
		// Past the highest row in flight (the pending index's range).
		takeAfter: takeSQL(t, `id > ?1`),
		// Anywhere, except the rows in flight (a JSON array of ids).
		takeRescan: takeSQL(t, `id NOT IN (SELECT value FROM json_each(?1))`),
		// The pending rows of the atomic groups ?1 (a JSON array) that are
		// not among the ids ?2, due or not (see takeGroups).
		groupRest: rowsSQL(t, `r.atomic_group IN (SELECT value FROM json_each(?1)) AND r.status = 'pending' AND r.id NOT IN (SELECT value FROM json_each(?2))`),
		// Of the atomic groups ?1, the first row that holds its group
		// back (see takeGroup): neither done nor pending, or pending and
		// not due at ?2.
		groupHeld: fmt.Sprintf(`SELECT atomic_group, min(id), coalesce(CAST(status AS TEXT), '') FROM %s
WHERE atomic_group IN (SELECT value FROM json_each(?1)) AND status IS NOT 'done' AND (status IS NOT 'pending' OR NOT %s)
GROUP BY atomic_group`, t, schema.DueSQL("?2")),
		assignID:  fmt.Sprintf(`UPDATE %s SET event_id = coalesce(event_id, ?) WHERE id = ? RETURNING event_id`, t),
		settledAt: fmt.Sprintf(`SELECT id FROM %s WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'done' AND processed_at = ?2`, t),
		// ?1: [[id, stream_seq], ...]; a stream_seq of 0 is none.
		done: []string{fmt.Sprintf(`UPDATE %[1]s SET status = 'done', processed_at = ?2, stream_seq = nullif(j.seq, 0)
FROM (SELECT value ->> 0 AS id, value ->> 1 AS seq FROM json_each(?1)) AS j WHERE %[1]s.id = j.id AND status = 'pending'`, t)},
		retry:      fmt.Sprintf(`UPDATE %s SET attempts = ?, available_at = ?, last_error = ? WHERE `+pendingRow, t),
		deadLetter: fmt.Sprintf(`UPDATE %s SET status = 'dead_lettered', attempts = ?, last_error = ?, processed_at = ? WHERE `+pendingRow, t),
		release:    fmt.Sprintf(`UPDATE %s SET available_at = ? WHERE `+pendingRow, t),
		// The earliest pending row not due at ?1: the pending index
		// covers available_at.
		nextDue: fmt.Sprintf(`SELECT min(%s) FROM %s WHERE status = 'pending' AND NOT %s`, schema.MsSQL("available_at"), t, schema.DueSQL("?1")),
		// The dead letters' index (schema's _dead_lettered) covers id.
		deadLetters: fmt.Sprintf(`SELECT count(*), coalesce(max(id), 0), coalesce(sum((id %% 2147483647) * 48271 %% 2147483647), 0) FROM %s WHERE status = 'dead_lettered'`, t),
	}
	if deleteDone {
		d := schema.DoneTable(t)
		q.settledAt = fmt.Sprintf(`SELECT id FROM %[2]s WHERE id IN (SELECT value FROM json_each(?1)) AND processed_at = ?2
UNION SELECT id FROM %[1]s WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'done' AND processed_at = ?2`, t, d)
		// The record first, read from the row it replaces. An id that
		// has a record already (one the application gave again) keeps
		// it: that row is marked done in place instead, by the UPDATE.
		q.doneRecord = fmt.Sprintf(`INSERT INTO %[2]s (id, event_id, event_type, ordering_key, created_at, processed_at, stream_seq)
SELECT %[1]s.id, event_id, event_type, ordering_key, created_at, ?2, nullif(j.seq, 0)
FROM (SELECT value ->> 0 AS id, value ->> 1 AS seq FROM json_each(?1)) AS j JOIN %[1]s ON %[1]s.id = j.id WHERE status = 'pending'
ON CONFLICT (id) DO NOTHING`, t, d)
		q.done = append([]string{fmt.Sprintf(`DELETE FROM %[1]s WHERE id IN (SELECT value ->> 0 FROM json_each(?1)) AND status = 'pending'
AND EXISTS (SELECT 1 FROM %[2]s AS d WHERE d.id = %[1]s.id AND d.processed_at = ?2 AND d.event_id IS %[1]s.event_id)`, t, d)}, q.done...)
	}
	return q
}

// held is what the store has taken and not yet settled: the rows in flight,
// which stay pending in the table until their outcome is written, and the
// times the rows it deferred become due again.
type held struct {
	ids      map[int64]struct{}
	max      int64           // the highest id in ids
	keys     map[string]int  // rows in ids per ordering key
	groups   map[string]int  // rows in ids per atomic group (see withGroups)
	overflow map[string]bool // keys whose due rows were left for lack of room
	// waiting are keys found waiting behind a row (see order), left alone
	// by claims until nextLook; parked are those waiting behind a dead
	// letter, left alone until the dead letters change (deadLetters): a
	// table with thousands of parked keys is not read again every look.
	waiting, parked map[string]bool
	nextLook        time.Time
	deadLetters     string    // the dead letters' fingerprint when parked was filled
	parkedSince     time.Time // when parked began to fill
	// quiet is until when a claim finds nothing unless the table changes
	// (see Quiet); zero: unknown.
	quiet     time.Time
	parkedEnc string // parked as a JSON array ("": to encode again)
	// gone are the ids let go since the current claim began: they were in
	// flight when it read the table, which may show them still pending.
	gone map[int64]struct{}
	// goneGroups are the atomic groups of the rows in gone.
	goneGroups map[string]bool
	// freed says a key full at KeyDepth got room since the current claim
	// began: that claim may have left the key out.
	freed      bool
	deferred   []int64   // due times (Unix ms, Options.Clock) of rows this store deferred
	nextRescan time.Time // when a claim next reads the whole pending index
}

func newHeld() held {
	return held{ids: map[int64]struct{}{}, keys: map[string]int{}, groups: map[string]int{}, waiting: map[string]bool{}, parked: map[string]bool{},
		gone: map[int64]struct{}{}, goneGroups: map[string]bool{}, overflow: map[string]bool{}}
}

// Claim takes due pending rows in id order, up to limit rows and, past the
// first row, up to maxBytes of payload (0: no byte limit), and holds them
// in memory until Settle: it writes nothing, so the application's write
// lock is not taken to claim. Only one relay per file claims (the leader,
// see package lead); its Settle writes only while it leads (Options.Fence).
//
// While rows are in flight a claim reads only past the highest of them (a
// new row's id is above every row in the table, and the held rows are in
// the table). It reads the whole pending index, skipping the rows in
// flight, when none are, when a row this store deferred has become due,
// and at least every Options.Rescan: that finds rows scheduled by the
// application or by a previous leader, and rows that went back to pending
// under this relay's feet (an operator's retry, say).
//
// A row with an ordering key comes only when every row of its key before
// it is done or in flight (or comes first in the same claim); see
// order. A key holds at most Options.KeyDepth rows in flight; Waiting
// reports rows left behind for lack of room.
//
// A row with a NULL event_id gets a fresh UUID before it is returned, in
// one short write transaction for all of them. The rows are read as
// whatever SQLite holds; a row whose columns cannot be read as the relay
// needs them comes back with Problem set, to be dead-lettered alone.
func (s *Store) Claim(ctx context.Context, limit int, maxBytes int64) (_ []event.Row, err error) {
	defer func() { err = sqlitedb.Explain(s.db.Path(), err) }()
	if maxBytes <= 0 {
		maxBytes = math.MaxInt64
	}
	// Publish nothing from a file the application no longer writes.
	if err := s.db.SameFile(); err != nil {
		return nil, err
	}
	now := s.db.DueMs()
	query, after := s.q.takeAfter, any(nil)
	s.mu.Lock()
	clear(s.held.gone)
	clear(s.held.goneGroups)
	s.held.freed = false
	look := !time.Now().Before(s.held.nextLook)
	parked := len(s.held.parked) > 0
	s.mu.Unlock()
	// Parked keys are compared with the dead letters at every claim (one
	// read of their index): a retry or a discard must free its key at the
	// next claim, not at the next look, since an idle relay claims only
	// on commits.
	var deadLetters string
	if parked {
		var err error
		if deadLetters, err = s.deadLetterPrint(ctx); err != nil {
			return nil, fmt.Errorf("claim rows: %w", err)
		}
	}
	s.mu.Lock()
	if parked && (deadLetters != s.held.deadLetters || time.Since(s.held.parkedSince) > maxParkedFor) {
		// Read the parked keys again (and, now and then, in case the
		// fingerprint missed a change).
		clear(s.held.parked)
		s.held.parkedEnc = ""
	}
	if !parked || len(s.held.parked) == 0 {
		// The keys parked from now on are compared with this.
		s.held.deadLetters, s.held.parkedSince = deadLetters, time.Now()
	}
	if look {
		// Look at the waiting keys again: what they wait for may have
		// been settled, become due, or been retried by an operator.
		clear(s.held.waiting)
		s.held.nextLook = time.Now().Add(s.rescan)
		s.held.nextRescan = time.Time{}
	}
	if rescan := s.rescanDue(now); rescan {
		query, after = s.q.takeRescan, jsonIDs(maps.Keys(s.held.ids))
		s.held.nextRescan = time.Now().Add(s.rescan)
	} else {
		after = s.held.max
	}
	s.mu.Unlock()
	instance, started, beat := "", int64(0), int64(0)
	if s.fence != nil {
		instance, started, beat = s.fence.ClaimFence()
	}
	var out []event.Row
	var noID []int
	readLimit := limit
	for reads := 1; ; reads++ {
		s.mu.Lock()
		skip := s.skipKeys()
		s.mu.Unlock()
		// A context that cannot be cancelled lets go-sqlite3 read each row
		// in one cgo call; the read is short and holds no lock.
		rows, err := s.db.Reader().QueryContext(context.WithoutCancel(ctx), query, after, now, readLimit, maxBytes, skip, instance, beat, started)
		if err != nil {
			return nil, fmt.Errorf("claim rows: %w", err)
		}
		read, prev, readNoID, err := readRows(rows, sqlitedb.NowMs(), min(readLimit, max(1, int(s.lastRead.Load()))))
		if err != nil {
			return nil, fmt.Errorf("claim rows: %w", err)
		}
		s.rowsRead.Add(int64(len(read)))
		s.lastRead.Store(int64(len(read)))
		// More may be due when the read was cut by the row limit or by the
		// byte budget.
		full := len(read) == readLimit || event.PayloadBytes(read) >= maxBytes
		var held map[string]heldBy
		if read, prev, readNoID, held, err = s.withGroups(ctx, read, prev, readNoID, now); err != nil {
			return nil, fmt.Errorf("claim rows: %w", err)
		}
		out, noID = s.order(read, prev, readNoID, limit, held)
		// Every row read was of a key that waits, and more may be due:
		// read again past those keys (order set them aside), and further,
		// so that keys that wait cannot hide due rows from a small claim
		// (the single row of a broker's trial, say).
		if len(out) > 0 || !full || reads == maxReads {
			break
		}
		readLimit = max(readLimit, min(2*readLimit, maxReadRows))
	}
	if len(noID) > 0 {
		if err := s.assignIDs(ctx, out, noID); err != nil {
			return nil, err
		}
	}
	if err := s.noteQuiet(ctx, query == s.q.takeRescan && len(out) == 0, now); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if len(out) > 0 && instance != "" {
		s.claimedWith.Store(started)
	}
	for _, r := range out {
		s.held.ids[r.ID] = struct{}{}
		s.held.max = max(s.held.max, r.ID)
		if k := r.OrderingKey; k != "" {
			s.held.keys[k]++
		}
		if g := r.Group; g != "" {
			s.held.groups[g]++
		}
	}
	s.mu.Unlock()
	return out, nil
}

// skipKeys returns, as a JSON array, the ordering keys a claim leaves
// alone: those found waiting (see order), those that hold
// Options.KeyDepth rows in flight, and those that left rows behind and
// have not drained to half since (see letGo). s.mu is held.
func (s *Store) skipKeys() string {
	keys := []string{}
	for k := range s.held.waiting {
		keys = append(keys, k)
	}
	for k := range s.held.overflow {
		keys = append(keys, k)
	}
	if s.keyDepth > 0 {
		for k, n := range s.held.keys {
			if n >= s.keyDepth && !s.held.overflow[k] {
				keys = append(keys, k)
			}
		}
	}
	b, _ := json.Marshal(keys)
	return joinJSON(string(b), s.held.parkedJSON())
}

// parkedJSON returns the parked keys as a JSON array, encoded again only
// when they changed: they are most of the keys set aside where thousands
// are parked, and change only when dead letters do.
func (h *held) parkedJSON() string {
	if h.parkedEnc == "" {
		keys := append([]string{}, slices.Collect(maps.Keys(h.parked))...)
		b, _ := json.Marshal(keys)
		h.parkedEnc = string(b)
	}
	return h.parkedEnc
}

// joinJSON joins two JSON arrays into one.
func joinJSON(a, b string) string {
	switch {
	case b == "[]":
		return a
	case a == "[]":
		return b
	}
	return a[:len(a)-1] + "," + b[1:]
}

// order keeps, of the rows read (in id order), those without an ordering
// key, and those of a key whose row before it (prev, see takeSQL) is done,
// a dead letter that does not hold its key (Options.SkipDeadLetters), held
// in flight, or kept before it in the same read. Nothing of the key lies
// before such a row that could still go: a key's rows in flight are the
// first of its rows that are not done (a claim takes them in order, and a
// lane that fails one withholds the rest), and no row of a key is done
// while an earlier one waits. A row whose prev is anything else (a retried
// or scheduled row, a dead letter, a row left behind, a processing row, a
// row in a status the relay does not write) waits, and so does the rest of
// its key, which the claims leave alone for a while (waiting). Past Options.KeyDepth rows in flight a key's last
// rows are left too (its order is kept), and noted so that a claim reads
// them again once the key has room (see letGo). It keeps limit rows at
// most, and returns the rows kept, and the indexes among them of those
// without event_id.
func (s *Store) order(rows []event.Row, prev []prevRow, noID []int, limit int, held map[string]heldBy) ([]event.Row, []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	taken := map[string]int{}
	kept, keptNoID := rows[:0], noID[:0]
	keptIDs := map[int64]bool{}
	stopped := map[string]bool{}
	groups, took := members(rows), map[string]bool{}
	for i := range rows {
		for len(noID) > 0 && noID[0] < i {
			noID = noID[1:] // of a row left out
		}
		r := rows[i]
		if g := r.Group; g != "" {
			take, seen := took[g]
			if !seen {
				// A group is taken whole or not at all (see takeGroup);
				// it may take the claim past limit.
				if len(kept) < limit {
					take = s.takeGroup(rows, prev, groups[g], held[g], keptIDs, stopped)
				} else {
					stopKeys(rows, groups[g], stopped)
				}
				took[g] = take
				r = rows[i] // takeGroup may have made it a row of no group
			}
		}
		switch {
		case r.Group != "" && !took[r.Group]:
			continue
		case r.Group != "":
			if k := r.OrderingKey; k != "" {
				taken[k]++
				keptIDs[r.ID] = true
			}
		case len(kept) >= limit:
			continue // a read past waiting keys may read more than the claim takes
		case r.OrderingKey != "":
			k := r.OrderingKey
			switch {
			case stopped[k]:
				continue
			case !s.mayFollow(prev[i], keptIDs):
				stopped[k] = true
				s.held.wait(k, prev[i])
				continue
			case s.keyDepth > 0 && s.held.keys[k]+taken[k] >= s.keyDepth:
				stopped[k] = true
				s.held.overflow[k] = true
				continue
			}
			taken[k]++
			keptIDs[r.ID] = true
		}
		if len(noID) > 0 && noID[0] == i {
			noID = noID[1:]
			keptNoID = append(keptNoID, len(kept))
		}
		kept = append(kept, r)
	}
	return kept, keptNoID
}

// prevRow is the row before a row of the same ordering key (see takeSQL).
type prevRow struct {
	ID     sql.NullInt64
	Status sql.NullString
}

// mayFollow reports whether a row may be published after p, the row
// before it of its key (see order); s.mu is held.
func (s *Store) mayFollow(p prevRow, kept map[int64]bool) bool {
	if !p.ID.Valid {
		return true
	}
	switch event.Status(p.Status.String) {
	case event.StatusDone:
		return true
	case event.StatusDeadLettered:
		return s.skipDeadLetters
	case event.StatusPending:
		// Held, or settled since the read began (the read may show the
		// row pending although it was done by the time it was read): in
		// flight as far as the read knows. A row before it that was then
		// refused keeps it back in the lanes, which withhold the rows of
		// claims that began before a key's failure was settled.
		_, held := s.held.ids[p.ID.Int64]
		_, gone := s.held.gone[p.ID.Int64]
		return held || gone || kept[p.ID.Int64]
	}
	// Processing, or a status the relay leaves alone (queued, say): not
	// done, so the key waits for it, as NextDue and the parked keys count.
	return false
}

// Waiting reports whether due rows may be left unclaimed because their
// ordering key holds Options.KeyDepth rows in flight: rows were left
// behind, or a key is full (a claim leaves it out unread, so whether rows
// of it wait is not known), or was full when the latest claim began. The
// relay claims again as rows settle, without waiting for a commit.
func (s *Store) Waiting() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.held.overflow) > 0 || s.held.freed {
		return true
	}
	for _, n := range s.held.keys {
		if s.keyDepth > 0 && n >= s.keyDepth {
			return true
		}
	}
	return false
}

// rescanDue reports whether the next claim reads the whole pending index
// (see Claim); s.mu is held.
func (s *Store) rescanDue(now int64) bool {
	h := &s.held
	due := len(h.ids) == 0 || !time.Now().Before(h.nextRescan)
	kept := h.deferred[:0]
	for _, at := range h.deferred {
		if at <= now {
			due = true
		} else {
			kept = append(kept, at)
		}
	}
	h.deferred = kept
	return due
}

// Quiet returns until when a claim finds nothing unless the table changes
// (a commit by another connection, a settle, a reclaim): after a claim of
// the whole pending index that took nothing, with no row in flight, the
// time the next pending row
// comes due, or the next look at the keys found waiting, whichever is
// first. It is zero after a claim that took rows (claim again as they
// settle), and far off when nothing is scheduled. It reads the due clock
// (Options.Clock) against the wall: after a step back of the wall clock it
// comes early, after a step forward late by the step (the relay's idle
// wait is a minute at most).
func (s *Store) Quiet() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held.quiet
}

// noteQuiet records Quiet after a claim: idle says the claim read the
// whole pending index and took nothing, at now (due clock, Unix ms).
func (s *Store) noteQuiet(ctx context.Context, idle bool, now int64) error {
	s.mu.Lock()
	inFlight := len(s.held.ids) > 0
	s.mu.Unlock()
	var quiet time.Time
	// Rows in flight may be settled for later (a retry, an outage): their
	// time is not in the table yet.
	if idle && !inFlight {
		var next sql.NullInt64
		if err := s.db.Reader().QueryRowContext(ctx, s.q.nextDue, now).Scan(&next); err != nil {
			return fmt.Errorf("claim rows: %w", err)
		}
		quiet = time.Now().Add(time.Hour)
		if next.Valid {
			quiet = time.Now().Add(time.Duration(next.Int64-now) * time.Millisecond)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.held.waiting) > 0 && quiet.After(s.held.nextLook) {
		quiet = s.held.nextLook
	}
	s.held.quiet = quiet
	return nil
}

// Rescan makes the next claim read the whole pending index, the keys
// found waiting included: rows went back to pending (a heartbeat reclaimed
// them).
func (s *Store) Rescan() {
	s.mu.Lock()
	s.held.nextRescan, s.held.nextLook, s.held.quiet = time.Time{}, time.Time{}, time.Time{}
	clear(s.held.parked)
	s.held.parkedEnc = ""
	s.mu.Unlock()
}

// wait sets key k aside, as parked when the row it waits for (p) is a
// dead letter.
func (h *held) wait(k string, p prevRow) {
	if event.Status(p.Status.String) == event.StatusDeadLettered {
		if !h.parked[k] {
			h.parked[k], h.parkedEnc = true, ""
		}
		return
	}
	h.waiting[k] = true
}

// maxParkedFor is how long parked keys stay set aside at most without a
// change of the dead letters' fingerprint: a backstop should a change
// leave it as it was.
const maxParkedFor = time.Minute

// deadLetterPrint returns a fingerprint of the table's dead letters that
// changes when one is retried, discarded or deleted, or another is added:
// their count, highest id, and a sum of their ids scrambled so that
// different sets rarely add up alike (and small enough never to overflow),
// read from the dead letters' index.
func (s *Store) deadLetterPrint(ctx context.Context) (string, error) {
	var n, top, sum int64
	if err := s.db.Reader().QueryRowContext(ctx, s.q.deadLetters).Scan(&n, &top, &sum); err != nil {
		return "", err
	}
	return strconv.FormatInt(n, 10) + ":" + strconv.FormatInt(top, 10) + ":" + strconv.FormatInt(sum, 10), nil
}

// readRows reads claimed rows, in id order, the row before each of the
// same ordering key (see takeSQL), and the indexes of those whose
// event_id is NULL. The columns are read as whatever SQLite holds, so that
// one row of a foreign shape (a text created_at, say) is reported on that
// row alone instead of failing the whole claim, which would take the same
// row first again. now (Unix ms) stands in for a NULL created_at. The
// result is given room for room rows at its first row: as many as the
// claim before found, so that while a backlog drains it is not grown by
// doubling to a batch of a thousand, and at a trickle one.
func readRows(rows *sql.Rows, now int64, room int) (out []event.Row, prev []prevRow, noID []int, err error) {
	defer rows.Close()
	// Scanned into anew for each row: declared once, so that they do not
	// each cost an allocation a row.
	var (
		r                           event.Row
		eventID, eventType, payload column
		orderingKey, headers, group column
		before                      prevRow
		attempts                    sql.NullInt64
		created, availAt            sql.NullInt64
		hasCreated, hasAvailAt      bool
	)
	dest := []any{&r.ID, &eventID, &eventType, &payload, &attempts, &created, &hasCreated, &availAt, &hasAvailAt, &orderingKey, &headers, &group, &before.ID, &before.Status}
	for rows.Next() {
		if out == nil {
			out, prev = make([]event.Row, 0, room), make([]prevRow, 0, room)
		}
		r = event.Row{}
		if err := rows.Scan(dest...); err != nil {
			return nil, nil, nil, err
		}
		if eventID.v == nil {
			noID = append(noID, len(out))
		}
		r.EventID, r.EventType, r.Payload, r.OrderingKey, r.Headers, r.Group = text(eventID.v), text(eventType.v), blob(payload.v), text(orderingKey.v), text(headers.v), text(group.v)
		r.Size = len(r.Payload)
		var problems []string
		if p := event.EventIDNotText(eventID.v); p != "" { // TEXT only
			problems = append(problems, p)
		}
		// A key may be a number in a column declared INTEGER, where SQLite
		// keeps every key a number; a BLOB key never equals the key it
		// spells.
		if _, isBlob := orderingKey.v.([]byte); isBlob {
			problems = append(problems, "ordering_key is a BLOB, which SQLite never finds equal to the TEXT key it spells (write it as TEXT: CAST(ordering_key AS TEXT))")
			r.OrderingKey = "" // of no key: dead-lettered alone, holding up no key
		}
		r.Attempts = int(max(0, min(attempts.Int64, math.MaxInt32)))
		// A NULL created_at leaves the claim as the earliest time known.
		r.CreatedAt = now
		if created.Valid {
			r.CreatedAt = created.Int64
		}
		var times []string
		if hasCreated && !created.Valid {
			times = append(times, "created_at")
		}
		if hasAvailAt && !availAt.Valid {
			times = append(times, "available_at")
		}
		if len(times) > 0 {
			problems = append(problems, fmt.Sprintf("%s holds neither Unix milliseconds nor a date and time SQLite writes", strings.Join(times, " and ")))
		}
		if len(problems) > 0 {
			r.Problem = "cannot read the row: " + strings.Join(problems, "; ")
		}
		out = append(out, r)
		prev = append(prev, before)
	}
	return out, prev, noID, rows.Err()
}

// assignIDs gives the rows at indexes noID, whose event_id is NULL (a
// foreign writer's), a fresh UUID before their first publish, so that a
// publish again after a crash carries the same Nats-Msg-Id. The id is
// written only where the row still has none; what the row holds is used.
func (s *Store) assignIDs(ctx context.Context, rows []event.Row, noID []int) error {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("assign event ids: %w", err)
	}
	defer tx.Rollback()
	st, err := tx.PrepareContext(ctx, s.q.assignID)
	if err != nil {
		return fmt.Errorf("assign event ids: %w", err)
	}
	defer st.Close()
	ids := make([]string, len(noID))
	for k, i := range noID {
		var id sql.NullString
		if err := st.QueryRowContext(ctx, event.NewID(), rows[i].ID).Scan(&id); err != nil && !errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("assign event ids: %w", err)
		}
		ids[k] = id.String
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("assign event ids: %w", err)
	}
	for k, i := range noID {
		rows[i].EventID = ids[k]
	}
	return nil
}

// column is a column's value as the driver gave it: a Scanner is handed
// the driver's value as it is, where database/sql gives an *any a copy of
// a BLOB. go-sqlite3 gives each row's BLOB in memory of its own (it copies
// it out of SQLite with C.GoBytes), so that copy was a second one of every
// payload (TestReadRowsKeepsEachRowsPayload holds the driver to it).
type column struct{ v any }

// Scan keeps src.
func (c *column) Scan(src any) error {
	c.v = src
	return nil
}

// text returns a text column's value as the relay publishes it.
func text(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	}
	return fmt.Sprint(v)
}

// blob returns a payload's bytes as SQLite stores them.
func blob(v any) []byte {
	switch v := v.(type) {
	case nil:
		return nil
	case []byte:
		return v
	case string:
		return []byte(v)
	}
	return []byte(fmt.Sprint(v))
}

// Settle writes the outcomes of claimed rows in one transaction and lets
// go of the rows. Done rows are settled at most settleChunkBytes of
// payload to a statement (one row, if larger). Each write is
// conditioned on the row being still pending; stale lists the indexes of
// the outcomes that changed nothing. With a Fence, the store writes only
// while it leads, checked in the same transaction: one that was paused
// (SIGSTOP, a frozen VM) and lost the lead writes nothing, and every
// outcome is stale. A release that makes a row due at once writes nothing
// (the row is pending and due already).
//
// A scanFrom above 0 is written, in the same transaction, as the stream
// sequence from which the messages of rows not settled can begin
// (schema.PublishedTable, for Options.Stream): every message this table's
// rows were published to below it is settled once this commits.
func (s *Store) Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) (stale []int, err error) {
	defer func() { err = sqlitedb.Explain(s.db.Path(), err) }()
	if len(outs) == 0 && scanFrom == 0 {
		return nil, nil
	}
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	defer tx.Rollback()
	if stale, err = s.settleTx(ctx, tx, outs, scanFrom); err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	s.letGo(outs, stale)
	return stale, nil
}

// settleTx writes outs and scanFrom in tx (see Settle).
func (s *Store) settleTx(ctx context.Context, tx *sql.Tx, outs []event.Outcome, scanFrom uint64) (stale []int, err error) {
	if leads, err := s.leadsIn(ctx, tx); err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	} else if !leads {
		for i := range outs {
			stale = append(stale, i)
		}
		return stale, nil
	}
	now, due := sqlitedb.NowMs(), s.db.DueMs()
	if scanFrom > 0 {
		if _, err := tx.ExecContext(ctx, `UPDATE `+schema.PublishedTable+` SET scan_from = ?1, updated_at = ?2 WHERE outbox_table = ?3 AND stream = ?4`,
			int64(scanFrom), now, s.db.Table(), s.stream); err != nil {
			return nil, fmt.Errorf("settle rows: record the stream position: %w", err)
		}
	}
	stmts := map[event.Settlement]*sql.Stmt{}
	defer func() {
		for _, st := range stmts {
			st.Close()
		}
	}()
	one := func(i int, q string, args ...any) error {
		o := outs[i]
		st := stmts[o.Settlement]
		if st == nil {
			var err error
			if st, err = tx.PrepareContext(ctx, q); err != nil {
				return fmt.Errorf("settle rows: %w", err)
			}
			stmts[o.Settlement] = st
		}
		res, err := st.ExecContext(ctx, append(args, o.Row.ID)...)
		if err != nil {
			return fmt.Errorf("settle row %d: %w", o.Row.ID, err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			stale = append(stale, i)
		}
		return nil
	}
	var done []int
	for i, o := range outs {
		var err error
		switch o.Settlement {
		case event.Done:
			done = append(done, i)
		case event.Retry:
			err = one(i, s.q.retry, o.Attempts, o.AvailableAt.UnixMilli(), o.Error)
		case event.DeadLetter:
			err = one(i, s.q.deadLetter, o.Attempts, o.Error, now)
		case event.Release:
			if o.AvailableAt.UnixMilli() > due {
				err = one(i, s.q.release, o.AvailableAt.UnixMilli())
			}
		default:
			err = fmt.Errorf("settle row %d: unknown settlement %v", o.Row.ID, o.Settlement)
		}
		if err != nil {
			return nil, err
		}
	}
	for len(done) > 0 {
		n := doneChunk(outs, done)
		lost, err := s.settleDone(ctx, tx, outs, done[:n], now)
		if err != nil {
			return nil, err
		}
		stale = append(stale, lost...)
		done = done[n:]
	}
	slices.Sort(stale)
	return stale, nil
}

// settleChunkBytes bounds the payloads of the rows one done statement
// settles. Every statement that reads a column stored after a row's
// payload walks the row's overflow pages: the done record's copy, the
// delete's check and its freeing of the pages, the update's check and its
// rewrite. Within a statement of a few rows the walks after the first
// find the pages in the writer's page cache (SQLite's default, 2,000
// KiB); over hundreds of large rows the cache has let them go and every
// walk reads the file again. Rows of 64 KiB or more go one to a statement,
// rows of 256 B still 256 to one.
const settleChunkBytes = 64 << 10

// doneChunk returns how many of the rows at indexes idx of outs to settle
// in one done statement: those whose payloads fit in settleChunkBytes, at
// least one.
func doneChunk(outs []event.Outcome, idx []int) int {
	var sum int
	for k, i := range idx {
		if sum += outs[i].Row.Size; sum > settleChunkBytes && k > 0 {
			return k
		}
	}
	return len(idx)
}

// settleDone marks the rows at indexes idx of outs done (or deletes them
// and records them), and returns the indexes of those it did not settle.
func (s *Store) settleDone(ctx context.Context, tx *sql.Tx, outs []event.Outcome, idx []int, now int64) ([]int, error) {
	arg := doneJSON(outs, idx)
	if s.q.doneRecord != "" {
		if _, err := tx.ExecContext(ctx, s.q.doneRecord, arg, now); err != nil {
			return nil, fmt.Errorf("settle rows: %w", err)
		}
	}
	var settled int64
	for _, q := range s.q.done {
		res, err := tx.ExecContext(ctx, q, arg, now)
		if err != nil {
			return nil, fmt.Errorf("settle rows: %w", err)
		}
		n, _ := res.RowsAffected()
		settled += n
	}
	if int(settled) == len(idx) {
		return nil, nil
	}
	ids := jsonIDs(func(yield func(int64) bool) {
		for _, i := range idx {
			if !yield(outs[i].Row.ID) {
				return
			}
		}
	})
	return s.notSettled(ctx, tx, outs, idx, ids, now)
}

// leadsIn asks the fence, if any, whether tx may write settlements.
func (s *Store) leadsIn(ctx context.Context, tx *sql.Tx) (bool, error) {
	if s.fence == nil {
		return true, nil
	}
	if leads, err := s.fence.LeadsIn(ctx, tx); err != nil || !leads {
		return leads, err
	}
	// The rows in flight were claimed with the heartbeat row as it was
	// then: one gone back (a backup written into the file in place) or
	// written again since (a relay that joined again) settles nothing.
	// The application may have given their ids to new rows meanwhile.
	instance, _, beat := s.fence.ClaimFence()
	started := s.claimedWith.Load()
	if instance == "" || started == 0 {
		return true, nil
	}
	var same bool
	err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+schema.InstancesTable+` WHERE instance_id = ? AND started_at = ? AND heartbeat_at >= ?)`,
		instance, started, beat).Scan(&same)
	return same, err
}

// letGo forgets settled rows as in flight and remembers when the rows it
// deferred become due.
func (s *Store) letGo(outs []event.Outcome, stale []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := &s.held
	for i, o := range outs {
		if _, ok := h.ids[o.Row.ID]; ok && o.Row.Group != "" {
			if h.groups[o.Row.Group]--; h.groups[o.Row.Group] <= 0 {
				delete(h.groups, o.Row.Group)
			}
			h.goneGroups[o.Row.Group] = true
		}
		delete(h.ids, o.Row.ID)
		h.gone[o.Row.ID] = struct{}{}
		if k := o.Row.OrderingKey; k != "" {
			if s.keyDepth > 0 && h.keys[k] >= s.keyDepth {
				h.freed = true
			}
			if h.keys[k]--; h.keys[k] <= 0 {
				delete(h.keys, k)
			}
			// Read the rows left behind once half the room is free.
			if h.overflow[k] && h.keys[k] <= s.keyDepth/2 {
				delete(h.overflow, k)
				h.nextRescan = time.Time{}
			}
		}
		if len(stale) > 0 && stale[0] == i {
			stale = stale[1:]
			continue
		}
		if o.Settlement == event.Retry || o.Settlement == event.Release {
			h.deferred = append(h.deferred, o.AvailableAt.UnixMilli())
		}
	}
	h.max = 0
	for id := range h.ids {
		h.max = max(h.max, id)
	}
	if len(h.ids) == 0 {
		// Nothing claimed in flight: the next settles (a reconciliation's)
		// are fenced by the lead alone.
		s.claimedWith.Store(0)
	}
	h.quiet = time.Time{} // what was settled may come due: claim to find out
}

// notSettled returns the indexes among idx (whose ids are the JSON array
// ids) whose rows the done statement at now did not mark done.
func (s *Store) notSettled(ctx context.Context, tx *sql.Tx, outs []event.Outcome, idx []int, ids string, now int64) ([]int, error) {
	settled := map[int64]bool{}
	rows, err := tx.QueryContext(ctx, s.q.settledAt, ids, now)
	if err != nil {
		return nil, fmt.Errorf("settle rows: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("settle rows: %w", err)
		}
		settled[id] = true
	}
	var lost []int
	for _, i := range idx {
		if !settled[outs[i].Row.ID] {
			lost = append(lost, i)
		}
	}
	return lost, rows.Err()
}

// doneJSON returns the rows at indexes idx of outs as a JSON array of
// [id, stream_seq] pairs, for the done statement.
func doneJSON(outs []event.Outcome, idx []int) string {
	b := []byte{'['}
	for k, i := range idx {
		if k > 0 {
			b = append(b, ',')
		}
		b = append(b, '[')
		b = strconv.AppendInt(b, outs[i].Row.ID, 10)
		b = append(b, ',')
		b = strconv.AppendUint(b, outs[i].StreamSeq, 10)
		b = append(b, ']')
	}
	return string(append(b, ']'))
}

// jsonIDs returns ids as a JSON array, for json_each.
func jsonIDs(ids iter.Seq[int64]) string {
	b := []byte{'['}
	for id := range ids {
		if len(b) > 1 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, id, 10)
	}
	return string(append(b, ']'))
}
