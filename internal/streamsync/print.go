package streamsync

import (
	"fmt"
	"io"
)

// Summary is what the streamsync command prints: a sync's result, and
// whether it was a dry run (whose changes would be made, not made).
type Summary struct {
	Result
	DryRun bool `json:"dry_run"`
}

// NeedsAttention reports whether the sync left something an operator must
// fix: an update the server refused, or subjects the stream does not
// capture.
func (r Result) NeedsAttention() bool { return len(r.Rejected) > 0 || r.NotCaptured != "" }

// Print writes the summary for people: the stream and consumer with their
// changes, a refused update with the command that would make it by hand,
// and what was done.
func (s Summary) Print(w io.Writer) {
	res := s.Result
	would := func(did, will string) string {
		if s.DryRun {
			return will
		}
		return did
	}
	fmt.Fprintf(w, "stream %s", res.Stream)
	if res.StreamCreated {
		fmt.Fprintf(w, ": %s", would("created", "missing; would be created"))
	}
	fmt.Fprintln(w)
	for _, ch := range res.Changes.Stream {
		fmt.Fprintf(w, "  %-18s %s -> %s\n", ch.Field, ch.Old, ch.New)
	}
	if res.Consumer != "" {
		fmt.Fprintf(w, "consumer %s/%s", res.Stream, res.Consumer)
		switch {
		case res.ConsumerCreated:
			fmt.Fprintf(w, ": %s", would("created", "missing; would be created"))
		case res.ConsumerMissing:
			fmt.Fprint(w, ": missing; not managed (set consumer.create to create it)")
		}
		fmt.Fprintln(w)
		for _, ch := range res.Changes.Consumer {
			fmt.Fprintf(w, "  %-18s %s -> %s\n", ch.Field, ch.Old, ch.New)
		}
	}
	if res.NotCaptured != "" {
		fmt.Fprintf(w, "problem: %s\n", res.NotCaptured)
	}
	s.printOutcome(w)
}

// printOutcome ends the summary: the refused updates, or what was done.
func (s Summary) printOutcome(w io.Writer) {
	res := s.Result
	n := len(res.Changes.Stream) + len(res.Changes.Consumer)
	for _, created := range []bool{res.StreamCreated, res.ConsumerCreated} {
		if created {
			n++
		}
	}
	if res.Window != nil && res.Window.Short() && len(res.Rejected) == 0 {
		// A dry run whose window patch the server would refuse.
		fmt.Fprintf(w, "warning: %s\n", res.Window.Warning())
	}
	if res.AtomicIgnored {
		fmt.Fprintln(w, "warning: the server ignored allow_atomic (nats-server older than 2.12): the relay publishes one row at a time")
	}
	switch {
	case len(res.Rejected) > 0:
		for _, r := range res.Rejected {
			fmt.Fprintf(w, "rejected: the server refused the %s update: %s\n  fix it by hand: %s\n", r.Part, r.Error, r.Command)
			if r.Hint != "" {
				fmt.Fprintf(w, "  %s\n", r.Hint)
			}
		}
	case n == 0:
		fmt.Fprintln(w, "in sync: nothing to change")
	case s.DryRun:
		fmt.Fprintf(w, "dry run: %d change(s) planned, nothing applied (run without --dry-run to apply)\n", n)
	default:
		fmt.Fprintf(w, "applied %d change(s)\n", n)
	}
}
