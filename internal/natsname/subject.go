package natsname

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxSubjectLen bounds a published subject. NATS itself only limits the
// whole protocol line (4 KiB by default, after which the server closes the
// connection), so the relay refuses absurd event types itself.
const MaxSubjectLen = 255

// Subject returns the NATS subject for an event type under prefix, or an
// error saying why the event type cannot form a valid subject.
func Subject(prefix, eventType string) (string, error) {
	return Subjects{Prefix: prefix}.Of(eventType)
}

// ValidateSubjectPart reports why s (one or more dot-separated tokens) is not
// usable in a published subject: empty, an empty token, whitespace, control
// characters, wildcards or invalid UTF-8.
func ValidateSubjectPart(s string) error {
	if s == "" {
		return fmt.Errorf("it is empty")
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("it is not valid UTF-8")
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" {
			return fmt.Errorf("it has an empty token (leading, trailing or double dot)")
		}
	}
	for _, c := range s {
		switch {
		case c == '*' || c == '>':
			return fmt.Errorf("it contains the wildcard %q", c)
		case unicode.IsSpace(c):
			return fmt.Errorf("it contains whitespace")
		case unicode.IsControl(c):
			return fmt.Errorf("it contains a control character")
		}
	}
	return nil
}

// ValidateFilter checks a stream subject, where wildcards are allowed: '*'
// as a whole token, '>' as the whole last token.
func ValidateFilter(s string) error {
	if s == "" {
		return fmt.Errorf("empty subject")
	}
	toks := strings.Split(s, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return fmt.Errorf("empty token")
		case t == ">" && i != len(toks)-1:
			return fmt.Errorf("'>' must be the last token")
		case t != "*" && t != ">" && strings.ContainsAny(t, "*> \t\r\n"):
			return fmt.Errorf("invalid token %q", t)
		}
	}
	return nil
}

// Covers reports whether one of the stream subject filters matches every
// subject under prefix (that is, prefix.>). A filter such as "events.*"
// does not: it misses events.a.b.
func Covers(filters []string, prefix string) bool {
	want := strings.Split(prefix, ".")
	for _, f := range filters {
		toks := strings.Split(f, ".")
		for i, t := range toks {
			if t == ">" {
				if i <= len(want) {
					return true
				}
				break
			}
			if i >= len(want) || (t != "*" && t != want[i]) {
				break
			}
		}
	}
	return false
}
