package lead

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
)

// processScope returns where a pid names one process: this boot of this
// machine's kernel and this process's pid namespace. Two relays with the
// same scope see the same processes, so one can tell that the other's pid
// is gone; relays in other containers or on other hosts have other scopes.
// It is "" where either is unknown (not Linux), and then nobody is judged
// dead by pid.
func processScope() string {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	ns, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(boot)) + "/" + ns
}

// buryDead removes, in tx, the heartbeat rows of relays in this process's
// scope whose process is gone (killed with -9, say): they are provably
// dead, so a relay restarted on the same host takes over at once instead
// of waiting for their heartbeats to go stale. A pid in use by another
// process keeps its row: the wait for staleness decides then.
func (l *Lease) buryDead(ctx context.Context, tx *sql.Tx) error {
	if l.scope == "" {
		return nil
	}
	rows, err := tx.QueryContext(ctx, `SELECT instance_id, CAST(pid AS INTEGER) FROM `+schema.InstancesTable+`
WHERE process_scope = ?1 AND instance_id <> ?2`, l.scope, l.instance)
	if err != nil {
		return fmt.Errorf("look for dead relays: %w", err)
	}
	var dead []string
	for rows.Next() {
		var id string
		var pid sql.NullInt64
		if err := rows.Scan(&id, &pid); err != nil {
			rows.Close()
			return fmt.Errorf("look for dead relays: %w", err)
		}
		if pid.Valid && gone(int(pid.Int64)) {
			dead = append(dead, id)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("look for dead relays: %w", err)
	}
	for _, id := range dead {
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = ?`, id); err != nil {
			return fmt.Errorf("remove a dead relay's heartbeat: %w", err)
		}
	}
	return nil
}

// gone reports whether no process has this pid (in this pid namespace).
func gone(pid int) bool {
	if pid <= 0 {
		return false
	}
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// sighting is a heartbeat value another relay wrote, as this relay read
// it, and since when this relay has read that same value, on its own
// monotonic clock.
type sighting struct {
	at    string // heartbeat_at as SQL text (quote): whatever its type
	since time.Time
}

// buryStale removes, in tx, the heartbeat rows of other relays that have
// not heartbeated for staleAfter, as far as this relay has seen: their
// heartbeat_at has not changed in that long on this relay's monotonic
// clock. Neither relay's wall clock decides, so a clock stepped back
// (NTP, a restored VM snapshot) neither hides a dead relay for the size
// of the step nor, stepped forward, makes a live one look dead. With
// judge false it only notes what it read.
func (l *Lease) buryStale(ctx context.Context, tx *sql.Tx, staleAfter time.Duration, judge bool) error {
	// Another implementation may write heartbeat_at as REAL or TEXT:
	// compared as SQL text, any change counts.
	rows, err := tx.QueryContext(ctx, `SELECT instance_id, quote(heartbeat_at) FROM `+schema.InstancesTable+` WHERE instance_id <> ?`, l.instance)
	if err != nil {
		return fmt.Errorf("read the heartbeats: %w", err)
	}
	now := time.Now()
	seen := make(map[string]sighting, len(l.seen))
	var stale []string
	for rows.Next() {
		var id, at string
		if err := rows.Scan(&id, &at); err != nil {
			rows.Close()
			return fmt.Errorf("read the heartbeats: %w", err)
		}
		s, ok := l.seen[id]
		if !ok || s.at != at {
			s = sighting{at: at, since: now}
		}
		seen[id] = s
		if judge && now.Sub(s.since) >= staleAfter {
			stale = append(stale, id)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read the heartbeats: %w", err)
	}
	l.seen = seen // relays gone meanwhile are forgotten
	for _, id := range stale {
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+schema.InstancesTable+` WHERE instance_id = ? AND quote(heartbeat_at) = ?`, id, seen[id].at); err != nil {
			return fmt.Errorf("remove a stale relay's heartbeat: %w", err)
		}
	}
	return nil
}
