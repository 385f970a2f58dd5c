package streamsync

import "testing"

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
