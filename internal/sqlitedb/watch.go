package sqlitedb

import (
	"cmp"
	"context"
	"fmt"
	"time"
)

// Watch sends on every channel of any (without blocking: signals coalesce)
// whenever another connection (the application, or this process's own
// writer) has committed to the database, and on foreign when a connection
// other than this DB's writer has: an idle relay's own heartbeats then do
// not make it look for rows. PRAGMA data_version on the writer's
// connection, which this DB's own commits leave unchanged, tells the two
// apart; a look at it that fails counts as foreign. What a look reads is
// the WAL index header in the -shm file, which every commit changes (or,
// where it cannot be read, PRAGMA data_version on one pinned read-only
// connection, which changes with every other connection's commit); what
// makes Watch look is a file-system
// notification on the database's -wal file, which every commit writes
// (walWatch: other files in the directory send it nothing; or, with
// Options.Notifications, another watch's notifications of that file), and, as a
// fallback where notifications do not work, a poll every interval. Once a notification
// has announced a change, notifications are trusted and the poll slows to
// ten times interval; a change that only the poll found makes it fast
// again. Idle, it costs nothing but that poll; no snapshot is held between
// looks, so checkpoints are never starved. A notification waits for the
// commits behind it in a flow of commits, which then share one look and
// one claim, and with Options.GatherCommitWrites for the rest of its
// commit's writes (gather). It returns when ctx ends; the caller runs it
// in a goroutine it tracks.
func (s *DB) Watch(ctx context.Context, interval time.Duration, foreign chan<- struct{}, any ...chan<- struct{}) error {
	conn, err := s.read.Conn(ctx)
	if err != nil {
		return fmt.Errorf("watch commits: %w", err)
	}
	defer conn.Close()
	stmt, err := conn.PrepareContext(ctx, `PRAGMA data_version`)
	if err != nil {
		return fmt.Errorf("watch commits: %w", err)
	}
	defer stmt.Close()
	// Not cancellable: go-sqlite3 then skips its interrupt bookkeeping, the
	// larger part of a query this small; the loop checks ctx itself.
	quick := context.WithoutCancel(ctx)
	version := func() (v int64, err error) {
		err = stmt.QueryRowContext(quick).Scan(&v)
		return v, err
	}
	// What a look compares: the WAL index header, read from the -shm file,
	// which every commit changes; PRAGMA data_version where it cannot be
	// read. settled is false while a commit writes the header.
	idx := s.index()
	type seen struct {
		header  [walIndexHeaders / 2]byte
		version int64
	}
	look := func() (v seen, settled bool, err error) {
		if idx != nil {
			if v.header, settled, err = idx.header(); err == nil {
				return v, settled, nil
			}
		}
		v.version, err = version()
		return v, true, err
	}
	// Watching before the first look: a commit in between is not missed.
	ww := newWalWatch(s.path, &s.watchSeen, s.notifications)
	defer ww.close()
	events, errs := ww.events(), ww.errs()
	last, _, err := look()
	if err != nil {
		return fmt.Errorf("watch commits: %w", err)
	}
	// The writer's own view: it changes only with others' commits. It
	// waits for the writer's connection (a write under way, held up by
	// the application's lock): cancellable, so that shutdown does not.
	writerVersion := func() (v int64, err error) {
		err = s.write.QueryRowContext(ctx, `PRAGMA data_version`).Scan(&v)
		return v, err
	}
	lastWriter, writerErr := writerVersion()
	t := time.NewTicker(interval)
	defer t.Stop()
	poll := pace{fast: interval}
	// A notified look that finds no commit looks again shortly: with
	// synchronous=FULL a commit writes the WAL, syncs it, and only then
	// becomes visible (through the -shm file, which sends no notification).
	again := time.NewTimer(time.Hour)
	again.Stop()
	defer again.Stop()
	var retry time.Duration
	var found time.Time // when the last commit of another connection found was noticed
	for {
		polled, notified, recheck, flow := false, false, false, false
		var noticed time.Time // of the notification this look follows
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			polled = true
			if !ww.armed() {
				ww.arm() // the -wal file may be back without a notification
			}
		case <-again.C:
			notified, recheck = true, true
		case <-errs: // an overflowed queue: the version check below catches up
		case ev, ok := <-events:
			if !ok {
				events = nil // notifications stopped; the poll goes on, fast
				poll.trusted = false
				t.Reset(interval)
				continue
			}
			if !ww.commit(ev) {
				continue
			}
			notified, noticed = true, time.Now()
			// One commit writes the WAL in several writes, which arrive as
			// several events, and in a flow of commits more follow: let
			// them come, then look once for all.
			wait := gather(noticed.Sub(found), s.gatherWrites)
			if flow = wait == flowWindow; wait > 0 {
				time.Sleep(wait)
			}
			for drained := false; !drained; {
				select {
				case ev, ok := <-events:
					if drained = !ok; ok {
						ww.commit(ev) // counted, and followed if it moved the -wal file
					}
				default:
					drained = true
				}
			}
		}
		v, settled, err := look()
		if err != nil || !settled || v == last {
			if (notified || !settled) && err == nil {
				var reset bool
				if retry, reset = recheckAfter(retry, recheck); reset {
					again.Reset(retry)
				}
			}
			continue // a failed look only delays a wake-up; the claim timer is the fallback
		}
		last = v
		retry = 0
		again.Stop()
		if flow {
			// A commit gathered in the window may not be visible yet (with
			// synchronous=FULL it syncs the WAL first), and its
			// notifications are spent: look again as for a notification
			// that found nothing. In a steady flow the next notification
			// comes first and this look moves on with it.
			again.Reset(flowWindow)
		}
		if next, change := poll.found(notified, polled); change {
			t.Reset(next)
		}
		wv, err := writerVersion()
		if err != nil || writerErr != nil || wv != lastWriter {
			found = cmp.Or(noticed, time.Now())
			signalOne(foreign)
		}
		lastWriter, writerErr = wv, err
		for _, w := range any {
			signalOne(w)
		}
	}
}

// signalOne sends on w without blocking (a nil w is none).
func signalOne(w chan<- struct{}) {
	if w == nil {
		return
	}
	select {
	case w <- struct{}{}:
	default:
	}
}

// gather returns how long a notification waits for the notifications
// behind it before Watch looks, given the time since the notification of
// the last commit found of another connection than the writer's (the
// application's), and whether it waits for a lone commit's own writes.
// In a flow of such commits (the last noticed less than flowGap before),
// it waits for the commits that follow within flowWindow, which then
// share one look and one claim: at 1,000 single-row commits a second that
// saves the relay about a quarter of its CPU, for flowWindow more from
// commit to PubAck (docs/performance.md). Commits further apart would not
// arrive within the window. A lone commit's notification waits
// commitWrites for the rest of its commit's writes when commitOwn
// (Options.GatherCommitWrites), else not at all: a relay alone on its
// file goes idle in that wait, and the wake-up after it cost a tenth of
// its CPU at 100 commits a second; a look that comes before its commit
// shows looks again, as for any notification that found nothing. In a
// fleet the other files' work keeps the process busy through the wait,
// and looking at once cost it more CPU than it saved (docs/performance.md).
func gather(sinceFound time.Duration, commitOwn bool) time.Duration {
	switch {
	case sinceFound < flowGap:
		return flowWindow
	case commitOwn:
		return commitWrites
	}
	return 0
}

const (
	commitWrites = 200 * time.Microsecond
	flowWindow   = 2 * time.Millisecond
	flowGap      = 3 * time.Millisecond
)

// recheckAfter returns the wait before the next look after a notified
// look that found no commit, given the wait pending (0: none) and whether
// this look was that recheck, and whether to set it: 1, 2, 4 ... ms up to
// maxRecheck, then none (0: a WAL write that made no commit visible; the
// poll remains). A pending recheck stays as it is: the notifications of
// the commit's other WAL writes, each looked at before the commit shows,
// do not put it off.
func recheckAfter(pending time.Duration, recheck bool) (time.Duration, bool) {
	if pending > 0 && !recheck {
		return pending, false
	}
	if next := max(2*pending, time.Millisecond); next <= maxRecheck {
		return next, true
	}
	return 0, false
}

// maxRecheck is the longest wait between the looks that follow a
// notification whose commit is not visible yet (1, 2, 4, ... ms): a WAL
// sync takes a few milliseconds.
const maxRecheck = 64 * time.Millisecond

// pace is the fallback poll's period: fast until a notification has
// announced a commit, ten times slower while notifications are trusted,
// and fast again once the poll finds a commit that no notification
// announced.
type pace struct {
	fast    time.Duration
	trusted bool
}

// found records how a commit was found and returns the poll's new period
// when it changes.
func (p *pace) found(notified, polled bool) (next time.Duration, change bool) {
	switch {
	case notified && !p.trusted:
		p.trusted = true
		return 10 * p.fast, true
	case polled && p.trusted:
		p.trusted = false
		return p.fast, true
	}
	return 0, false
}
