package event

import (
	"strings"
	"testing"
)

func TestCovers(t *testing.T) {
	for _, tc := range []struct {
		filters []string
		prefix  string
		want    bool
	}{
		{[]string{"events.>"}, "events", true},
		{[]string{">"}, "events", true},
		{[]string{"*.>"}, "events", true},
		{[]string{"other.>", "events.>"}, "events", true},
		{[]string{"events.*"}, "events", false},
		{[]string{"events"}, "events", false},
		{[]string{"events.orders.>"}, "events", false},
		{[]string{"app.>"}, "app.events", true},
		{[]string{"app.events.>"}, "app.events", true},
		{[]string{"app.*.>"}, "app.events", true},
		{[]string{"app.other.>"}, "app.events", false},
		{nil, "events", false},
	} {
		if got := Covers(tc.filters, tc.prefix); got != tc.want {
			t.Errorf("Covers(%q, %q) = %v, want %v", tc.filters, tc.prefix, got, tc.want)
		}
	}
}

func TestValidateEventID(t *testing.T) {
	for id, ok := range map[string]bool{
		"6f1c8f0e-5d7a-4b8e-9c1d-2a3b4c5d6e7f": true,
		"order-42":                             true,
		"":                                     false,
		"a\r\nb":                               false,
		"\xff\xfe":                             false,
		strings.Repeat("x", 256):               false,
	} {
		if err := ValidateEventID(id); (err == nil) != ok {
			t.Errorf("ValidateEventID(%q) = %v", id, err)
		}
	}
}

func TestSubjectLength(t *testing.T) {
	if _, err := Subject("events", strings.Repeat("x", 5000)); err == nil || !strings.Contains(err.Error(), "more than 255") {
		t.Fatalf("a 5000-byte event type: %v", err)
	}
	if _, err := Subject("events", strings.Repeat("x", 248)); err != nil {
		t.Fatalf("a 255-byte subject: %v", err)
	}
}
