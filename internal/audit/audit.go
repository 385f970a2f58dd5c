// Package audit checks that what the outbox table says was published is
// in the stream: each done row's recorded stream sequence holds a message
// with the row's event id. It reads the table in short batches (read-only,
// safe while relays and the application run) and the stream by sequence.
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
// sequence (streamsync.ReadStored on one stream).
type Reader func(ctx context.Context, seqs []uint64) ([]streamsync.Stored, uint64, error)

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
	// Unrecorded: done rows without a stream sequence (done before the
	// relay recorded them, or published with core NATS).
	Unrecorded int        `json:"unrecorded"`
	Mismatches []Mismatch `json:"mismatches"`
}

// Mismatch is a done row whose recorded sequence holds another event, or
// its event id published for another row (an id reused within the
// duplicate window: the row's own event is not in the stream).
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
		before = rows[len(rows)-1].ID
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
		if len(seqs) > 0 {
			stored, first, err := read(ctx, seqs)
			if err != nil {
				return r, err
			}
			r.FirstSeq = first
			for i, st := range stored {
				d := recorded[i]
				switch {
				case st.Gone:
					r.Removed++
				case st.MsgID == d.EventID && (st.RowID == "" || st.RowID == strconv.FormatInt(d.ID, 10)):
					// (A message from before Outbox-Row-Id carries none.)
					r.Matched++
				default:
					r.Mismatches = append(r.Mismatches, Mismatch{RowID: d.ID, EventID: d.EventID, StreamSeq: d.StreamSeq, MsgID: st.MsgID, MsgRowID: st.RowID})
				}
			}
		}
		r.Audited += len(rows)
		if o.Progress != nil {
			o.Progress(r.Audited)
		}
	}
	return r, nil
}
