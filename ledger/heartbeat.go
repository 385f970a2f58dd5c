package ledger

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"
	"unicode/utf8"

	"go.uber.org/zap"
)

// heartbeatSQL writes now (?1) into the processed_at of the claims still
// held under their tokens (?2: a JSON array of [event_id, handler,
// started_at]); a claim done, released or taken over meanwhile is left
// alone.
const heartbeatSQL = `UPDATE ` + Table + ` SET processed_at = ?1
WHERE status = 'in_progress' AND (event_id, handler, started_at) IN (
	SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]') FROM json_each(?2))`

// heartbeatOneSQL is heartbeatSQL for one claim (?2 event_id, ?3 handler,
// ?4 started_at): for a claim whose event id or handler is not UTF-8,
// which JSON cannot carry as it is (encoding/json writes U+FFFD for the
// bytes it cannot).
const heartbeatOneSQL = `UPDATE ` + Table + ` SET processed_at = ?1
WHERE status = 'in_progress' AND event_id = ?2 AND handler = ?3 AND started_at = ?4`

// heartbeat renews the claims a Ledger holds, so that other processes take
// their holder for alive: a claim whose heartbeat stops (the process was
// killed, or lost the database) is taken over after StaleAfter instead of
// at the end of its lease. One goroutine beats for every claim, in one
// statement; it runs while claims are held and ends at the first beat that
// finds none, so a Ledger needs no Close. A claim younger than one beat is
// fresh from its claim, and costs no write; one older than the lease may
// be taken over anyway, and is no longer beaten (nor kept in memory, if
// its Claim was never marked done or released).
type heartbeat struct {
	log        *zap.Logger
	staleAfter time.Duration
	lease      time.Duration
	every      time.Duration // staleAfter/5

	mu      sync.Mutex
	held    map[*Claim]time.Time // when each was claimed (monotonic)
	running bool
	failing bool // the last beat failed (logged once until one succeeds)
}

func (b *heartbeat) init(log *zap.Logger, staleAfter, lease time.Duration) {
	if log == nil {
		log = zap.NewNop()
	}
	b.log, b.staleAfter, b.lease, b.held = log, staleAfter, lease, map[*Claim]time.Time{}
	b.every = max(staleAfter/5, time.Millisecond)
}

// hold heartbeats c from now on, starting the beat if it is not running.
func (b *heartbeat) hold(l *Ledger, c *Claim) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.held[c] = time.Now()
	if !b.running {
		b.running = true
		go b.run(l)
	}
}

// drop stops heartbeating c.
func (b *heartbeat) drop(c *Claim) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.held, c)
}

// run beats every interval until no claim is held.
func (b *heartbeat) run(l *Ledger) {
	t := time.NewTicker(b.every)
	defer t.Stop()
	for range t.C {
		due, ok := b.due()
		if !ok {
			return
		}
		if len(due) > 0 {
			b.report(b.beat(l, due), len(due))
		}
	}
}

// due returns the claims older than one beat, drops those older than the
// lease, and returns false (marking the beat stopped) when no claim is
// held.
func (b *heartbeat) due() ([][3]any, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.held) == 0 {
		b.running = false
		return nil, false
	}
	var due [][3]any
	for c, since := range b.held {
		switch age := time.Since(since); {
		case age >= b.lease:
			delete(b.held, c)
		case age >= b.every:
			due = append(due, [3]any{c.EventID, c.Handler, c.Token})
		}
	}
	return due, true
}

// beat writes the heartbeat of the claims due. It is bounded by a beat
// interval, so that a database held locked delays the next beat, not
// every later one.
func (b *heartbeat) beat(l *Ledger, due [][3]any) error {
	var asJSON, alone [][3]any
	for _, c := range due {
		if utf8.ValidString(c[0].(string)) && utf8.ValidString(c[1].(string)) {
			asJSON = append(asJSON, c)
		} else {
			alone = append(alone, c)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), max(b.every, time.Second))
	defer cancel()
	now := l.now().UnixMilli()
	if len(asJSON) > 0 {
		js, err := json.Marshal(asJSON)
		if err != nil {
			return fmt.Errorf("encode the claims: %w", err)
		}
		if _, err := l.db.ExecContext(ctx, heartbeatSQL, now, string(js)); err != nil {
			return fmt.Errorf("write the heartbeat: %w", err)
		}
	}
	for _, c := range alone {
		if _, err := l.db.ExecContext(ctx, heartbeatOneSQL, now, c[0], c[1], c[2]); err != nil {
			return fmt.Errorf("write the heartbeat: %w", err)
		}
	}
	return nil
}

// report logs a failed beat once, and the first beat that succeeds after.
func (b *heartbeat) report(err error, claims int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case err != nil && !b.failing:
		b.log.Warn("ledger heartbeat failed; other processes take these claims over once their heartbeat is stale",
			zap.Int("claims", claims), zap.Duration("stale_after", b.staleAfter), zap.Error(err))
	case err == nil && b.failing:
		b.log.Info("ledger heartbeat recovered", zap.Int("claims", claims))
	}
	b.failing = err != nil
}
