package natsname

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

func TestSubject(t *testing.T) {
	for _, tc := range []struct {
		eventType string
		want      string
		why       string
	}{
		{"ReviewLogged", "events.ReviewLogged", ""},
		{"movie.deleted", "events.movie.deleted", ""},
		{"Ünïcode-ok_1", "events.Ünïcode-ok_1", ""},
		{"", "", "empty"},
		{"has space", "", "whitespace"},
		{"tab\there", "", "whitespace"},
		{"a.*", "", "wildcard"},
		{"a>", "", "wildcard"},
		{".a", "", "empty token"},
		{"a.", "", "empty token"},
		{"a..b", "", "empty token"},
		{"a\x00b", "", "control"},
		{"\xff", "", "UTF-8"},
	} {
		got, err := Subject("events", tc.eventType)
		if tc.why == "" {
			if err != nil || got != tc.want {
				t.Errorf("Subject(%q) = %q, %v; want %q", tc.eventType, got, err, tc.want)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.why) {
			t.Errorf("Subject(%q) error = %v; want one mentioning %q", tc.eventType, err, tc.why)
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

// TestValidateFilter: wildcards are whole tokens, '>' only the last one.
func TestValidateFilter(t *testing.T) {
	for s, why := range map[string]string{
		"events.>":   "",
		">":          "",
		"*.orders.*": "",
		"events":     "",
		"":           "empty subject",
		"events..a":  "empty token",
		"events.":    "empty token",
		">.events":   "'>' must be the last token",
		"events.a*":  `invalid token "a*"`,
		"ev ents.>":  `invalid token "ev ents"`,
	} {
		err := ValidateFilter(s)
		if why == "" && err != nil || why != "" && (err == nil || err.Error() != why) {
			t.Errorf("ValidateFilter(%q) = %v; want %q", s, err, why)
		}
	}
}

// TestValidName: stream and consumer names take no whitespace, '.', '*',
// '>', '/' or '\'.
func TestValidName(t *testing.T) {
	for s, ok := range map[string]bool{
		"EVENTS": true, "orders-v2_1": true, "": false, "a b": false, "a.b": false,
		"a*": false, "a>": false, "a/b": false, `a\b`: false, "a\tb": false,
	} {
		if ValidName(s) != ok {
			t.Errorf("ValidName(%q) = %v, want %v", s, !ok, ok)
		}
	}
}
