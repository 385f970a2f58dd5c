package sqlitedb

import "time"

// NewPace and Found expose the commit watch's pacing to its tests.
func NewPace(fast time.Duration) *pace { return &pace{fast: fast} }

func (p *pace) Found(notified, polled bool) (time.Duration, bool) { return p.found(notified, polled) }

// CheckpointedAt is when s last completed a checkpoint that found the WAL
// all copied.
func CheckpointedAt(s *DB) time.Time {
	s.ckptMu.Lock()
	defer s.ckptMu.Unlock()
	return s.ckptWal.at
}
