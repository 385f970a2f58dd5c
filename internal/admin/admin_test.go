package admin

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/claim"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestOneRelayLeads: of the relays heartbeating on one file, the
// longest-running leads; status marks it, and when it leaves the next one
// leads.
func TestOneRelayLeads(t *testing.T) {
	ctx := context.Background()
	db := testenv.MigratedDB(t)
	first, second := claim.New(db, claim.Options{}), claim.New(testenv.OpenDB(t, db.Path()), claim.Options{})
	testenv.InsertRows(t, testenv.AppDB(t, db.Path()), 3, "pending")
	if rows, err := first.Claim(ctx, 3, 0); err != nil || len(rows) != 3 {
		t.Fatal(rows, err)
	}
	for _, s := range []*claim.Store{first, second, first} {
		if _, err := s.Heartbeat(ctx, "test", time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // started_at orders the relays
	}
	if !first.Leads() || second.Leads() {
		t.Fatalf("first leads %v, second leads %v; want the first only", first.Leads(), second.Leads())
	}
	st, err := ReadStatus(ctx, db, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Relays) != 2 || !st.Relays[0].Leader || st.Relays[0].ID != first.Instance() || st.Relays[1].Leader {
		t.Fatalf("status relays %+v; want the first marked leader", st.Relays)
	}
	if st.Relays[0].InFlight != 3 || st.Relays[1].InFlight != 0 {
		t.Fatalf("status relays %+v; want 3 rows in flight at the leader", st.Relays)
	}
	if err := first.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := second.Heartbeat(ctx, "test", time.Hour, time.Minute); err != nil || !second.Leads() {
		t.Fatalf("after the leader left, the second leads %v (%v)", second.Leads(), err)
	}
}
