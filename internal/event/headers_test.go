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
