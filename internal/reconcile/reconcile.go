// Package reconcile settles, before a relay that starts leading an outbox
// table publishes anything, the rows whose messages the stream holds
// already: rows left pending by a relay killed between the PubAck and the
// settle, and every row a restored backup brings back pending. JetStream
// drops a republished event only within its duplicate window; this holds
// past it.
//
// Each message carries its table's origin (Outbox-Origin, kept in the file,
// so a restored copy has it), its row id and its event id. The table's
// mark (schema.PublishedTable) says from which stream sequence the
// messages of its unsettled rows can begin: every settle moves it, in the
// settle's own transaction, so a backup holds the mark that goes with its
// rows. Run reads the stream from the mark to its end, headers only, on
// the relay's subjects, and settles what it finds batch by batch, each
// batch's transaction moving the mark past it: a relay killed meanwhile
// resumes where it stopped.
package reconcile

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// Settler writes outcomes and the mark in one transaction, fenced by the
// lead (*claim.Store).
type Settler interface {
	Settle(ctx context.Context, outs []event.Outcome, scanFrom uint64) (stale []int, err error)
}

// Options say what Run reconciles.
type Options struct {
	DB     *sqlitedb.DB
	Store  Settler
	JS     jetstream.JetStream
	Stream string
	// Subjects is the filter of the relay's subjects (prefix.>).
	Subjects string
	Origin   string
	// Batch is how many messages are read, and settled, at a time
	// (default 1000).
	Batch int
	// Progress, when set, is told the progress after each batch, and once
	// before the first.
	Progress func(Progress)
}

// Progress is how far a reconciliation got.
type Progress struct {
	From, To uint64 // the sequences it reads: from the mark to the stream's last
	Next     uint64 // the sequence it reads next
	Read     int    // messages read on the relay's subjects
	Settled  int    // rows found published and settled done
	Reused   int    // rows dead-lettered: the stream holds their event id for another row
	// Orphans are messages of this table whose row is gone (written
	// after a restored backup's point in time); Orphan is the first.
	Orphans int
	Orphan  string
	Started time.Time
	// RowsBefore is the highest row id when it began: a row above it was
	// written since, and no earlier relay published it.
	RowsBefore int64
}

// Remaining is how many sequences are left to read.
func (p Progress) Remaining() uint64 {
	if p.Next > p.To {
		return 0
	}
	return p.To - p.Next + 1
}

// Scans reports whether anything was to be read.
func (p Progress) Scans() bool { return p.From <= p.To }

// Run reconciles (see the package doc) and returns what it did; To in
// the result is the stream's last sequence when it began: every message
// published after Run returns is stored above it. A broker or database
// error ends it; run it again to go on from where it stopped.
func Run(ctx context.Context, o Options) (Progress, error) {
	if o.Batch <= 0 {
		o.Batch = 1000
	}
	p := Progress{Started: time.Now()}
	s, err := o.JS.Stream(ctx, o.Stream)
	if err != nil {
		return p, fmt.Errorf("look up stream %s: %w", o.Stream, err)
	}
	info := s.CachedInfo() // as the look-up just read it
	created, first, last := info.Created.UnixNano(), info.State.FirstSeq, info.State.LastSeq
	if p.RowsBefore, err = highestRow(ctx, o.DB); err != nil {
		return p, err
	}
	mark, err := readMark(ctx, o.DB)
	if err != nil {
		return p, err
	}
	from, at, err := start(ctx, o, mark, created)
	if err != nil {
		return p, err
	}
	records, err := sqlitedb.ObjectExists(ctx, o.DB.Reader(), "table", schema.DoneTable(o.DB.Table()))
	if err != nil {
		return p, err
	}
	sc := scan{Options: o, adoptedAt: mark.AdoptedAt, records: records}
	if last == 0 {
		// The stream has never stored a message: none is this table's.
		from, at = 1, time.Time{}
	}
	if from == 0 && at.IsZero() {
		from = last + 1 // nothing to scan
	}
	p.From, p.To, p.Next = max(from, first), last, max(from, first)
	if p.Scans() && noneOwn(ctx, o.JS, o.Stream, o.Subjects, p.From) {
		p.From, p.Next = last+1, last+1
	}
	if o.Progress != nil {
		o.Progress(p)
	}
	if !p.Scans() {
		return p, writeMark(ctx, o.DB, o.Stream, created, last+1)
	}
	// A scan that starts at a time records where it is from its first
	// batch on; until then the next run starts at the same time.
	scanFrom := p.From
	if !at.IsZero() {
		scanFrom = 0
	}
	if err := writeMark(ctx, o.DB, o.Stream, created, scanFrom); err != nil {
		return p, err
	}
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{o.Subjects}, HeadersOnly: true,
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: p.From}
	if !at.IsZero() {
		cfg.DeliverPolicy, cfg.OptStartSeq, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, 0, &at
	}
	c, err := s.OrderedConsumer(ctx, cfg)
	if err != nil {
		return p, unreadable(o.Stream, err)
	}
	// Messages arrive while the batch before is settled.
	it, err := c.Messages(jetstream.PullMaxMessages(2 * o.Batch))
	if err != nil {
		return p, unreadable(o.Stream, err)
	}
	defer func() {
		it.Stop()
		if ci := c.CachedInfo(); ci != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			_ = s.DeleteConsumer(dctx, ci.Name) // else the server removes it when idle
		}
	}()
	var pending uint64 // messages on the relay's subjects left to read
	if ci := c.CachedInfo(); ci != nil {
		pending = ci.NumPending
	}
	pl := newPipeline(ctx, sc, &p)
	batch := make([]seen, 0, o.Batch)
	read := p.From // the sequence read next, for errors
	for pending > 0 && pl.ctx.Err() == nil {
		m, err := it.Next(jetstream.NextMaxWait(readWait))
		if err != nil {
			pl.fail(fmt.Errorf("read stream %s from sequence %d: %w", o.Stream, read, err))
			break
		}
		meta, err := m.Metadata()
		if err != nil {
			pl.fail(fmt.Errorf("read stream %s: %w", o.Stream, err))
			break
		}
		seq := meta.Sequence.Stream
		if seq > p.To {
			break // stored since Run began: not this table's unsettled rows
		}
		h := m.Headers()
		batch = append(batch, seen{seq: seq, at: meta.Timestamp.UnixMilli(), msgID: h.Get(publish.HeaderMsgID), rowID: h.Get(publish.HeaderRowID), origin: h.Get(publish.HeaderOrigin),
			created: publish.CreatedAt(h)})
		if !at.IsZero() && read == p.From && len(batch) == 1 {
			p.From = seq // before the first batch is handed on
		}
		read, pending = seq+1, meta.NumPending
		if len(batch) == o.Batch && pending > 0 && seq < p.To {
			pl.send(batch, seq+1)
			batch = make([]seen, 0, o.Batch)
		}
	}
	if pl.ctx.Err() == nil {
		// The last batch moves the mark past the stream's end as Run
		// found it.
		pl.send(batch, p.To+1)
	}
	return p, pl.wait()
}

// pipeline settles batches of messages in two stages that overlap: the
// rows of one batch are read (a reader connection) while the batch before
// is settled (the writer). A row read as pending that the batch before
// settled meanwhile is left alone by the settle, which writes only
// pending rows.
type pipeline struct {
	ctx     context.Context
	fail    context.CancelCauseFunc
	lookups chan stage
	done    chan struct{}
}

// stage is a batch on its way: its messages, the mark it moves to, and
// the rows of their event ids once read.
type stage struct {
	batch []seen
	next  uint64
	rows  map[string]row
}

func newPipeline(ctx context.Context, o scan, p *Progress) *pipeline {
	ctx, fail := context.WithCancelCause(ctx)
	pl := &pipeline{ctx: ctx, fail: fail, lookups: make(chan stage, 1), done: make(chan struct{})}
	settles := make(chan stage, 1)
	go func() {
		defer close(settles)
		for st := range pl.lookups {
			if ctx.Err() != nil {
				continue
			}
			var err error
			if st.rows, err = rowsOf(ctx, o.Options, st.batch); err != nil {
				fail(err)
				continue
			}
			settles <- st
		}
	}()
	go func() {
		defer close(pl.done)
		for st := range settles {
			if ctx.Err() != nil {
				continue
			}
			if err := p.settle(ctx, o, st); err != nil {
				fail(err)
			}
		}
	}()
	return pl
}

// send hands a batch on; after a failure it is dropped.
func (pl *pipeline) send(batch []seen, next uint64) {
	select {
	case pl.lookups <- stage{batch: batch, next: next}:
	case <-pl.ctx.Done():
	}
}

// wait waits for the batches sent to be settled, and returns the first
// failure.
func (pl *pipeline) wait() error {
	close(pl.lookups)
	<-pl.done
	defer pl.fail(nil)
	return context.Cause(pl.ctx)
}

// readWait bounds the wait for a message the stream said was there.
const readWait = 10 * time.Second

// start returns where the scan starts: the mark m, for the stream it was
// written for; the stream's first sequence, for a stream of that name
// created since (deleted and created again). Without a mark (a table no
// relay of this release reconciled, or a scan that began at a time and
// read nothing yet) a message of a pending row was published after the
// row was written: the scan starts at the time the oldest pending row was
// written (less event.ClockSkew), and there is nothing to scan when none is
// pending (at 0).
func start(ctx context.Context, o Options, m Mark, created int64) (seq uint64, at time.Time, err error) {
	switch {
	case m.Stream == o.Stream && m.Created == created && m.ScanFrom > 0:
		return m.ScanFrom, at, nil
	case m.Stream == o.Stream && m.Created != created:
		return 1, at, nil
	}
	oldest, err := oldestPending(ctx, o.DB)
	if err != nil || oldest == 0 {
		return 0, at, err
	}
	return 0, time.UnixMilli(oldest).Add(-event.ClockSkew), nil
}

// noneOwn reports whether the stream holds no message on the relay's
// subjects from sequence from on. A stream shared with other tables (a
// fleet's files, each on its tenant's subjects) moves on without this
// one's messages; one look at the last message on its subjects then spares
// a scan its consumer. The look is a message request, which the stream's
// leader answers, never a direct get: a mirror of the stream or a replica
// behind its leader may answer those, without the latest messages. Only
// a message below from counts, or "no message found" confirmed by the
// stream's index of its subjects (noSubjects): the server answers that for
// a store that failed to read too. Anything else (a refused request, no
// answer in time, a JetStream domain or API prefix, whose requests go
// elsewhere) is not sure either: scan.
func noneOwn(ctx context.Context, js jetstream.JetStream, stream, subjects string, from uint64) bool {
	if o := js.Options(); o.Domain != "" || o.APIPrefix != "" {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, lastOwnWait)
	defer cancel()
	var resp struct {
		Message *struct {
			Seq uint64 `json:"seq"`
		} `json:"message"`
		Error *jetstream.APIError `json:"error"`
	}
	switch {
	case !ask(ctx, js, "STREAM.MSG.GET."+stream, struct {
		LastFor string `json:"last_by_subj"`
	}{subjects}, &resp):
		return false
	case resp.Message != nil:
		return resp.Message.Seq > 0 && resp.Message.Seq < from
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return noSubjects(ctx, js, stream, subjects)
	}
	return false
}

// noSubjects reports whether the stream's index of its subjects, which
// its server keeps in memory as messages are stored and removed and no
// read of a message feeds, holds none that subjects matches: then the
// stream holds no message on them, and a table that has not recorded a
// position yet (a fleet's new file) reads nothing. It asks only a server
// that knows the request's subjects_filter (2.10 or later; an older one
// would answer with no subjects, whatever it holds).
func noSubjects(ctx context.Context, js jetstream.JetStream, stream, subjects string) bool {
	var major, minor int
	if _, err := fmt.Sscanf(js.Conn().ConnectedServerVersion(), "%d.%d", &major, &minor); err != nil || major < 2 || (major == 2 && minor < 10) {
		return false
	}
	var resp struct {
		State *struct {
			Subjects map[string]uint64 `json:"subjects"`
		} `json:"state"`
		Error *jetstream.APIError `json:"error"`
	}
	return ask(ctx, js, "STREAM.INFO."+stream, struct {
		Filter string `json:"subjects_filter"`
	}{subjects}, &resp) && resp.Error == nil && resp.State != nil && len(resp.State.Subjects) == 0
}

// ask sends req, as JSON, to the JetStream API's subject api and decodes
// the answer into resp; false when it cannot.
func ask(ctx context.Context, js jetstream.JetStream, api string, req, resp any) bool {
	body, err := json.Marshal(req)
	if err != nil {
		return false
	}
	reply, err := js.Conn().RequestWithContext(ctx, jetstream.DefaultAPIPrefix+api, body)
	return err == nil && json.Unmarshal(reply.Data, resp) == nil
}

// lastOwnWait bounds noneOwn's request.
const lastOwnWait = 5 * time.Second

// seen is what a message says of its row.
type seen struct {
	seq                  uint64
	at                   int64 // when it was stored, Unix ms
	msgID, rowID, origin string
	created              int64 // its row's created_at (Outbox-Created-At), Unix ms; 0: none
}

// scan is a reconciliation's options and what it found of the table.
type scan struct {
	Options
	adoptedAt int64 // Mark.AdoptedAt
	records   bool  // the table of done rows' records exists
}

// own reports whether message m is row r's: it carries the table's
// origin (or none, from before Outbox-Origin, or another origin from
// before the table had one, Mark.AdoptedAt) and names the row; else why
// not, a *publish.ReusedID.
func (o scan) own(m seen, r row) error {
	err := publish.Reused(o.Stream, m.seq, m.rowID, m.origin, r.id, o.Origin)
	if err != nil && m.origin != "" && m.at < o.adoptedAt && m.rowID == strconv.FormatInt(r.id, 10) {
		return nil
	}
	return err
}

// Unreadable is a stream the reconciliation cannot read: the server
// refuses the consumer it reads with (a work-queue stream, one at its
// max_consumers).
type Unreadable struct{ Err error }

func (e *Unreadable) Error() string { return e.Err.Error() }
func (e *Unreadable) Unwrap() error { return e.Err }

// unreadable wraps err, from creating the consumer that reads stream, in
// an *Unreadable when the server refused it.
func unreadable(stream string, err error) error {
	err = fmt.Errorf("read stream %s: %w", stream, err)
	var api *jetstream.APIError
	if errors.As(err, &api) {
		return &Unreadable{err}
	}
	return err
}

// row is what the table holds for an event id.
type row struct {
	id       int64
	status   string
	attempts int
	size     int   // the payload's length: the settle sizes its statements by it
	created  int64 // created_at, Unix ms (0: none read)
}

// unnamed is the key rowsOf gives a row without an event id (a foreign
// writer's, given one at its first claim) under its row id: no event id
// begins with a NUL.
func unnamed(rowID string) string { return "\x00" + rowID }

// settle settles the rows of batch's messages and moves the mark to next,
// in one transaction, and reports the progress.
func (p *Progress) settle(ctx context.Context, o scan, st stage) error {
	if err := p.settleBatch(ctx, o, st); err != nil {
		return err
	}
	p.Read += len(st.batch)
	p.Next = st.next
	if o.Progress != nil {
		o.Progress(*p)
	}
	return nil
}

func (p *Progress) settleBatch(ctx context.Context, o scan, st stage) error {
	batch, rows, next := st.batch, st.rows, st.next
	var outs []event.Outcome
	taken := map[int64]bool{}
	var gone []seen             // messages of this table without a row of their event id
	var revived []int64         // dead letters whose own message is stored
	named := map[int64]string{} // rows without an event id, given their message's
	for _, m := range batch {
		r, ok := rows[m.msgID]
		ours := m.origin == o.Origin
		if n, found := rows[unnamed(m.rowID)]; !ok && ours && found && !taken[n.id] && n.status == string(event.StatusPending) &&
			m.created != 0 && m.created == n.created {
			// A row restored from a backup taken before its first claim
			// gave it an event id: this message, of this table and row
			// and of the row's created_at to the millisecond, is its own
			// (a row id given again after the restore was written later).
			r, ok = n, true
			named[n.id] = m.msgID
		}
		if !ok {
			if ours {
				gone = append(gone, m)
			}
			continue
		}
		if taken[r.id] || r.status != string(event.StatusPending) && r.status != string(event.StatusDeadLettered) {
			continue
		}
		reused := o.own(m, r)
		if r.status == string(event.StatusDeadLettered) {
			if reused != nil {
				continue
			}
			// A dead letter of a restored backup, retried and published
			// since its point in time: its event is in the stream, and
			// a retry would store it again. Done, as a pending row.
			revived = append(revived, r.id)
		}
		taken[r.id] = true
		ev := event.Row{ID: r.id, EventID: m.msgID, Size: r.size}
		if reused == nil {
			outs = append(outs, event.Outcome{Row: ev, Settlement: event.Done, StreamSeq: m.seq})
			continue
		}
		outs = append(outs, event.Outcome{Row: ev, Settlement: event.DeadLetter, Attempts: r.attempts,
			Error: reused.Error(), Reason: event.DeadLetterReusedID})
	}
	orphans, err := orphaned(ctx, o, gone)
	if err != nil {
		return err
	}
	if err := revive(ctx, o.DB, revived); err != nil {
		return err
	}
	if err := name(ctx, o.DB, named); err != nil {
		return err
	}
	stale, err := o.Store.Settle(ctx, outs, next)
	if err != nil {
		return err
	}
	for i, out := range outs {
		if len(stale) > 0 && stale[0] == i {
			stale = stale[1:]
			continue
		}
		if out.Settlement == event.Done {
			p.Settled++
		} else {
			p.Reused++
		}
	}
	if p.Orphans == 0 && len(orphans) > 0 {
		p.Orphan = fmt.Sprintf("sequence %d, event id %s, row %s", orphans[0].seq, orphans[0].msgID, orphans[0].rowID)
	}
	p.Orphans += len(orphans)
	return nil
}

// revive makes the dead letters ids pending, for the settle that follows
// to mark them done as it does pending rows (in both of
// retention.done_rows' ways). A crash between the two leaves them pending
// with their messages stored, below the mark: the next reconciliation
// reads the batch again and settles them.
func revive(ctx context.Context, db *sqlitedb.DB, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	j, _ := json.Marshal(ids)
	if _, err := db.Exec(ctx, `UPDATE `+db.Table()+` SET status = 'pending' WHERE id IN (SELECT value FROM json_each(?)) AND status = 'dead_lettered'`, string(j)); err != nil {
		return fmt.Errorf("settle the dead letters found in the stream: %w", err)
	}
	return nil
}

// name gives the rows of ids (by row id) the event ids of their messages,
// where they have none yet, for the settle that follows. A crash between
// the two leaves them pending with their messages' ids, below the mark:
// the next reconciliation reads the batch again and settles them.
func name(ctx context.Context, db *sqlitedb.DB, ids map[int64]string) error {
	if len(ids) == 0 {
		return nil
	}
	pairs := make([][2]any, 0, len(ids))
	for id, eventID := range ids {
		pairs = append(pairs, [2]any{id, eventID})
	}
	j, _ := json.Marshal(pairs)
	t := db.Table()
	if _, err := db.Exec(ctx, `UPDATE `+t+` SET event_id = j.value ->> 1 FROM json_each(?) AS j WHERE `+t+`.id = j.value ->> 0 AND `+t+`.event_id IS NULL`, string(j)); err != nil {
		return fmt.Errorf("name the rows found in the stream: %w", err)
	}
	return nil
}

// rowsOf returns the rows of the event ids of batch's messages, by event
// id, and the rows without an event id that a message of this table names,
// by unnamed(row id). A message of this table (or from before Outbox-Origin) names its
// row: those are read by id, in id order, and those whose row holds
// another event id, with the others', by the event id's unique index.
func rowsOf(ctx context.Context, o Options, batch []seen) (map[string]row, error) {
	out := make(map[string]row, len(batch))
	var ids []int64
	for _, m := range batch {
		if id, err := strconv.ParseInt(m.rowID, 10, 64); err == nil && (m.origin == o.Origin || m.origin == "") {
			ids = append(ids, id)
		}
	}
	if err := readRows(ctx, o.DB, "id", ids, out); err != nil {
		return nil, err
	}
	var eventIDs []string
	for _, m := range batch {
		if _, ok := out[m.msgID]; !ok {
			eventIDs = append(eventIDs, m.msgID)
		}
	}
	return out, readRows(ctx, o.DB, "event_id", eventIDs, out)
}

// readRows reads into out, by event id, the rows whose column col is
// among vals.
func readRows[T any](ctx context.Context, db *sqlitedb.DB, col string, vals []T, out map[string]row) error {
	if len(vals) == 0 {
		return nil
	}
	arg, _ := json.Marshal(vals)
	q := fmt.Sprintf(`SELECT id, CAST(event_id AS TEXT), coalesce(CAST(status AS TEXT), ''), coalesce(attempts, 0), coalesce(octet_length(payload), 0),
coalesce(%s, 0) FROM %s WHERE %s IN (SELECT value FROM json_each(?1))`, schema.MsSQL("created_at"), db.Table(), col)
	rs, err := db.Reader().QueryContext(ctx, q, string(arg))
	if err != nil {
		return fmt.Errorf("read the rows of the stream's messages: %w", err)
	}
	defer rs.Close()
	for rs.Next() {
		var r row
		var id sql.NullString
		if err := rs.Scan(&r.id, &id, &r.status, &r.attempts, &r.size, &r.created); err != nil {
			return fmt.Errorf("read the rows of the stream's messages: %w", err)
		}
		if !id.Valid {
			out[unnamed(strconv.FormatInt(r.id, 10))] = r
			continue
		}
		out[id.String] = r
	}
	return rs.Err()
}

// orphaned returns the messages of gone whose row has no record either
// (a row deleted when done keeps one, retention.done_rows: delete).
func orphaned(ctx context.Context, o scan, gone []seen) ([]seen, error) {
	if len(gone) == 0 || !o.records {
		return gone, nil
	}
	db := o.DB
	ids := make([]string, len(gone))
	for i, m := range gone {
		ids[i] = m.rowID
	}
	arg, _ := json.Marshal(ids)
	rs, err := db.Reader().QueryContext(ctx, `SELECT id, CAST(event_id AS TEXT) FROM `+schema.DoneTable(db.Table())+
		` WHERE id IN (SELECT CAST(value AS INTEGER) FROM json_each(?1))`, string(arg))
	if err != nil {
		return nil, fmt.Errorf("read the records of done rows: %w", err)
	}
	defer rs.Close()
	recorded := map[string]bool{}
	for rs.Next() {
		var id, eventID string
		if err := rs.Scan(&id, &eventID); err != nil {
			return nil, fmt.Errorf("read the records of done rows: %w", err)
		}
		recorded[id+" "+eventID] = true
	}
	var out []seen
	for _, m := range gone {
		if !recorded[m.rowID+" "+m.msgID] {
			out = append(out, m)
		}
	}
	return out, rs.Err()
}
