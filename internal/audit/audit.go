// Package audit checks that what the outbox table says was published is
// in the stream: each done row's recorded stream sequence holds a message
// with the row's event id. It reads the table in short batches (read-only,
// safe while relays and the application run) and the stream by sequence.
// A row done before the stream was created was published to an earlier
// stream of that name (deleted, then created again, counting its
// sequences from 1 again): it is told apart, not taken for a mismatch.
// The audit command prints the report as a Summary.
package audit

import (
	"context"
	"math"
	"strconv"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// Reader reads the messages at sequences, and the stream's first
// sequence and creation time (streamsync.ReadStored on one stream).
type Reader func(ctx context.Context, seqs []uint64) ([]streamsync.Stored, streamsync.StreamState, error)

// Options say which rows are audited and how.
type Options struct {
	Since    time.Duration // rows done this recently; 0: all
	Limit    int           // at most this many rows, newest first; 0: all
	Batch    int           // rows read from the table, and messages from the stream, at a time (default 500)
	Progress func(audited int)
	Now      func() time.Time // default time.Now
}

// Report is what the audit found.
type Report struct {
	Audited int `json:"audited"` // done rows looked at
	Matched int `json:"matched"` // their message carries their event id
	// Removed: the stream no longer holds the message (its limits, a
	// purge or a delete removed it); FirstSeq is the stream's first
	// sequence when the audit ended.
	Removed  int    `json:"removed"`
	FirstSeq uint64 `json:"stream_first_seq"`
	// LastSeq is the stream's last sequence when the audit ended.
	LastSeq uint64 `json:"stream_last_seq"`
	// EarlierStream: rows done before the stream was created (Created),
	// whose message is not at their sequence: they were published to an
	// earlier stream of the name, since deleted.
	EarlierStream int       `json:"earlier_stream"`
	Created       time.Time `json:"stream_created,omitzero"`
	// Unrecorded: done rows without a stream sequence (done before the
	// relay recorded them, or published with core NATS).
	Unrecorded int        `json:"unrecorded"`
	Mismatches []Mismatch `json:"mismatches"`
}

// Mismatch is a done row whose recorded sequence holds another event, or
// its event id published for another row (an id reused within the
// duplicate window: the row's own event is not in the stream), or that
// the stream never reached (above its last sequence: a stream restored
// from an older snapshot, say; MsgID is empty then).
type Mismatch struct {
	RowID     int64  `json:"row_id"`
	EventID   string `json:"event_id"`
	StreamSeq uint64 `json:"stream_seq"`
	// MsgID and MsgRowID are the Nats-Msg-Id and Outbox-Row-Id of the
	// message the stream holds there.
	MsgID    string `json:"stream_msg_id"`
	MsgRowID string `json:"stream_row_id,omitempty"`
}

// Run audits the done rows of db against the stream read reads.
func Run(ctx context.Context, db *sqlitedb.DB, read Reader, o Options) (Report, error) {
	r := Report{Mismatches: []Mismatch{}}
	if o.Batch <= 0 {
		o.Batch = 500
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	since := int64(math.MinInt64)
	if o.Since > 0 {
		since = o.Now().Add(-o.Since).UnixMilli()
	}
	before := int64(math.MaxInt64)
	for o.Limit <= 0 || r.Audited < o.Limit {
		n := o.Batch
		if o.Limit > 0 {
			n = min(n, o.Limit-r.Audited)
		}
		rows, err := admin.DoneRows(ctx, db, since, before, n)
		if err != nil {
			return r, err
		}
		if len(rows) == 0 {
			break
		}
		if err := r.audit(ctx, db, read, rows, since, before); err != nil {
			return r, err
		}
		before = rows[len(rows)-1].ID
		r.Audited += len(rows)
		if o.Progress != nil {
			o.Progress(r.Audited)
		}
	}
	return r, nil
}

// audit checks one batch of done rows, read newest first from those done
// since since with ids below before.
func (r *Report) audit(ctx context.Context, db *sqlitedb.DB, read Reader, rows []admin.DoneRow, since, before int64) error {
	var seqs []uint64
	var recorded []admin.DoneRow
	for _, d := range rows {
		if d.StreamSeq == 0 {
			r.Unrecorded++
			continue
		}
		seqs = append(seqs, d.StreamSeq)
		recorded = append(recorded, d)
	}
	if len(seqs) == 0 {
		return nil
	}
	stored, st, err := read(ctx, seqs)
	if err != nil {
		return err
	}
	r.FirstSeq, r.LastSeq, r.Created = st.FirstSeq, st.LastSeq, st.Created
	var unmatched []int
	for i, m := range stored {
		d := recorded[i]
		// (A message from before Outbox-Row-Id carries none.)
		if !m.Gone && m.MsgID == d.EventID && (m.RowID == "" || m.RowID == strconv.FormatInt(d.ID, 10)) {
			r.Matched++
		} else {
			unmatched = append(unmatched, i)
		}
	}
	if len(unmatched) == 0 {
		return nil
	}
	current, err := doneSince(ctx, db, st.Created, since, before, len(rows))
	if err != nil {
		return err
	}
	for _, i := range unmatched {
		d, m := recorded[i], stored[i]
		switch {
		case !current[d.ID]:
			r.EarlierStream++
		case m.Gone && d.StreamSeq <= st.LastSeq:
			r.Removed++
		default:
			r.Mismatches = append(r.Mismatches, Mismatch{RowID: d.ID, EventID: d.EventID, StreamSeq: d.StreamSeq, MsgID: m.MsgID, MsgRowID: m.RowID})
		}
	}
	return nil
}

// doneSince returns which of the done rows below before (and done since
// since) were done at or after created: the others were published before
// the stream existed. The batch of n rows below before holds every one of
// them, so n rows of the narrower read are enough. A zero created (not
// known) counts every row.
func doneSince(ctx context.Context, db *sqlitedb.DB, created time.Time, since, before int64, n int) (map[int64]bool, error) {
	from := since
	if !created.IsZero() {
		from = max(since, created.UnixMilli())
	}
	rows, err := admin.DoneRows(ctx, db, from, before, n)
	if err != nil {
		return nil, err
	}
	ids := make(map[int64]bool, len(rows))
	for _, d := range rows {
		ids[d.ID] = true
	}
	return ids, nil
}
