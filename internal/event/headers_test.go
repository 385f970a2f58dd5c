package event

import (
	"fmt"
	"strings"
	"testing"
)

func TestParseHeaders(t *testing.T) {
	for raw, want := range map[string]string{
		"":   "map[]",
		"  ": "map[]",
		"{}": "map[]",
		`{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "rojo=00f067aa0ba902b7"}`: "map[traceparent:[00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01] tracestate:[rojo=00f067aa0ba902b7]]",
		`{"X-Tenant": ["a", "b"]}`: "map[X-Tenant:[a b]]",
	} {
		got, err := ParseHeaders(raw)
		if err != nil || fmtMap(got) != want {
			t.Errorf("ParseHeaders(%q) = %v, %v; want %s", raw, got, err, want)
		}
	}
	for raw, why := range map[string]string{
		`not json`:                      "not a JSON object",
		`["a"]`:                         "not a JSON object",
		`null`:                          "not a JSON object",
		`{"a": "b"} {"c": "d"}`:         "not a JSON object",
		`{"Nats-Msg-Id": "x"}`:          `"Nats-Msg-Id" is reserved`,
		`{"nats-expected-stream": "x"}`: `"nats-expected-stream" is reserved`,
		`{"OUTBOX-ROW-ID": "1"}`:        `"OUTBOX-ROW-ID" is reserved`,
		`{"a b": "x"}`:                  "cannot hold",
		`{"a:b": "x"}`:                  "cannot hold",
		`{"": "x"}`:                     "empty",
		`{"n": 1}`:                      "must be a string or a non-empty array of strings",
		`{"n": []}`:                     "must be a string or a non-empty array of strings",
		`{"n": [1]}`:                    "must be a string or a non-empty array of strings",
		`{"n": ["a", null]}`:            "must be a string or a non-empty array of strings",
		`{"n": "a\r\nInjected: x"}`:     "control character",
		`{"n": " padded"}`:              "whitespace",
	} {
		if _, err := ParseHeaders(raw); err == nil || !strings.Contains(err.Error(), why) || !strings.HasPrefix(err.Error(), "headers: ") {
			t.Errorf("ParseHeaders(%q) = %v; want an error saying %q", raw, err, why)
		}
	}
	if _, err := ParseHeaders(`{"ce-id": "x"}`, "ce-id"); err == nil || !strings.Contains(err.Error(), "the relay sets it") {
		t.Errorf("a header the relay sets was accepted: %v", err)
	}
}

func fmtMap(m map[string][]string) string {
	if m == nil {
		m = map[string][]string{}
	}
	return fmt.Sprint(m)
}

// TestParseHeadersRefusesNamesClientsInterpret: a header nats.go takes
// for a protocol status (Status, with Description its text) would hide the
// event from every nats.go consumer; the server's MQTT bridge reads
// Nmqtt-* headers. Each is refused in any case, with the reason.
func TestParseHeadersRefusesNamesClientsInterpret(t *testing.T) {
	for raw, why := range map[string]string{
		`{"Status": "408"}`:           `header name "Status" is reserved: nats.go takes a message with a Status header for a protocol status message`,
		`{"status": "ok"}`:            `header name "status" is reserved: nats.go`,
		`{"STATUS": "503"}`:           `header name "STATUS" is reserved`,
		`{"Description": "x"}`:        `header name "Description" is reserved: nats.go`,
		`{"description": "x"}`:        `header name "description" is reserved`,
		`{"Nmqtt-Pub": "2"}`:          `header name "Nmqtt-Pub" is reserved: Nmqtt-* headers are read by the server's MQTT bridge`,
		`{"nmqtt-subject": "a/b"}`:    `header name "nmqtt-subject" is reserved`,
		`{"X-Status": "1", "a": "b"}`: "",
		`{"Statuses": "1"}`:           "",
	} {
		_, err := ParseHeaders(raw)
		switch {
		case why == "" && err != nil:
			t.Errorf("ParseHeaders(%q) = %v; want it accepted", raw, err)
		case why != "" && (err == nil || !strings.Contains(err.Error(), why)):
			t.Errorf("ParseHeaders(%q) = %v; want an error saying %q", raw, err, why)
		}
	}
	if _, err := ParseHeaders(`{"Status": "408"}`); err == nil || !strings.Contains(err.Error(), "rename the header") {
		t.Errorf("the reason does not say what to do: %v", err)
	}
}

// TestParseHeadersRefusesWhatJSONWouldReplace: encoding/json puts U+FFFD in
// place of bytes that are not UTF-8 and of a lone UTF-16 surrogate, and
// keeps the last of duplicate keys; each is refused, naming the header,
// instead of being published changed.
func TestParseHeadersRefusesWhatJSONWouldReplace(t *testing.T) {
	for raw, why := range map[string]string{
		"{\"tenant\": \"ac\xffme\"}":             `headers: tenant: the value is not valid UTF-8 text (a BLOB?)`,
		"{\"tenant\": [\"ok\", \"\xc3\x28\"]}":   `headers: tenant: the value is not valid UTF-8 text`,
		"{\"ten\xffant\": \"acme\"}":             `headers: header name "ten\xffant" is not valid UTF-8 text`,
		`{"tenant": "a\ud800b"}`:                 `headers: tenant: the value holds \ud800, half of a UTF-16 surrogate pair`,
		`{"tenant": "a\udc00"}`:                  `holds \udc00, half of a UTF-16 surrogate pair`,
		`{"tenant": "\ud83d\u0041"}`:             `holds \ud83d, half of a UTF-16 surrogate pair`,
		`{"tenant": ["ok", "\uD800"]}`:           `holds \uD800`,
		`{"ten\ud800ant": "acme"}`:               `headers: header name "ten\ud800ant" holds \ud800`,
		`{"tenant": "a", "tenant": "b"}`:         `headers: header name "tenant" appears twice: JSON keeps only the last`,
		`{"Trace": "a", "x": "y", "trace": "b"}`: `headers: header names "Trace" and "trace" differ only in case`,
		`{"tenant": "a", "Tenant": ["b", "c"]}`:  `differ only in case`,
	} {
		if _, err := ParseHeaders(raw); err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("ParseHeaders(%q) = %v; want an error saying %q", raw, err, why)
		}
	}
	// A surrogate pair is one character, and U+FFFD written as itself is
	// a character like any other.
	for raw, want := range map[string]string{
		`{"emoji": "\ud83d\ude00"}`:    "map[emoji:[\U0001F600]]",
		`{"emoji": "\uD83D\uDE00 ok"}`: "map[emoji:[\U0001F600 ok]]",
		`{"mark": "\ufffd"}`:           "map[mark:[\uFFFD]]",
		"{\"mark\": \"\uFFFD\"}":       "map[mark:[\uFFFD]]",
		`{"esc": "a\\ud800"}`:          `map[esc:[a\ud800]]`,
		`{"a": "1", "b": ["2", "3"]}`:  "map[a:[1] b:[2 3]]",
	} {
		got, err := ParseHeaders(raw)
		if err != nil || fmtMap(got) != want {
			t.Errorf("ParseHeaders(%q) = %v, %v; want %s", raw, got, err, want)
		}
	}
}
