package admin

import (
	"fmt"
	"strings"
	"testing"
)

// TestFleetWorstFirst: files that could not be read come first, then the
// largest backlog, then the oldest due row, ties by tenant; Print shows
// FleetLinesShown of them and counts the rest, and escapes an error's
// control characters.
func TestFleetWorstFirst(t *testing.T) {
	files := []FleetFile{
		{Tenant: "calm"},
		{Tenant: "busy", Pending: 9, PendingDue: 9, OldestPendingAge: 1},
		{Tenant: "broken", Error: "open database: file is not a database\x1b[2J"},
		{Tenant: "older", Pending: 9, PendingDue: 9, OldestPendingAge: 90},
		{Tenant: "also-calm"},
	}
	SortFleet(files)
	var order []string
	for _, f := range files {
		order = append(order, f.Tenant)
	}
	if got := strings.Join(order, " "); got != "broken older busy also-calm calm" {
		t.Fatalf("order %q", got)
	}
	for i := range FleetLinesShown {
		files = append(files, FleetFile{Tenant: fmt.Sprint("t", i)})
	}
	var out strings.Builder
	FleetReport{Pattern: "/data/*.db", Table: "event_queue", Count: len(files), Unread: 1, Files: files}.Print(&out)
	for _, want := range []string{"a fleet of 25 files, 1 could not be read\n", "file is not a database\\x1b[2J\n", "older      9  9  0  0  1m30s", "\n... and 5 more (--json lists every file)\n"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the summary does not say %q:\n%s", want, out.String())
		}
	}
}
