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
	if len(d.Rounds) != fleetDrainRounds {
		t.Fatalf("drains: %d rounds, want %d", len(d.Rounds), fleetDrainRounds)
	}
	for i, r := range d.Rounds {
		if r.Single.Rows != 400 || r.One.Rows != 400 || r.One.Files != 1 || r.Many.Files != 20 || r.Many.Rows != 20*(400/fleetBusy) {
			t.Errorf("round %d drains: single %+v, one %+v, many %+v", i+1, r.Single, r.One, r.Many)
		}
		if r.Many.DoneMeanSeconds <= 0 || r.ManyMaxOverMean < 1 || r.OneRatio <= 0 || r.ManyRatio <= 0 {
			t.Errorf("round %d drain figures %+v, many %+v", i+1, r, r.Many)
		}
	}
	for name, s := range map[string]Spread{"one file": d.OneRatio, "max / mean": d.ManyMaxOverMean, "many files": d.ManyRatio} {
		if s.Min <= 0 || s.Min > s.Median || s.Median > s.Max {
			t.Errorf("%s: %+v", name, s)
		}
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
		"drains, round 3", "one file of 20", "20 files at once", "time to done, max / mean", "drains, medians of the rounds", "new file, moved in", "new file, created in place", "woken, synchronous=FULL", "fleet peak RSS"} {
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
