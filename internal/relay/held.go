package relay

// Subjects the stream refuses one by one: each holds the stream's
// max_msgs_per_subject and the stream discards new messages per subject.
// Their rows wait, spending no attempt, while the other subjects go.

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// heldSubjects tracks the subjects the stream refuses (publish.ErrSubjectFull).
type heldSubjects struct {
	any  atomic.Bool // a subject is held: stored results are looked up
	mu   sync.Mutex
	held map[string]*heldSubject
}

type heldSubject struct {
	since time.Time
	err   error
	until time.Time // past it without a refusal, the hold ends (see holdGrace)
}

// holdGrace is how long after its rows were due again a hold lasts
// without a refusal: its rows are gone (deleted, dead-lettered by an
// operator), or their subject no longer at its limit.
const holdGrace = 5 * time.Second

// hold records a refusal of subject and returns how long its row waits:
// as long as the subject has been held, from 1 s up to maxDefer, so that
// every row refused in one round comes back together.
func (h *heldSubjects) hold(subject string, err error, log *zap.Logger) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.expire()
	s := h.held[subject]
	if s == nil {
		if h.held == nil {
			h.held = map[string]*heldSubject{}
		}
		s = &heldSubject{since: time.Now()}
		h.held[subject] = s
		h.any.Store(true)
		log.Warn("the stream refuses a subject at its max_msgs_per_subject; its rows wait without spending attempts",
			zap.String("subject", subject), zap.Error(err))
	}
	s.err = err
	wait := min(max(time.Second, time.Since(s.since)), maxDefer)
	s.until = time.Now().Add(wait + holdGrace)
	return wait
}

// stored ends the hold of subject, if any: the stream took a message of it.
func (h *heldSubjects) stored(subject string, log *zap.Logger) {
	if !h.any.Load() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.held[subject]
	if s == nil {
		return
	}
	delete(h.held, subject)
	h.any.Store(len(h.held) > 0)
	log.Info("the stream takes the subject again", zap.String("subject", subject), zap.Duration("held", time.Since(s.since).Round(time.Millisecond)))
}

// expire ends the holds past their time without a refusal. Called with
// h.mu held.
func (h *heldSubjects) expire() {
	now := time.Now()
	for subject, s := range h.held {
		if now.After(s.until) {
			delete(h.held, subject)
		}
	}
	h.any.Store(len(h.held) > 0)
}

// err names the subjects held and why, for /readyz; nil when none is.
func (h *heldSubjects) err() error {
	if !h.any.Load() {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.expire()
	subjects := make([]string, 0, len(h.held))
	for subject := range h.held {
		subjects = append(subjects, subject)
	}
	if len(subjects) == 0 {
		return nil
	}
	sort.Strings(subjects)
	s := h.held[subjects[0]]
	why := fmt.Sprintf("%d subjects held", len(subjects))
	if len(subjects) == 1 {
		why = "1 subject held"
	}
	return errors.New(why + " for " + time.Since(s.since).Round(time.Second).String() + " (" + strings.Join(subjects, ", ") + "): " + s.err.Error())
}
