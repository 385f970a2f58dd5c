package event

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"
)

// ReservedHeaderPrefixes are the header name prefixes a row's headers may
// not use: the relay's own headers and those JetStream acts on.
var ReservedHeaderPrefixes = []string{"Nats-", "Outbox-"}

// ParseHeaders reads a row's headers column: a JSON object whose values are
// strings or arrays of strings. NULL or blank text is no headers. It
// refuses, naming the problem, text that is not such an object, a header
// name that is not an HTTP token, a name that starts with a reserved
// prefix or is one of reserved (case-insensitive), and a value that NATS
// would not carry as it is (control characters, surrounding whitespace,
// invalid UTF-8).
func ParseHeaders(raw string, reserved ...string) (map[string][]string, error) {
	if strings.TrimSpace(raw) == "" {
		return nil, nil
	}
	var obj map[string]json.RawMessage
	dec := json.NewDecoder(strings.NewReader(raw))
	if err := dec.Decode(&obj); err != nil || dec.More() || obj == nil {
		why := "it is not a JSON object"
		if err != nil {
			why = fmt.Sprintf("it is not a JSON object (%v)", err)
		}
		return nil, fmt.Errorf("headers: %s", why)
	}
	names := make([]string, 0, len(obj))
	for name := range obj {
		names = append(names, name)
	}
	sort.Strings(names) // the first problem in name order, the same every time
	out := make(map[string][]string, len(obj))
	for _, name := range names {
		if err := headerName(name, reserved); err != nil {
			return nil, err
		}
		vals, err := headerValues(obj[name])
		if err != nil {
			return nil, fmt.Errorf("headers: %s: %w", name, err)
		}
		for _, v := range vals {
			if err := validateHeaderValue("value", v, "it would arrive as", 0); err != nil {
				return nil, fmt.Errorf("headers: %s: %w", name, err)
			}
		}
		out[name] = vals
	}
	return out, nil
}

// headerName reports why name cannot be a row's header.
func headerName(name string, reserved []string) error {
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
			return fmt.Errorf("headers: header name %q is reserved: %s* headers are the relay's and JetStream's own", name, p)
		}
	}
	for _, r := range reserved {
		if strings.EqualFold(name, r) {
			return fmt.Errorf("headers: header name %q is reserved: the relay sets it", name)
		}
	}
	return nil
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
