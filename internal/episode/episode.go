// Package episode logs a trouble that recurs (a database that stays
// locked, an outbox that cannot be read) once when it starts and once when
// it ends, however often it recurs in between, and remembers its latest
// error for health checks.
package episode

import (
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Log is one kind of trouble. The zero value is not usable: use New.
type Log struct {
	log      *zap.Logger
	level    zapcore.Level // of the down line
	down, up string
	mu       sync.Mutex
	since    time.Time
	last     error
}

// New returns a Log that writes down at level when the trouble starts and
// up at info level, with how long it lasted, when it ends.
func New(log *zap.Logger, level zapcore.Level, down, up string) *Log {
	return &Log{log: log, level: level, down: down, up: up}
}

// Fail records err; the first failure of an episode is logged.
func (s *Log) Fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.last = err
	if s.since.IsZero() {
		s.since = time.Now()
		s.log.Log(s.level, s.down, zap.Error(err))
	}
}

// OK ends the episode, if one is going on, and logs its end.
func (s *Log) OK() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.since.IsZero() {
		s.log.Info(s.up, zap.Duration("after", time.Since(s.since).Round(time.Millisecond)))
		s.since, s.last = time.Time{}, nil
	}
}

// OKUnlessBusy ends an episode that was not the application holding the
// lock (event.ErrBusy): a read answered, so the database is there, but it
// says nothing about the write lock.
func (s *Log) OKUnlessBusy() {
	s.mu.Lock()
	busy := errors.Is(s.last, event.ErrBusy)
	s.mu.Unlock()
	if !busy {
		s.OK()
	}
}

// Err returns the episode's latest error while it lasts, else nil.
func (s *Log) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}
