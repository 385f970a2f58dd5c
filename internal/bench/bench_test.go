package bench

import (
	"os/exec"
	"strings"
	"testing"
)

// TestStartRelay: a relay child that exits before "relay starting" is
// reported at once with its exit status and its error line; one that logs
// a line of 200 KB first, and goes on writing, is still seen to start, in
// either log format.
func TestStartRelay(t *testing.T) {
	_, _, err := startRelay(exec.Command("sh", "-c", `echo '{"level":"error","msg":"boom"}' >&2; exit 3`))
	if err == nil || !strings.Contains(err.Error(), "the relay exited before logging") || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("startRelay = %v; want the exit at startup, its status and its last line", err)
	}
	for format, line := range map[string]string{
		"json":    `echo '{"level":"info","msg":"relay starting"}' >&2`,
		"console": `printf '2026-01-01T00:00:00.000Z\tINFO\trelay starting\t{"stream": "EVENTS"}\n' >&2`,
	} {
		ch, at, err := startRelay(exec.Command("sh", "-c", `head -c 200000 /dev/zero | tr '\0' x >&2; echo >&2; `+line+`; head -c 200000 /dev/zero >&2; exec sleep 30`))
		if err != nil {
			t.Fatalf("%s, after a 200 KB line: %v", format, err)
		}
		if at.IsZero() {
			t.Errorf("%s: no start time", format)
		}
		ch.Kill()
	}
}
