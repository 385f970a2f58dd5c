package claim

import (
	"context"
	"path/filepath"
	"testing"
	"time"
)

// TestBacklogAgesFromWhenRowsBecameDue: a row scheduled for later does not
// age the backlog however old it is, and a due row counts from the later
// of its created_at and available_at, the moment it could first be
// published.
func TestBacklogAgesFromWhenRowsBecameDue(t *testing.T) {
	s := newStore(t)
	db := appDB(t, s.Path())
	now := time.Now()
	ms := func(d time.Duration) int64 { return now.Add(d).UnixMilli() }
	for _, r := range []struct {
		id                 int
		created, available int64
	}{
		{1, ms(-2 * time.Hour), ms(time.Hour)},            // scheduled: not due
		{2, ms(-3 * time.Hour), ms(-5 * time.Minute)},     // retried: due for 5 minutes
		{3, ms(-10 * time.Minute), ms(-20 * time.Minute)}, // due since it was created
		{4, ms(-time.Minute), ms(-time.Minute)},           // just inserted
		{5, ms(-24 * time.Hour), ms(30 * 24 * time.Hour)}, // scheduled far ahead
		{6, ms(-48 * time.Hour), ms(-48*time.Hour) + 100}, // done long ago
	} {
		status := "pending"
		if r.id == 6 {
			status = "done"
		}
		exec1(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, created_at, available_at) VALUES (?, ?, 'T', 'x', ?, ?, ?)`,
			r.id, r.id, status, r.created, r.available)
	}
	b, err := s.Backlog(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if b.Pending != 5 {
		t.Errorf("pending %d, want 5 (scheduled rows are pending too)", b.Pending)
	}
	if want := ms(-10 * time.Minute); b.OldestPending.UnixMilli() != want {
		t.Errorf("oldest pending became due %v (%v ago), want %v: row 3, due for 10 minutes",
			b.OldestPending, now.Sub(b.OldestPending).Round(time.Second), time.UnixMilli(want))
	}

	// Nothing due: no age, however old the scheduled rows are.
	exec1(t, db, `DELETE FROM event_queue WHERE id IN (2, 3, 4)`)
	if b, err = s.Backlog(context.Background()); err != nil || !b.OldestPending.IsZero() || b.Pending != 2 {
		t.Errorf("only scheduled rows: backlog %+v (%v), want 2 pending and no oldest", b, err)
	}
}

// TestBacklogReadsForeignTimes: rows a legacy writer left with a text
// created_at (CURRENT_TIMESTAMP's UTC text), a NULL or meaningless one,
// or an available_at that is NULL or text, never fail the backlog read.
// SQLite's date text counts as the UTC time it names; a created_at that is
// no time counts as available_at and the other way round; a row whose
// available_at is NULL or no time is due (the relay takes it to publish it
// or to dead-letter it).
func TestBacklogReadsForeignTimes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db := appDB(t, path)
	exec1(t, db, `CREATE TABLE event_queue (
	id INTEGER PRIMARY KEY,
	event_id TEXT,
	event_type TEXT NOT NULL,
	payload BLOB NOT NULL,
	status TEXT NOT NULL DEFAULT 'pending',
	attempts INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER,
	claimed_at INTEGER,
	created_at INTEGER,
	processed_at INTEGER,
	last_error TEXT)`)
	now := time.Now()
	ago := now.Add(-time.Minute).UnixMilli()
	ins := `INSERT INTO event_queue (id, event_type, payload, created_at, available_at) VALUES (?, 'T', 'x', ?, ?)`
	exec1(t, db, ins, 1, "2024-05-01 10:00:00", 0)            // due since its creation
	exec1(t, db, ins, 2, nil, nil)                            // due, since when?
	exec1(t, db, ins, 3, nil, ago)                            // created when?
	exec1(t, db, ins, 4, "soon", ago)                         // created when?
	exec1(t, db, ins, 5, 1000, "2024-06-01 00:00:00")         // due since its text time
	exec1(t, db, ins, 6, []byte{0}, ago)                      // created when?
	exec1(t, db, ins, 7, now.Add(time.Hour).UnixMilli(), ago) // due in an hour
	s := openStore(t, path, false)
	b, err := s.Backlog(context.Background())
	if err != nil {
		t.Fatalf("backlog: %v", err)
	}
	want := time.Date(2024, 5, 1, 10, 0, 0, 0, time.UTC)
	if b.Pending != 7 || !b.OldestPending.Equal(want) {
		t.Fatalf("backlog %d pending, oldest due %v; want 7 and %v", b.Pending, b.OldestPending.UTC(), want)
	}

	// Without the text rows, the oldest due rows are those whose created_at
	// is no time, counted from their available_at.
	exec1(t, db, `DELETE FROM event_queue WHERE id IN (1, 5)`)
	if b, err = s.Backlog(context.Background()); err != nil || b.OldestPending.UnixMilli() != now.Add(-time.Minute).UnixMilli() {
		t.Fatalf("backlog %+v (%v), want the oldest due a minute ago", b, err)
	}
}

// TestOneRelayLeads: of the relays heartbeating on one file, the
// longest-running leads; status marks it, and when it leaves the next one
// leads.
func TestOneRelayLeads(t *testing.T) {
	ctx := context.Background()
	first := newStore(t)
	second := openStore(t, first.Path(), false)
	insertRows(t, appDB(t, first.Path()), 3, "pending")
	if rows, err := first.Claim(ctx, 3, 0); err != nil || len(rows) != 3 {
		t.Fatal(rows, err)
	}
	for _, s := range []*Store{first, second, first} {
		if _, err := s.Heartbeat(ctx, "test", time.Hour, time.Minute); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // started_at orders the relays
	}
	if !first.Leads() || second.Leads() {
		t.Fatalf("first leads %v, second leads %v; want the first only", first.Leads(), second.Leads())
	}
	st, err := first.Status(ctx, 1)
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
