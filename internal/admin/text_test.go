package admin

import "testing"

// hostileID is an event id an application could write: shown raw, it
// would set the terminal's title and clear its screen.
const hostileID = "id\x1b]0;PWNED\x07\x1b[2J"

// escapedID is hostileID as output for people shows it.
const escapedID = `id\x1b]0;PWNED\a\x1b[2J`

// TestShownEscapesWhatATerminalObeys: control characters, format
// characters and bytes that are not UTF-8 are escaped; printable text in
// any script, and spaces, are left alone.
func TestShownEscapesWhatATerminalObeys(t *testing.T) {
	for in, want := range map[string]string{
		"6f1c8f0e-5d7a":      "6f1c8f0e-5d7a",
		`event_type "a b"`:   `event_type "a b"`,
		"Straße 東京 ✓":        "Straße 東京 ✓",
		hostileID:            escapedID,
		"a\rb\nc\td":         `a\rb\nc\td`,
		"\u202egnp.exe":      `\u202egnp.exe`,
		"x\xffy":             `x\xffy`,
		"zero\u200bwidth":    `zero\u200bwidth`,
		"\x9b[2J (C1 CSI)":   `\x9b[2J (C1 CSI)`,
		"\u009b[2J (C1 CSI)": `\u009b[2J (C1 CSI)`,
	} {
		if got := Shown(in); got != want {
			t.Errorf("Shown(%q) = %q, want %q", in, got, want)
		}
	}
}
