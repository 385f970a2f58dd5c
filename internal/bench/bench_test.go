package bench

import (
	"os/exec"
	"strings"
	"testing"
)

// TestBenchChild: a bench child that exits before "relay starting" is
// reported at once with its exit status and last log lines; one that logs
// a line longer than the scanner's first buffer is still followed.
func TestBenchChild(t *testing.T) {
	ch, err := newChild(exec.Command("sh", "-c", `echo '{"level":"error","msg":"boom"}' >&2; exit 3`))
	if err != nil {
		t.Fatal(err)
	}
	_, err = ch.waitStarted()
	if err == nil || !strings.Contains(err.Error(), "exited at startup") || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("waitStarted = %v; want the exit at startup, its status and its last line", err)
	}
	ch, err = newChild(exec.Command("sh", "-c", `head -c 200000 /dev/zero | tr '\0' x >&2; echo >&2; echo '{"msg":"relay starting"}' >&2; head -c 200000 /dev/zero >&2; sleep 30`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.waitStarted(); err != nil {
		t.Fatalf("after a 200 KB line: %v", err)
	}
	ch.cmd.Process.Kill()
	<-ch.logged
	ch.cmd.Wait()
}
