package main

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestFatalErrorFollowsTheLogFormat: when run's logs are JSON (the
// default), the error it exits on is a JSON line too, with the error and
// the exit code; with console logs it is a line for people.
func TestFatalErrorFollowsTheLogFormat(t *testing.T) {
	path := filepath.Join(t.TempDir(), "absent.db")
	args := []string{"run", "--database-path", path, "--nats-url", "nats://127.0.0.1:1", "--metrics-listen", ""}
	code, _, errOut := runCLI(t, args...)
	lines := strings.Split(strings.TrimSpace(errOut), "\n")
	var last struct {
		Level, Msg, Error string
		ExitCode          int `json:"exit_code"`
	}
	for _, l := range lines {
		if err := json.Unmarshal([]byte(l), &last); err != nil {
			t.Fatalf("a line of run's stderr is not JSON (%v): %q\n%s", err, l, errOut)
		}
	}
	if code != exitRuntime || last.Level != "error" || !strings.Contains(last.Error, path) || last.ExitCode != exitRuntime {
		t.Errorf("exit %d, last line %+v; want an error line naming %s with exit_code 1", code, last, path)
	}

	code, _, errOut = runCLI(t, append(args, "--log-format", "console")...)
	if code != exitRuntime || !strings.HasPrefix(lastLine(errOut), "outbox-relay: ") || !strings.Contains(errOut, path) {
		t.Errorf("console logs: exit %d, stderr %q; want the plain line", code, errOut)
	}
}

// lastLine is the last line of out.
func lastLine(out string) string {
	l := strings.Split(strings.TrimSpace(out), "\n")
	return l[len(l)-1]
}

// TestReportCommandsKeepStderrForProblems: streamsync and audit print
// their report on stdout and, on stderr, no info log lines (connected,
// stream created) beside it.
func TestReportCommandsKeepStderrForProblems(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	t.Setenv("NATS_URL", n.URL())
	for _, args := range [][]string{{"streamsync"}, {"audit", "--database-path", path}} {
		code, out, errOut := runCLI(t, args...)
		if code != 0 || out == "" || errOut != "" {
			t.Errorf("%v: exit %d, stdout %q; stderr %q, want nothing", args, code, out, errOut)
		}
	}
}

// TestJSONLogDurationsCarryTheirUnit: a duration in a JSON log line reads
// as Go writes it ("1h0m0s"), not as a bare number of seconds.
func TestJSONLogDurationsCarryTheirUnit(t *testing.T) {
	n := testenv.StartNATS(t)
	d := startDaemon(t, []string{"NATS_URL=" + n.URL()}, "run", "--database-path", testenv.NewDB(t), "--metrics-listen", "")
	if got := d.waitFor("created stream")["duplicate_window"]; got != time.Hour.String() {
		t.Errorf("created stream: duplicate_window %#v, want %q", got, time.Hour.String())
	}
	d.stop()
}
