package event

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// ReservedHeaderPrefixes are the header name prefixes a row's headers may
// not use: the relay's own headers, those JetStream acts on, and those the
// server's MQTT bridge reads (Nmqtt-Pub carries the QoS and retain flags of
// a message it delivers to MQTT subscribers).
var ReservedHeaderPrefixes = []string{"Nats-", "Outbox-", "Nmqtt-"}

// clientHeaders are the header names NATS clients read as the protocol's
// own, refused in a row's headers in any case, with why.
var clientHeaders = []struct{ name, why string }{
	// nats.go (v1.55) takes a message with a Status header for a protocol
	// status message (no responders, an expired pull request, a consumer's
	// heartbeat or flow control) and does not hand it to the application.
	{"Status", "nats.go takes a message with a Status header for a protocol status message and never hands it to the application (a pull consumer skips it, an ordered consumer stalls behind it)"},
	{"Description", "nats.go reads it as the text of a protocol status message (with a Status header)"},
}

// ParseHeaders reads a row's headers column: a JSON object whose values are
// strings or arrays of strings. NULL or blank text is no headers. It
// refuses, naming the problem, text that is not such an object; a header
// name that is not an HTTP token, starts with a reserved prefix, is one
// that NATS clients read (Status, Description) or one of reserved (all
// case-insensitive), or appears twice in any case (JSON would keep only
// the last, and many clients fold the case); and a value that NATS would
// not carry as it is written (control characters, surrounding
// whitespace). Text that JSON decoding would change is refused too: bytes
// that are not UTF-8 and lone UTF-16 surrogates (\ud800) become U+FFFD.
func ParseHeaders(raw string, reserved ...string) (map[string][]string, error) {
	if strings.TrimSpace(raw) == "" {
		return nil, nil
	}
	entries, err := headerEntries(raw)
	if err != nil {
		return nil, err
	}
	out := make(map[string][]string, len(entries))
	seen := make(map[string]string, len(entries)) // lower case -> as written
	for _, e := range entries {
		if err := headerName(e, reserved); err != nil {
			return nil, err
		}
		if first, dup := seen[strings.ToLower(e.name)]; dup {
			return nil, duplicateHeader(first, e.name)
		}
		seen[strings.ToLower(e.name)] = e.name
		vals, err := headerValues(e.value)
		if err != nil {
			return nil, fmt.Errorf("headers: %s: %w", e.name, err)
		}
		for _, v := range vals {
			if err := validateHeaderValue("value", v, "it would arrive as", 0); err != nil {
				return nil, fmt.Errorf("headers: %s: %w", e.name, err)
			}
		}
		out[e.name] = vals
	}
	return out, nil
}

// headerEntry is one member of the headers object: its name decoded and
// as written (JSON text, quotes included), and its value's JSON text.
type headerEntry struct {
	name, rawName string
	value         json.RawMessage
}

// headerEntries reads raw's members in order with the decoder's token
// stream, which, unlike decoding into a map, keeps duplicate names and
// each member's text as written.
func headerEntries(raw string) ([]headerEntry, error) {
	notObject := func(err error) error {
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("headers: it is not a JSON object (%v)", err)
		}
		return errors.New("headers: it is not a JSON object")
	}
	dec := json.NewDecoder(strings.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, notObject(err)
	}
	var out []headerEntry
	for dec.More() {
		from := dec.InputOffset()
		tok, err := dec.Token()
		if err != nil {
			return nil, notObject(err)
		}
		name, _ := tok.(string) // an object's key is always a string
		e := headerEntry{name: name, rawName: strings.TrimLeft(raw[from:dec.InputOffset()], ", \t\r\n")}
		if err := dec.Decode(&e.value); err != nil {
			return nil, notObject(err)
		}
		out = append(out, e)
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, notObject(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, notObject(err)
	}
	return out, nil
}

// headerName reports why e's name cannot be a row's header.
func headerName(e headerEntry, reserved []string) error {
	name := e.name
	if err := asWritten(e.rawName); err != nil {
		shown := e.rawName // JSON text, quoted
		if !utf8.ValidString(shown) {
			shown = strconv.Quote(shown[1 : len(shown)-1])
		}
		return fmt.Errorf("headers: header name %s %w", shown, err)
	}
	if name == "" {
		return fmt.Errorf("headers: a header name is empty")
	}
	for _, c := range name {
		if c > unicode.MaxASCII || !tokenChar(byte(c)) {
			return fmt.Errorf("headers: header name %q has a character a header name cannot hold (%q)", name, c)
		}
	}
	for _, p := range ReservedHeaderPrefixes {
		if len(name) >= len(p) && strings.EqualFold(name[:len(p)], p) {
			return fmt.Errorf("headers: header name %q is reserved: %s", name, prefixOwner(p))
		}
	}
	for _, c := range clientHeaders {
		if strings.EqualFold(name, c.name) {
			return fmt.Errorf("headers: header name %q is reserved: %s; rename the header, for example to X-%s", name, c.why, name)
		}
	}
	for _, r := range reserved {
		if strings.EqualFold(name, r) {
			return fmt.Errorf("headers: header name %q is reserved: the relay sets it", name)
		}
	}
	return nil
}

// prefixOwner says whose headers a reserved prefix marks.
func prefixOwner(p string) string {
	if p == "Nmqtt-" {
		return "Nmqtt-* headers are read by the server's MQTT bridge (a message's QoS and retain flags for MQTT subscribers)"
	}
	return p + "* headers are the relay's and JetStream's own"
}

// duplicateHeader says why a name that appeared as first cannot appear
// again as name.
func duplicateHeader(first, name string) error {
	if first == name {
		return fmt.Errorf(`headers: header name %q appears twice: JSON keeps only the last; write it once, with an array for several values, such as {%q: ["a", "b"]}`, name, name)
	}
	return fmt.Errorf(`headers: header names %q and %q differ only in case: many NATS and HTTP clients read header names without case and would see one of them; write one name, with an array for several values, such as {%q: ["a", "b"]}`, first, name, first)
}

// tokenChar reports whether c may appear in an HTTP token (RFC 9110).
func tokenChar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// headerValues reads a header's JSON value: a string, or an array of
// strings.
func headerValues(v json.RawMessage) ([]string, error) {
	v = bytes.TrimSpace(v)
	if err := asWritten(string(v)); err != nil {
		return nil, fmt.Errorf("the value %w", err)
	}
	var one string
	if len(v) > 0 && v[0] == '"' {
		if err := json.Unmarshal(v, &one); err != nil {
			return nil, err
		}
		return []string{one}, nil
	}
	var items []json.RawMessage
	if len(v) == 0 || v[0] != '[' || json.Unmarshal(v, &items) != nil || len(items) == 0 {
		return nil, fmt.Errorf("the value must be a string or a non-empty array of strings, not %s", clip(string(v)))
	}
	many := make([]string, len(items))
	for i, item := range items {
		item = bytes.TrimSpace(item)
		if len(item) == 0 || item[0] != '"' || json.Unmarshal(item, &many[i]) != nil {
			return nil, fmt.Errorf("the value must be a string or a non-empty array of strings, not %s", clip(string(v)))
		}
	}
	return many, nil
}

// asWritten reports why JSON text js would not decode to what it says:
// bytes that are not UTF-8, or a \u escape of half a surrogate pair
// without its other half, which encoding/json turns into U+FFFD. The
// error completes a sentence whose subject is the text.
func asWritten(js string) error {
	if !utf8.ValidString(js) {
		return errors.New("is not valid UTF-8 text (a BLOB?): it would arrive with U+FFFD in place of the bytes that are not; write the headers as UTF-8 text")
	}
	if esc := loneSurrogate(js); esc != "" {
		return fmt.Errorf(`holds %s, half of a UTF-16 surrogate pair without its other half: no character, and it would arrive as U+FFFD; write the character itself, or both halves of its pair (such as \ud83d\ude00)`, esc)
	}
	return nil
}

// loneSurrogate returns the first \u escape in the valid JSON text js of a
// high surrogate not followed by the escape of a low one, or of a low
// surrogate not preceded by a high one; "" when there is none.
func loneSurrogate(js string) string {
	for i := 0; i < len(js); i++ {
		if js[i] != '\\' {
			continue
		}
		if js[i+1] != 'u' {
			i++ // a one-character escape, such as \\ or \"
			continue
		}
		u := hex4(js[i+2 : i+6])
		switch {
		case u >= 0xD800 && u <= 0xDBFF:
			if i+12 <= len(js) && js[i+6] == '\\' && js[i+7] == 'u' {
				if lo := hex4(js[i+8 : i+12]); lo >= 0xDC00 && lo <= 0xDFFF {
					i += 11 // the pair
					continue
				}
			}
			return js[i : i+6]
		case u >= 0xDC00 && u <= 0xDFFF:
			return js[i : i+6]
		}
		i += 5
	}
	return ""
}

// hex4 reads the four hex digits of a valid JSON \u escape.
func hex4(s string) uint64 {
	u, _ := strconv.ParseUint(s, 16, 16)
	return u
}

// clip shortens s for an error message.
func clip(s string) string {
	if len(s) <= 40 {
		return s
	}
	cut := 37
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}
