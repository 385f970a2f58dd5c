package bench

import (
	"bytes"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestFleet runs the --fleet measurements at a tiny scale with the real
// relay as children: every part reports, every row written is read back
// from the stream or found done, and the text report has each line. It
// asserts nothing on timing.
func TestFleet(t *testing.T) {
	bin := relayBinary(t)
	settle := 300 * time.Millisecond
	o := Options{Fleet: 20, Rows: 400, Size: 64, Duration: 2 * time.Second, Idle: time.Second, WriterCheckpoint: 1000, Dir: t.TempDir()}
	rep, err := (&bench{o: o, exe: bin, fleetSettle: &settle}).run()
	if err != nil {
		t.Fatal(err)
	}
	x := rep.Fleet
	if x == nil || x.Files != 20 || x.Idle == nil || x.Trickle == nil || x.Drains == nil || x.NewFiles == nil {
		t.Fatalf("report %+v; want every part of a fleet of 20", x)
	}
	if rep.Drain != nil || rep.Ceiling != 0 {
		t.Errorf("a --fleet run measured the drain or the ceiling too: %+v", rep)
	}
	if tr := x.Trickle; tr.FilesWritten != 20 || tr.Rate != 20*fleetWriterRate || tr.Fleet.Rows < 20 || tr.Single.Rows < 20 || tr.Fleet.CPUPercent <= 0 {
		t.Errorf("trickle %+v, fleet %+v, single %+v", tr, tr.Fleet, tr.Single)
	}
	d := x.Drains
	if d.Single.Rows != 400 || d.One.Rows != 400 || d.One.Files != 1 || d.Many.Files != 20 || d.Many.Rows != 20*(400/fleetBusy) {
		t.Errorf("drains: single %+v, one %+v, many %+v", d.Single, d.One, d.Many)
	}
	if d.Many.DoneMeanSeconds <= 0 || d.ManyMaxOverMean < 1 || d.OneRatio <= 0 || d.ManyRatio <= 0 {
		t.Errorf("drain figures %+v, many %+v", d, d.Many)
	}
	for name, s := range map[string]*NewFileSamples{"moved in": x.NewFiles.MovedIn, "created in place": x.NewFiles.CreatedInPlace, "woken": x.NewFiles.WokenSyncFull} {
		if len(s.AckMs) != fleetNewFiles || len(s.DoneMs) != fleetNewFiles || s.AckMaxMs < s.AckMedianMs {
			t.Errorf("new files %s: %+v", name, s)
		}
	}
	if x.PeakRSSMi <= 0 || x.Idle.PeakRSSMiB <= 0 {
		t.Errorf("peak RSS %v, idle %v", x.PeakRSSMi, x.Idle.PeakRSSMiB)
	}
	var out bytes.Buffer
	Print(&out, rep)
	for _, want := range []string{"--fleet: 20 database files", "all idle", "trickle: 20 files x 20 rows/s", "CPU, fleet / single file",
		"drain, one file of 20", "drain, 20 files at once", "time to done, max / mean", "new file, moved in", "new file, created in place", "woken, synchronous=FULL", "fleet peak RSS"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
	t.Logf("\n%s", out.String())
}

// TestStoppedWaitsForTheProcess: stopped returns once a process sent
// SIGSTOP is stopped, and fails for one that runs.
func TestStoppedWaitsForTheProcess(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if err := stopped(cmd.Process.Pid); err == nil {
		t.Fatal("a running process was taken for stopped")
	}
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if err := stopped(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
}
