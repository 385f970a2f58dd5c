package audit

import (
	"fmt"
	"io"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/admin"
)

// mismatchesShown is how many mismatches Print writes; the JSON has all.
const mismatchesShown = 20

// Summary is what the audit command prints: a report with the file, table
// and stream it audited, and how far back (Since; 0: all done rows).
type Summary struct {
	Database     string        `json:"database"`
	Table        string        `json:"-"`
	Stream       string        `json:"stream"`
	Since        time.Duration `json:"-"`
	SinceSeconds float64       `json:"since_seconds,omitempty"`
	Report
}

// Print writes the summary for people: the counts, each with what it
// means, and the first mismatches, their event ids escaped (admin.Shown).
func (s Summary) Print(w io.Writer) {
	r := s.Report
	which := "all done rows"
	if s.Since > 0 {
		which = fmt.Sprintf("done rows of the last %s", s.Since)
	}
	fmt.Fprintf(w, "audit of %s (table %s) against stream %s: %s, %d audited\n", s.Database, s.Table, s.Stream, which, r.Audited)
	fmt.Fprintf(w, "  matched     %d (the message at the row's stream sequence carries its event id)\n", r.Matched)
	fmt.Fprintf(w, "  removed     %d (no longer in the stream: its limits, a purge or a delete; first sequence now %d)\n", r.Removed, r.FirstSeq)
	fmt.Fprintf(w, "  unrecorded  %d (no stream sequence on the row: done before it was recorded, or core NATS)\n", r.Unrecorded)
	if r.EarlierStream > 0 {
		fmt.Fprintf(w, "  earlier     %d (published to an earlier stream %s, since deleted: done before this one was created at %s)\n",
			r.EarlierStream, s.Stream, r.Created.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(w, "  mismatched  %d\n", len(r.Mismatches))
	for i, m := range r.Mismatches {
		if i == mismatchesShown {
			fmt.Fprintf(w, "  and %d more (--json lists them all)\n", len(r.Mismatches)-mismatchesShown)
			break
		}
		if m.MsgID == "" && m.MsgRowID == "" {
			fmt.Fprintf(w, "  row %d (event_id %s): stream sequence %d was never stored (the stream's last is %d)\n", m.RowID, admin.Shown(m.EventID), m.StreamSeq, r.LastSeq)
			continue
		}
		fmt.Fprintf(w, "  row %d (event_id %s): stream sequence %d holds event %q (row %q)\n", m.RowID, admin.Shown(m.EventID), m.StreamSeq, m.MsgID, m.MsgRowID)
	}
}
