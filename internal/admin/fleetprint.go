package admin

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// FleetLinesShown is how many files the fleet summary prints, worst
// first; the rest are counted. JSON lists every file.
const FleetLinesShown = 20

// FleetFile is one file of a fleet as its summary shows it: the figures
// an operator compares across tenants, or why the file could not be read.
type FleetFile struct {
	Tenant           string  `json:"tenant"`
	Path             string  `json:"path"`
	Pending          int64   `json:"pending"`
	PendingDue       int64   `json:"pending_due"`
	DeadLettered     int64   `json:"dead_lettered"`
	ParkedKeys       int64   `json:"parked_key_count"`
	OldestPendingAge float64 `json:"oldest_pending_age_seconds"`
	// Leader is the instance id of the relay leading the file's outbox
	// table; empty when none leads.
	Leader string `json:"leader"`
	// Error is why the file could not be read (not a database, no outbox
	// table, locked); the figures are then zero.
	Error string `json:"error,omitempty"`
}

// FleetFileOf is the summary line of the file at path read as st at now.
func FleetFileOf(tenant, path string, st Status, now time.Time) FleetFile {
	f := FleetFile{Tenant: tenant, Path: path, Pending: st.Rows[event.StatusPending], PendingDue: st.PendingDue,
		DeadLettered: st.Rows[event.StatusDeadLettered], ParkedKeys: st.ParkedKeyCount, OldestPendingAge: st.OldestPendingAge(now)}
	for _, r := range st.Relays {
		if r.Leader {
			f.Leader = r.ID
		}
	}
	return f
}

// FleetReport is what status prints for a fleet without --db: each file
// of database.path's pattern, worst first (SortFleet).
type FleetReport struct {
	Pattern  string             `json:"pattern"`
	Table    string             `json:"table"`
	Count    int                `json:"file_count"`
	Unread   int                `json:"unreadable_count"`
	Files    []FleetFile        `json:"files"`
	Window   *streamsync.Window `json:"duplicate_window,omitempty"`
	Detailed string             `json:"-"` // how to see one file's detail
}

// SortFleet orders files worst first: those that could not be read, then
// the largest backlog, then the oldest due row; ties by tenant.
func SortFleet(files []FleetFile) {
	slices.SortStableFunc(files, func(a, b FleetFile) int {
		if (a.Error != "") != (b.Error != "") {
			if a.Error != "" {
				return -1
			}
			return 1
		}
		return cmp.Or(cmp.Compare(b.Pending, a.Pending), cmp.Compare(b.OldestPendingAge, a.OldestPendingAge), cmp.Compare(a.Tenant, b.Tenant))
	})
}

// Print renders the report for people: one line a file, the first
// FleetLinesShown of them, the error of a file that could not be read in
// place of its figures.
func (r FleetReport) Print(out io.Writer) {
	fmt.Fprintf(out, "database %s (table %s): a fleet of %d files", r.Pattern, r.Table, r.Count)
	if r.Unread > 0 {
		fmt.Fprintf(out, ", %d could not be read", r.Unread)
	}
	fmt.Fprintln(out)
	if len(r.Files) > 0 {
		w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "TENANT\tPENDING\tDUE\tDEAD_LETTERED\tPARKED_KEYS\tOLDEST_PENDING\tLEADER")
		for _, f := range r.Files[:min(len(r.Files), FleetLinesShown)] {
			if f.Error != "" {
				fmt.Fprintf(w, "%s\terror: %s\n", Shown(f.Tenant), Shown(f.Error))
				continue
			}
			oldest, leader := "none due", "none"
			if f.PendingDue > 0 {
				oldest = roundAge(f.OldestPendingAge)
			}
			if f.Leader != "" {
				leader = Shown(f.Leader)
			}
			fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%s\t%s\n", Shown(f.Tenant), f.Pending, f.PendingDue, f.DeadLettered, f.ParkedKeys, oldest, leader)
		}
		w.Flush()
	}
	if more := len(r.Files) - FleetLinesShown; more > 0 {
		fmt.Fprintf(out, "... and %d more (--json lists every file)\n", more)
	}
	if r.Detailed != "" {
		fmt.Fprintln(out, r.Detailed)
	}
	if r.Window != nil {
		printWindow(out, *r.Window)
	}
}
