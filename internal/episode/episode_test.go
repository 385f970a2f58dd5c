package episode

import (
	"errors"
	"fmt"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// TestOneLineEachWay: a trouble that recurs is logged once when it starts
// and once when it ends; Err holds the latest error meanwhile; a lock held
// by the application is not ended by a read that answered.
func TestOneLineEachWay(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	l := New(zap.New(core), zap.WarnLevel, "down", "up")
	first, second := errors.New("first"), fmt.Errorf("second: %w", event.ErrBusy)
	l.Fail(first)
	l.Fail(second)
	if n := logs.FilterMessage("down").Len(); n != 1 {
		t.Fatalf("%d down lines for one episode, want 1", n)
	}
	if !errors.Is(l.Err(), event.ErrBusy) {
		t.Fatalf("Err = %v, want the latest error", l.Err())
	}
	l.OKUnlessBusy()
	if l.Err() == nil || logs.FilterMessage("up").Len() != 0 {
		t.Fatal("a read that answered ended a lock episode")
	}
	l.OK()
	l.OK()
	if l.Err() != nil || logs.FilterMessage("up").Len() != 1 {
		t.Fatalf("after OK: Err %v, %d up lines; want nil and 1", l.Err(), logs.FilterMessage("up").Len())
	}
}
