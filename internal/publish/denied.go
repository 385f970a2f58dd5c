package publish

import "time"

// deniedSince reports whether the server refused, at or after sent, to let
// this connection publish to subject. The server reports a permission
// violation only to the connection's error handler, after it read the
// message, and the publish itself then times out: a timeout of a message
// sent at sent on a subject denied since is that message's refusal. A
// denial before sent says nothing of the message (the permission may have
// been granted since), so it is sent and tried like any other.
func (c *Conn) deniedSince(subject string, sent time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.denied[subject]
	return ok && !at.Before(sent)
}

// stored forgets a denial of subject older than a message sent at sent
// that the stream stored: the permission was granted since, and /readyz
// stops naming the subject at once.
func (c *Conn) stored(subject string, sent time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if at, ok := c.denied[subject]; ok && at.Before(sent) {
		delete(c.denied, subject)
	}
}
