package child

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// start runs script with sh as a child, killed when the test ends.
func start(t *testing.T, script string) *Process {
	t.Helper()
	p, err := Start(exec.Command("sh", "-c", script))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

// killedBySignal says whether the child ended by SIGKILL.
func killedBySignal(p *Process) bool {
	ws, ok := p.State().Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// TestWaitForReadsBothFormats: a line is awaited by its message in JSON
// (its fields decoded) and in the console format, with or without a
// logger name and fields; other lines are kept with no message.
func TestWaitForReadsBothFormats(t *testing.T) {
	p := start(t, `
echo 'plain text, not a log line' >&2
printf '2026-01-01T00:00:00.000Z\tINFO\tconsole starting\t{"database": "app.db"}\n' >&2
printf '2026-01-01T00:00:00.000Z\tWARN\trelay\tnamed and bare\n' >&2
echo '{"level":"info","msg":"relay starting","rows":3}' >&2
exec sleep 60`)
	line, err := p.WaitFor("relay starting", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if line.Fields["level"] != "info" || line.Fields["rows"] != float64(3) || line.At.IsZero() {
		t.Fatalf("JSON line %+v", line)
	}
	for _, msg := range []string{"console starting", "named and bare"} {
		if l, err := p.WaitFor(msg, time.Minute); err != nil || l.Fields != nil || !strings.Contains(l.Text, "\t"+msg) {
			t.Fatalf("console line %q: %+v %v", msg, l, err)
		}
	}
	lines := p.Lines()
	if len(lines) != 4 || lines[0].Text != "plain text, not a log line" || lines[0].Msg != "" || lines[0].Fields != nil {
		t.Fatalf("lines %+v", lines)
	}
	if got := p.Find("relay starting"); len(got) != 1 || got[0].Text != `{"level":"info","msg":"relay starting","rows":3}` {
		t.Fatalf("Find: %+v", got)
	}
	if p.State() != nil {
		t.Fatal("State is set while the child runs")
	}
}

// TestEarlyExitIsReported: a child that exits before the awaited line
// makes WaitFor fail at once with its exit status and its error line; a
// line it wrote before exiting is still found, the last one even without
// its newline.
func TestEarlyExitIsReported(t *testing.T) {
	p := start(t, `echo '{"level":"error","msg":"boom"}' >&2; exit 3`)
	_, err := p.WaitFor("relay starting", time.Hour)
	if err == nil || !strings.Contains(err.Error(), `exited before logging "relay starting": exit status 3`) || !strings.Contains(err.Error(), `"msg":"boom"`) {
		t.Fatalf("WaitFor = %v; want the exit before the line, its status and its last line", err)
	}
	var exit *exec.ExitError
	if err := p.Wait(); !errors.As(err, &exit) || exit.ExitCode() != 3 || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("Wait = %v; want exit status 3 and the last line", err)
	}
	if p.State().ExitCode() != 3 {
		t.Fatalf("exit code %d", p.State().ExitCode())
	}

	p = start(t, `echo '{"msg":"first"}' >&2; printf '{"msg":"last"}' >&2`)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	for _, msg := range []string{"first", "last"} {
		if _, err := p.WaitFor(msg, time.Hour); err != nil {
			t.Errorf("after the exit: %v", err)
		}
	}
	if err := p.ExitedEarly("the table drained"); err == nil || !strings.Contains(err.Error(), "exited before the table drained: exit status 0") {
		t.Fatalf("ExitedEarly = %v", err)
	}
}

// TestWaitForGivesUp: a line that does not come within the time limit is
// an error with the last lines; the child still runs.
func TestWaitForGivesUp(t *testing.T) {
	p := start(t, `echo '{"msg":"something else"}' >&2; exec sleep 60`)
	if _, err := p.WaitFor("something else", time.Minute); err != nil {
		t.Fatal(err)
	}
	_, err := p.WaitFor("never", time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), `did not log "never" within 1ms`) || !strings.Contains(err.Error(), "something else") {
		t.Fatalf("WaitFor = %v", err)
	}
	if p.State() != nil {
		t.Fatal("the child was stopped")
	}
	if err := p.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("the child is gone: %v", err)
	}
}

// TestStop: a child that exits on the signal stops cleanly or with its
// status and error line; one that ignores it is killed at the time limit.
func TestStop(t *testing.T) {
	p := start(t, `trap 'exit 0' TERM; echo '{"msg":"ready"}' >&2; while :; do sleep 0.01; done`)
	if _, err := p.WaitFor("ready", time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := p.Stop(syscall.SIGTERM, time.Minute); err != nil || p.State().ExitCode() != 0 {
		t.Fatalf("Stop = %v", err)
	}
	if err := p.Stop(syscall.SIGTERM, time.Minute); err != nil {
		t.Fatalf("Stop after the exit = %v", err)
	}

	p = start(t, `trap 'echo "{\"msg\":\"cannot stop cleanly\"}" >&2; exit 1' TERM; echo '{"msg":"ready"}' >&2; while :; do sleep 0.01; done`)
	if _, err := p.WaitFor("ready", time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := p.Stop(syscall.SIGTERM, time.Minute); err == nil || !strings.Contains(err.Error(), "exit status 1") || !strings.Contains(err.Error(), "cannot stop cleanly") {
		t.Fatalf("Stop = %v; want exit status 1 and the line", err)
	}

	p = start(t, `trap '' TERM; echo '{"msg":"ready"}' >&2; exec sleep 60`)
	if _, err := p.WaitFor("ready", time.Minute); err != nil {
		t.Fatal(err)
	}
	err := p.Stop(syscall.SIGTERM, 10*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), `did not exit within 10ms of signal "terminated"; killed`) || !strings.Contains(err.Error(), "ready") {
		t.Fatalf("Stop = %v", err)
	}
	if !killedBySignal(p) {
		t.Fatalf("the child ended %v; want killed", p.State())
	}
}

// TestLargeOutput: megabytes on stderr, a line far longer than the longest
// kept among them, do not block the child: the line after them is read,
// and the long line is kept cut to maxLine.
func TestLargeOutput(t *testing.T) {
	p := start(t, `head -c 3000000 /dev/zero | tr '\0' x >&2; echo >&2
i=0; while [ $i -lt 2000 ]; do echo "filler line $i, some text to make it longer than a word" >&2; i=$((i+1)); done
head -c 5000000 /dev/zero >&2
echo >&2; echo '{"msg":"after"}' >&2; exec sleep 60`)
	if _, err := p.WaitFor("after", time.Minute); err != nil {
		t.Fatal(err)
	}
	lines := p.Lines()
	if len(lines) != 2003 || len(lines[0].Text) != maxLine || strings.Trim(lines[0].Text, "x") != "" || lines[1000].Text != "filler line 999, some text to make it longer than a word" {
		t.Fatalf("%d lines, the first %d bytes", len(lines), len(lines[0].Text))
	}
	if len(lines[2001].Text) != maxLine || !bytes.Equal([]byte(lines[2001].Text), make([]byte, maxLine)) {
		t.Fatalf("the second long line is %d bytes", len(lines[2001].Text))
	}
}

// TestKill: Kill ends a running child and waits for it; on a child that
// has exited it does nothing.
func TestKill(t *testing.T) {
	p := start(t, `exec sleep 60`)
	p.Kill()
	if !killedBySignal(p) {
		t.Fatalf("the child ended %v; want killed", p.State())
	}
	if err := p.Signal(syscall.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("Signal after Kill = %v", err)
	}
	p.Kill()
}

// TestStartKeepsStderrItsOwn: a command whose stderr is already set is
// refused, not silently redirected; a command that cannot start is an
// error.
func TestStartKeepsStderrItsOwn(t *testing.T) {
	cmd := exec.Command("sh", "-c", "true")
	cmd.Stderr = os.Stderr
	if _, err := Start(cmd); err == nil || cmd.Process != nil {
		t.Fatalf("Start with Stderr set = %v", err)
	}
	if _, err := Start(exec.Command("/nonexistent/binary")); err == nil {
		t.Fatal("Start of a missing binary succeeded")
	}
}
