package admin

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Shown returns s, a value read from the database, as output for people
// may print it. The application writes those values (an event_id, the text in a
// last_error, a header), so they may hold escape sequences a terminal
// would obey (a changed window title, a cleared screen), a carriage return
// that hides what came before it, or a right-to-left override that
// reorders the line. Every character that is not printable, and every byte
// that is not UTF-8, is written as its Go escape (\x1b, \r, \u202e, \xff);
// printable text, spaces included, is left as it is. Values printed quoted
// (%q) need no more: the quoting escapes the same characters. JSON output
// needs none either: its encoder escapes control characters.
func Shown(s string) string {
	if plain(s) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case strconv.IsPrint(r):
			b.WriteRune(r)
		default:
			q := strconv.QuoteRune(r) // '\x1b', '\u202e'
			b.WriteString(q[1 : len(q)-1])
		}
		i += n
	}
	return b.String()
}

// plain reports whether s is printable text that Shown leaves alone.
func plain(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < ' ' || c > '~' {
			return !strings.ContainsFunc(s, func(r rune) bool { return !strconv.IsPrint(r) }) && utf8.ValidString(s)
		}
	}
	return true
}

// oneLine is a long value (a last_error) for a table's last column: its
// runs of white space made one space, escaped as Shown does, and cut to
// about 160 bytes between characters.
func oneLine(s string) string {
	s = Shown(strings.Join(strings.Fields(s), " "))
	if len(s) > 160 {
		cut := 157
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "..."
	}
	return s
}
