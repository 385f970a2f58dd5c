package procs_test

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/procs"
)

// TestGovernorFollowsTheClaims: GOMAXPROCS goes to 1 once no claim has
// found a backlog for the hold, back to the default at the next claim
// that finds one, and to the default when the governor stops.
func TestGovernorFollowsTheClaims(t *testing.T) {
	sets := make(chan bool, 16)
	g := procs.NewWith(func(wide bool) { sets <- wide }, 20*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.Run(ctx, 5*time.Millisecond, zap.NewNop())
	}()
	next := func(what string) bool {
		t.Helper()
		select {
		case wide := <-sets:
			return wide
		case <-time.After(10 * time.Second):
			t.Fatalf("GOMAXPROCS was not set: %s", what)
			return false
		}
	}
	if next("no backlog") || g.Wide() {
		t.Fatal("without a backlog GOMAXPROCS went to the default; want 1")
	}
	g.Backlog()
	if !next("a backlog") || !g.Wide() {
		t.Fatal("after a backlog GOMAXPROCS went to 1; want the default")
	}
	if next("no backlog again") {
		t.Fatal("once the backlog was gone GOMAXPROCS went to the default; want 1")
	}
	cancel()
	<-done
	if !next("stopped") {
		t.Fatal("the governor stopped with GOMAXPROCS at 1; want the default")
	}
	select {
	case wide := <-sets:
		t.Fatalf("GOMAXPROCS set once more (wide %v) after the governor stopped", wide)
	default:
	}
}

// TestNewLeavesAnOperatorsSetting: GOMAXPROCS in the environment is the
// operator's choice; no governor changes it, and the nil governor does
// nothing.
func TestNewLeavesAnOperatorsSetting(t *testing.T) {
	t.Setenv("GOMAXPROCS", "2")
	g := procs.New()
	if g != nil {
		t.Fatal("a governor with GOMAXPROCS set in the environment")
	}
	g.Backlog()
	g.Run(context.Background(), time.Millisecond, zap.NewNop()) // returns at once
	if !g.Wide() {
		t.Error("the nil governor says GOMAXPROCS is 1")
	}
}
