package claim

import (
	"context"
	"fmt"
	"time"
)

// Watch sends on wake (without blocking: signals coalesce) whenever another
// connection (the application, or this process's own writer) has committed
// to the database. It polls PRAGMA data_version on one pinned read-only
// connection every interval: a few microseconds each, and no snapshot is
// held between polls, so checkpoints are never starved. It returns when ctx
// ends; the caller runs it in a goroutine it tracks.
func (s *Store) Watch(ctx context.Context, interval time.Duration, wake chan<- struct{}) error {
	conn, err := s.read.Conn(ctx)
	if err != nil {
		return fmt.Errorf("watch commits: %w", err)
	}
	defer conn.Close()
	version := func() (v int64, err error) {
		err = conn.QueryRowContext(ctx, `PRAGMA data_version`).Scan(&v)
		return v, err
	}
	last, err := version()
	if err != nil {
		return fmt.Errorf("watch commits: %w", err)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		v, err := version()
		if err != nil || v == last {
			continue // a failed poll only delays a wake-up; the poll timer is the fallback
		}
		last = v
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}
