package admin

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// StatusReport is what the status command prints: a status with the file
// it was read from, the age of its oldest due row, what a dead letter does
// to its ordering key, and (status --stream) the stream's duplicate window.
type StatusReport struct {
	Database         string             `json:"database"`
	Table            string             `json:"table"`
	OldestPendingAge float64            `json:"oldest_pending_age_seconds"`
	OnDeadLetter     string             `json:"ordering_on_dead_letter"`
	Window           *streamsync.Window `json:"duplicate_window,omitempty"`
	Status
	// Parks says whether a dead letter parks its ordering key
	// (ordering.on_dead_letter); JSON has OnDeadLetter.
	Parks bool `json:"-"`
}

// OldestPendingAge is how long, in seconds at now, the oldest due row has
// waited since it became due; 0 when none is due.
func (st Status) OldestPendingAge(now time.Time) float64 {
	if st.OldestPending.IsZero() {
		return 0
	}
	return max(0, now.Sub(st.OldestPending).Seconds())
}

// Print renders the report for people at now.
func (r StatusReport) Print(out io.Writer, now time.Time) {
	st := r.Status
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "database\t%s (table %s)\n", r.Database, r.Table)
	fmt.Fprintf(w, "rows\t%s\n", rowCounts(st.Rows))
	fmt.Fprintf(w, "pending\tdue %d   scheduled %d\n", st.PendingDue, st.PendingScheduled)
	if st.OldestPending.IsZero() {
		fmt.Fprintf(w, "oldest pending\tnone due\n")
	} else {
		fmt.Fprintf(w, "oldest pending\t%s waiting since it became due (%s)\n", roundAge(r.OldestPendingAge), st.OldestPending.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(w, "relays\t%d\n", len(st.Relays))
	printRelays(w, st.Relays, now)
	if st.PendingGrouped > 0 {
		fmt.Fprintf(w, "atomic groups\t%s\n", groupState(st))
	}
	fmt.Fprintf(w, "consumer exhausted\t%d message(s) (dead-letters list --consumer)\n", st.ConsumerExhausted)
	if st.LastStreamSeq > 0 {
		fmt.Fprintf(w, "stream sequence\t%d on the latest done row (audit checks each row's)\n", st.LastStreamSeq)
	}
	if p := st.Position; p != nil {
		from := fmt.Sprintf("sequence %d", p.ScanFrom)
		if p.ScanFrom == 0 {
			from = "its oldest pending row's time"
		}
		fmt.Fprintf(w, "reconciles from\t%s of stream %s, when a relay next begins to lead (origin %s)\n", from, p.Stream, p.Origin)
	}
	switch {
	case !r.Parks:
		fmt.Fprintf(w, "parked keys\tnone (ordering.on_dead_letter: %s)\n", r.OnDeadLetter)
	case st.ParkedKeyCount == 0:
		fmt.Fprintf(w, "parked keys\tnone\n")
	default:
		fmt.Fprintf(w, "parked keys\t%d: their rows wait until the dead letter is retried (dead-letters retry ID) or deleted\n", st.ParkedKeyCount)
	}
	w.Flush()
	if len(st.ParkedKeys) > 0 {
		fmt.Fprintf(out, "parked keys, longest parked first:\n")
		printParkedKeys(out, st.ParkedKeys)
		if more := st.ParkedKeyCount - int64(len(st.ParkedKeys)); more > 0 {
			fmt.Fprintf(out, "and %d more parked key(s)\n", more)
		}
	}
	if len(st.LastDeadLetters) > 0 {
		fmt.Fprintf(out, "last dead letters (dead-letters list for more):\n")
		PrintDeadLetters(out, st.LastDeadLetters)
	}
	if r.Window != nil {
		printWindow(out, *r.Window)
	}
}

// printRelays lists the heartbeat rows, one a line in the second column of
// w. A relay presumed dead is said to be so, with who takes over: a live
// relay heartbeating beside it, or else the next one to start.
func printRelays(w io.Writer, relays []Instance, now time.Time) {
	live := slices.ContainsFunc(relays, func(r Instance) bool { return !r.PresumedDead })
	for _, r := range relays {
		since := roundAge(now.Sub(r.HeartbeatAt).Seconds())
		state := fmt.Sprintf("standing by, %d in flight, heartbeat %s ago", r.InFlight, since)
		switch {
		case r.PresumedDead && live:
			state = fmt.Sprintf("not heartbeating for %s: presumed dead; a live relay takes over (and its %d row(s) in flight)", since, r.InFlight)
		case r.PresumedDead:
			state = fmt.Sprintf("not heartbeating for %s: presumed dead; the next relay to start takes over (and its %d row(s) in flight)", since, r.InFlight)
		case r.Leader:
			state = fmt.Sprintf("leading, %d in flight, heartbeat %s ago", r.InFlight, since)
			switch l := r.AtomicBatchLimit; {
			case l == nil:
			case *l > 0:
				state += fmt.Sprintf("; an ordering key's due rows go in atomic batches of up to %d", *l)
			default:
				state += "; an ordering key's rows go one at a time: the stream takes no atomic batches (allow_atomic; see the relay's log)"
			}
		}
		fmt.Fprintf(w, "\t%s on %s (pid %d, %s), started %s, %s\n", Shown(r.ID), Shown(r.Hostname), r.PID, Shown(r.Version),
			r.StartedAt.UTC().Format(time.RFC3339), state)
	}
}

// groupState says what becomes of the pending rows of atomic groups: held
// while the leading relay takes no atomic batches, else published.
func groupState(st Status) string {
	for _, r := range st.Relays {
		if r.Leader && !r.PresumedDead && (r.AtomicBatchLimit == nil || *r.AtomicBatchLimit == 0) {
			return fmt.Sprintf("%d rows of atomic groups held: the leading relay publishes no atomic batches (the stream's allow_atomic, nats-server 2.12 or later; see the relay's log); they stay pending, whole, no attempt spent", st.PendingGrouped)
		}
	}
	return fmt.Sprintf("%d pending rows in atomic groups", st.PendingGrouped)
}

// rowCounts lists the rows per status in lifecycle order, then the rows
// whose status the relay does not know (another writer's) as "other", each
// named.
func rowCounts(rows map[event.Status]int64) string {
	var counts, others []string
	var other int64
	for _, status := range event.Statuses {
		counts = append(counts, fmt.Sprintf("%s %d", status, rows[status]))
	}
	for status, n := range rows {
		if !slices.Contains(event.Statuses, status) {
			other += n
			name := strconv.Quote(string(status))
			if status == NullStatus {
				name = "NULL"
			}
			others = append(others, fmt.Sprintf("%s %d", name, n))
		}
	}
	if other > 0 {
		slices.Sort(others)
		counts = append(counts, fmt.Sprintf("other %d (%s)", other, strings.Join(others, ", ")))
	}
	return strings.Join(counts, "   ")
}

// roundAge writes an age in seconds to the precision a reader wants of
// it: milliseconds under a second, tenths under a minute, else seconds.
func roundAge(seconds float64) string {
	d := time.Duration(seconds * float64(time.Second))
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

// printParkedKeys lists parked keys, each with the dead letter its rows
// wait behind (ROW_ID, dead-lettered at SINCE) and how many rows wait.
func printParkedKeys(w io.Writer, keys []ParkedKey) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ORDERING_KEY\tSINCE\tROW_ID\tWAITING\tEVENT_TYPE\tLAST_ERROR")
	for _, p := range keys {
		fmt.Fprintf(tw, "%q\t%s\t%d\t%d\t%q\t%s\n", p.OrderingKey, p.ProcessedAt.UTC().Format(time.RFC3339), p.ID, p.WaitingRows, p.EventType, oneLine(p.LastError))
	}
	tw.Flush()
}

// printWindow says how long the stream deduplicates, with the warning and
// the choice when that is shorter than the relay needs.
func printWindow(out io.Writer, w streamsync.Window) {
	fmt.Fprintf(out, "duplicate window: %s (stream %s, stream.duplicate_window %s)\n", w.Have, w.Stream, w.Want)
	if warning := w.Warning(); warning != "" {
		fmt.Fprintf(out, "warning: %s\n", warning)
	}
}
