package audit_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/audit"
)

// hostileID is an event id an application could write: shown raw, it
// would set the terminal's title and clear its screen; escapedID is how
// output for people shows it.
const (
	hostileID = "id\x1b]0;PWNED\x07\x1b[2J"
	escapedID = `id\x1b]0;PWNED\a\x1b[2J`
)

// TestAuditReportEscapesEventIDs: a mismatch's event id, written by the
// application, reaches the terminal with its control characters escaped.
func TestAuditReportEscapesEventIDs(t *testing.T) {
	var w bytes.Buffer
	audit.Summary{Database: "outbox.db", Table: "event_queue", Stream: "EVENTS",
		Report: audit.Report{Audited: 1, Mismatches: []audit.Mismatch{{RowID: 1, EventID: hostileID, StreamSeq: 3, MsgID: hostileID}}}}.Print(&w)
	// The first byte a terminal would act on: below a space but a newline,
	// DEL, or a right-to-left override.
	raw := strings.IndexFunc(w.String(), func(r rune) bool { return (r < ' ' && r != '\n') || r == 0x7f || r == '\u202e' })
	if raw >= 0 || !strings.Contains(w.String(), "event_id "+escapedID) {
		t.Errorf("audit's report does not escape the event id:\n%q", w.String())
	}
}
