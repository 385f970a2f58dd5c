package housekeeping

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
)

// countingStore counts checkpoints and has an empty backlog.
type countingStore struct{ checkpoints chan struct{} }

func (countingStore) Backlog(context.Context) (event.Backlog, error) { return event.Backlog{}, nil }
func (countingStore) Prune(context.Context, string, time.Time, time.Duration, Sweep) (Swept, error) {
	return Swept{}, nil
}
func (countingStore) Span(context.Context) (int64, error) { return 0, nil }
func (s countingStore) Checkpoint(context.Context) (int, int, error) {
	s.checkpoints <- struct{}{}
	return 0, 0, nil
}

// runCheckpoints runs a Keeper that checkpoints at most every
// millisecond, with commits announced on the returned channel (watching)
// or none (not watching); stop ends it.
func runCheckpoints(t *testing.T, watching bool) (commits chan struct{}, checkpoints chan struct{}, stop func()) {
	t.Helper()
	commits, checkpoints = make(chan struct{}), make(chan struct{}, 100)
	k := New(countingStore{checkpoints}, Options{CheckpointInterval: time.Millisecond, Commits: commits, Watching: func() bool { return watching }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); k.Run(ctx) }()
	return commits, checkpoints, func() { cancel(); <-done }
}

// TestCheckpointsFollowCommits: every commit announced is followed by a
// checkpoint, without waiting for the idle look.
func TestCheckpointsFollowCommits(t *testing.T) {
	commits, checkpoints, stop := runCheckpoints(t, true)
	defer stop()
	start := time.Now()
	const n = 5
	for i := 0; i < n; i++ {
		commits <- struct{}{}
		<-checkpoints
	}
	// The idle look alone would have taken at least n-1 of its periods.
	if took := time.Since(start); took >= (n-1)*checkpointIdle {
		t.Errorf("%d commits took %v to be checkpointed; checkpoints do not follow commits", n, took)
	}
}

// TestFirstCheckpointWaits: a relay's first checkpoint comes
// checkpointFirst after its start, however soon a commit comes: a start's
// own commits share it, and files woken together publish before they sync.
func TestFirstCheckpointWaits(t *testing.T) {
	start := time.Now()
	commits, checkpoints, stop := runCheckpoints(t, true)
	defer stop()
	commits <- struct{}{}
	<-checkpoints
	if took := time.Since(start); took < checkpointFirst {
		t.Fatalf("the first checkpoint came %v after the start; want %v or later", took, checkpointFirst)
	}
}

// TestIdleRelayCheckpointsSeldom: while the relay claims no rows its
// commits (heartbeats) make no checkpoint until checkpointIdleGap has
// passed; a claim ends the wait at the next commit.
func TestIdleRelayCheckpointsSeldom(t *testing.T) {
	var claimed atomic.Int64 // Unix ns; 0: never
	commits, checkpoints := make(chan struct{}), make(chan struct{}, 100)
	k := New(countingStore{checkpoints}, Options{CheckpointInterval: time.Millisecond, Commits: commits,
		LastClaim: func() time.Time {
			if ns := claimed.Load(); ns != 0 {
				return time.Unix(0, ns)
			}
			return time.Time{}
		}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); k.Run(ctx) }()
	defer func() { cancel(); <-done }()

	commits <- struct{}{}
	<-checkpoints // the first, after the relay's start
	commits <- struct{}{}
	<-checkpoints // the one that finds no claim since the first
	for range 20 {
		commits <- struct{}{} // heartbeats
		time.Sleep(5 * time.Millisecond)
	}
	if n := len(checkpoints); n > 0 {
		t.Fatalf("%d checkpoints followed the heartbeats of a relay that claims nothing; want none before %v", n, checkpointIdleGap)
	}
	start := time.Now()
	claimed.Store(start.UnixNano())
	commits <- struct{}{} // ends the wait
	commits <- struct{}{} // makes the checkpoint
	<-checkpoints
	if took := time.Since(start); took >= checkpointIdleGap/2 {
		t.Errorf("the checkpoint after a claim took %v; the claim did not end the idle wait", took)
	}
}

// TestCheckpointsWithoutWatch: with no commit watch (none configured, or
// it stopped), checkpoints are polled for, not left to the idle look.
func TestCheckpointsWithoutWatch(t *testing.T) {
	_, checkpoints, stop := runCheckpoints(t, false)
	defer stop()
	start := time.Now()
	const looks = 3
	for i := 0; i < looks; i++ {
		<-checkpoints
	}
	if took := time.Since(start); took >= looks*checkpointIdle {
		t.Errorf("%d checkpoints took %v without a watch; want one every %v", looks, took, checkpointPoll)
	}
}

// TestCheckpointGap: small checkpoints space the next ones out, up to
// checkpointMaxGap; a large one brings them back towards the least gap.
func TestCheckpointGap(t *testing.T) {
	least := 2 * time.Millisecond
	gap := least
	for range 20 {
		gap = checkpointGap(gap, 10, least)
	}
	if gap != checkpointMaxGap {
		t.Fatalf("after small checkpoints the gap is %v, want %v", gap, checkpointMaxGap)
	}
	for range 20 {
		gap = checkpointGap(gap, 5000, least)
	}
	if gap != least {
		t.Fatalf("after large checkpoints the gap is %v, want %v", gap, least)
	}
	if got := checkpointGap(least, 0, time.Second); got != time.Second {
		t.Fatalf("the gap %v is below the least %v", got, time.Second)
	}
}

// TestCheckpointGapFollowsNewPages: a WAL that does not start again (a
// reader is often in it) stays long while each checkpoint finds only a
// commit or two to copy: the gap grows as for a short WAL, and a WAL that
// started again counts whole.
func TestCheckpointGapFollowsNewPages(t *testing.T) {
	least := 2 * time.Millisecond
	gap, copied := least, 0
	for wal := 500; wal < 700; wal += 10 { // ten pages a checkpoint, in a WAL of 500 and more
		gap = checkpointGap(gap, newPages(wal, copied), least)
		copied = wal
	}
	if gap != checkpointMaxGap {
		t.Fatalf("after checkpoints of ten new pages each the gap is %v, want %v", gap, checkpointMaxGap)
	}
	if got := newPages(150, 690); got != 150 {
		t.Fatalf("a WAL started again since the last checkpoint: %d new pages, want all 150", got)
	}
	if got := newPages(400, 390); got != 10 {
		t.Fatalf("%d new pages, want 10", got)
	}
}

// TestRefreshBacklog: one pass sets the backlog gauges from the store.
func TestRefreshBacklog(t *testing.T) {
	m := metrics.New("", "")
	k := New(backlogStore{event.Backlog{Pending: 4, Processing: 1, DeadLettered: 2, OldestPending: time.Now().Add(-time.Minute), ParkedKeys: 3}}, Options{Metrics: m})
	if err := k.RefreshBacklog(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p, d := metrics.Value(m.Backlog.WithLabelValues("pending")), metrics.Value(m.Backlog.WithLabelValues("dead_lettered")); p != 4 || d != 2 {
		t.Fatalf("backlog gauges pending %v, dead_lettered %v; want 4 and 2", p, d)
	}
	if age := metrics.Value(m.OldestPendingAge); age < 59 {
		t.Fatalf("oldest pending age %v s, want about 60", age)
	}
	if n := metrics.Value(m.ParkedKeys); n != 3 {
		t.Fatalf("parked keys gauge %v, want 3", n)
	}
}

// backlogStore reports a fixed backlog.
type backlogStore struct{ b event.Backlog }

func (s backlogStore) Backlog(context.Context) (event.Backlog, error) { return s.b, nil }
func (backlogStore) Prune(context.Context, string, time.Time, time.Duration, Sweep) (Swept, error) {
	return Swept{}, nil
}
func (backlogStore) Span(context.Context) (int64, error)          { return 0, nil }
func (backlogStore) Checkpoint(context.Context) (int, int, error) { return 0, 0, nil }

// sweepStore records each sweep, says the next one starts a row later,
// and that the outbox's sweeps beyond its new rows deleted found rows.
type sweepStore struct {
	backlogStore
	sweeps chan sweep
	found  int64
}

type sweep struct {
	table string
	Sweep
	at time.Time
}

func (s sweepStore) Prune(_ context.Context, table string, _ time.Time, _ time.Duration, sw Sweep) (Swept, error) {
	s.sweeps <- sweep{table, sw, time.Now()}
	if table == event.PruneOutbox && !sw.New {
		return Swept{Deleted: s.found, Next: sw.From + 1, Read: 1}, nil
	}
	return Swept{Next: sw.From + 1, Read: 1}, nil
}

// TestRetentionGoesOnFromSweeps: a Keeper given where a file's retention
// stands (a fleet's file opened again) makes its first pass a
// RetentionInterval after the last one began, not at once, goes on from
// where each table's sweep stopped, and leaves the next Keeper where its
// own stopped. Without them, the first pass comes at once, from the start.
// The outbox's first sweep starts at the table's start, to its new rows;
// the second, beyond them, goes twice as far as the pass before while it
// finds rows to delete, and pruneBeyond rows while it finds none.
func TestRetentionGoesOnFromSweeps(t *testing.T) {
	const interval = 300 * time.Millisecond
	run := func(sw *Sweeps, found int64, passes int) []sweep {
		t.Helper()
		st := sweepStore{sweeps: make(chan sweep, 100), found: found}
		k := New(st, Options{RetentionInterval: interval, RetainDone: time.Hour, RetainProcessedEvents: time.Hour, Sweeps: sw})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); k.Run(ctx) }()
		var got []sweep
		for range passes * 4 { // the outbox's two sweeps, and one of each other table, a pass
			got = append(got, <-st.sweeps)
		}
		cancel()
		<-done
		return got
	}
	start := time.Now()
	fresh := run(nil, 0, 1)
	if f := fresh[0]; f.table != event.PruneOutbox || !f.New || f.From != 0 || fresh[1].New || fresh[1].From != 0 || fresh[1].Rows != pruneBeyond {
		t.Fatalf("a Keeper of its own swept %+v; want the outbox from its start to its new rows, then from its start %d rows", fresh, pruneBeyond)
	}
	last := time.Now().Add(-interval / 3)
	sw := &Sweeps{Last: last, From: map[string]int64{event.PruneOutbox: 41}, Beyond: 7}
	got := run(sw, 1, 2)
	if early := last.Add(interval); got[0].at.Before(early) {
		t.Fatalf("first pass at %v, before a RetentionInterval after the last one (%v)", got[0].at.Sub(start), early.Sub(start))
	}
	if got[0].From != 41 || !got[0].New || got[1].From != 7 || got[4].From != 42 || got[5].From != 8 || got[5].Rows != 2*pruneBeyond {
		t.Fatalf("sweeps %+v; want the outbox's new rows from row 41, and beyond them from row 7, then from 42 and from 8, twice as far", got)
	}
	if sw.From[event.PruneOutbox] != 43 || sw.Beyond != 9 || sw.Rows != 4*pruneBeyond || !sw.Last.After(last) {
		t.Fatalf("sweeps left at %+v; want the outbox's next sweeps from 43 and from 9, %d rows, and the last pass's start", *sw, 4*pruneBeyond)
	}
	if quiet := run(&Sweeps{Rows: 4 * pruneBeyond}, 0, 2); quiet[1].Rows != 4*pruneBeyond || quiet[5].Rows != 2*pruneBeyond {
		t.Fatalf("sweeps %+v; want half as far after a pass that found nothing", quiet)
	}
}

// TestBeyondRowsGoThroughTheTableInHalfTheRetention: the sweep beyond the
// outbox's new rows goes through at least enough rows a pass to go
// through the whole table in half the retention at a pass every
// RetentionInterval, or as long as it was since the last pass if longer;
// at least pruneBeyond and at most pruneBudget, and as many as the last
// pass said if more. The table holds as many rows as its span at most,
// and as many as the density the sweep's last whole round found, or as
// the round under way went through, if fewer: the table's growth since
// counts.
func TestBeyondRowsGoThroughTheTableInHalfTheRetention(t *testing.T) {
	week := 7 * 24 * time.Hour
	k := New(backlogStore{}, Options{RetentionInterval: time.Minute})
	for _, c := range []struct {
		span, last, round int64
		density           float64
		gap               time.Duration
		want              int
	}{
		{0, 0, 0, 0, time.Minute, pruneBeyond}, {6_048_000, 0, 0, 0, time.Minute, 1200}, {6_048_000, 5000, 0, 0, time.Minute, 5000},
		{1 << 40, 0, 0, 0, time.Minute, pruneBudget}, {0, 1 << 30, 0, 0, time.Minute, pruneBudget},
		{6_048_000, 0, 0, 0, 10 * time.Minute, 12_000}, {6_048_000, 0, 0, 0, time.Second, 1200},
		{6_048_000 << 20, 0, 0, 1.0 / (1 << 20), time.Minute, 1200}, {6_048_000 << 20, 0, 12_096_000, 1.0 / (1 << 20), time.Minute, 2400},
		{12_096_000, 0, 0, 1, time.Minute, 2400}, {6_048_000, 0, 0, 0.5, time.Minute, pruneBeyond},
	} {
		k.o.Sweeps.Rows, k.o.Sweeps.Round, k.o.Sweeps.Density = int(c.last), c.round, c.density
		if got := k.beyondRows(c.span, week, c.gap); got != c.want {
			t.Errorf("a table spanning %d rows, the last pass saying %d, %d rows of this round, density %g, a pass %v after the last: %d rows, want %d", c.span, c.last, c.round, c.density, c.gap, got, c.want)
		}
	}
}
