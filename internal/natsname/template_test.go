package natsname

import "testing"

// TestReadFilterTakesInATenantsSubjects: a tenant's read filter takes in
// each of its subjects, and is its own (no other tenant's subject) exactly
// when the template reads tenants apart.
func TestReadFilterTakesInATenantsSubjects(t *testing.T) {
	for tmpl, apart := range map[string]bool{
		"{event_type}":            false,
		"app.{event_type}":        false,
		"{event_type}.{tenant}":   false,
		"{tenant}.{event_type}.x": false,
		"{tenant}.{event_type}":   true,
		"x.{tenant}.{event_type}": true,
	} {
		parsed, err := ParseTemplate(tmpl)
		if err != nil {
			t.Fatal(err)
		}
		if parsed.ReadApart() != apart {
			t.Errorf("%s: ReadApart %v, want %v", tmpl, parsed.ReadApart(), apart)
		}
		acme, err := parsed.Subjects("events", "acme")
		if err != nil {
			t.Fatal(err)
		}
		other, err := parsed.Subjects("events", "other")
		if err != nil {
			t.Fatal(err)
		}
		filter := acme.ReadFilter("events")
		for subjects, want := range map[Subjects]bool{acme: true, other: !apart} {
			subject, err := subjects.Of("order.placed")
			if err != nil {
				t.Fatal(err)
			}
			if got := Covers([]string{filter}, subject); got != want {
				t.Errorf("%s: filter %s takes in %s: %v, want %v", tmpl, filter, subject, got, want)
			}
		}
	}
}
