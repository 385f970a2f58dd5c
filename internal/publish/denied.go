package publish

import (
	"regexp"
	"sort"
	"time"

	"go.uber.org/zap"
)

// The server reports a publish it refuses for lack of permission only to
// the connection's error handler, after it read the message, and the
// publish itself then times out. The Conn remembers when each subject was
// last refused, and wakes the acknowledgements waiting on a subject when it
// is refused again, so that a refusal is known in about a round trip
// instead of after relay.ack_timeout.

var deniedSubjectRe = regexp.MustCompile(`(?i)permissions violation for publish to "([^"]+)"`)

// deniedTTL is how long a permission violation is remembered for /readyz
// when no message on the subject is stored since.
const deniedTTL = time.Minute

// asyncError handles errors the server reports outside any call; a publish
// permission violation is only ever reported here. It is logged once per
// subject (again only after it was forgotten).
func (c *Conn) asyncError(err error) {
	if m := deniedSubjectRe.FindStringSubmatch(err.Error()); m != nil {
		c.mu.Lock()
		at, seen := c.denied[m[1]]
		c.denied[m[1]] = time.Now()
		if ch, ok := c.refusal[m[1]]; ok {
			close(ch)
			delete(c.refusal, m[1])
		}
		c.mu.Unlock()
		if !seen || time.Since(at) > deniedTTL {
			c.log.Error("nats permission denied: rows on this subject are rejected until the permission is granted",
				zap.String("subject", m[1]), zap.Error(err))
		}
		return
	}
	c.log.Warn("nats error", zap.Error(err))
}

// closed is a channel that is ready at once.
var closed = func() chan struct{} { ch := make(chan struct{}); close(ch); return ch }()

// refused returns a channel that is closed when the server refuses subject
// to this connection, at once when it did so at or after sent (a message
// sent at sent may be the one refused).
func (c *Conn) refused(subject string, sent time.Time) <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.deniedSinceLocked(subject, sent) {
		return closed
	}
	ch, ok := c.refusal[subject]
	if !ok {
		ch = make(chan struct{})
		c.refusal[subject] = ch
	}
	return ch
}

// stored records that the stream stored a message on subject sent at
// sent: a denial of the subject older than that is over (the permission
// was granted since), so /readyz stops naming the subject, and the grant
// is logged once. The denial's time is kept: a message sent before it may
// still be waiting for its answer.
func (c *Conn) stored(subject string, sent time.Time) {
	c.mu.Lock()
	at, denied := c.denied[subject]
	granted := denied && at.Before(sent) && !c.lastStored[subject].After(at)
	if sent.After(c.lastStored[subject]) {
		c.lastStored[subject] = sent
	}
	c.mu.Unlock()
	if granted && !c.closing.Load() {
		c.log.Info("nats permission granted: rows on this subject are published again", zap.String("subject", subject))
	}
}

// refusedAt returns when the server last refused subject (zero: never).
func (c *Conn) refusedAt(subject string) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.denied[subject]
}

// DeniedSubjects lists the subjects the server refused within deniedTTL
// and has stored no message on since.
func (c *Conn) DeniedSubjects() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]string, 0, len(c.denied))
	for s, at := range c.denied {
		if time.Since(at) < deniedTTL && !c.lastStored[s].After(at) {
			out = append(out, s)
		}
	}
	sort.Strings(out)
	return out
}

// deniedSince reports whether the server refused subject at or after sent:
// a message sent at sent that timed out since is that refusal.
func (c *Conn) deniedSince(subject string, sent time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.deniedSinceLocked(subject, sent)
}

func (c *Conn) deniedSinceLocked(subject string, sent time.Time) bool {
	at, ok := c.denied[subject]
	return ok && !at.Before(sent)
}
