package natsname

import (
	"fmt"
	"strings"
)

// The placeholders of a subject template.
const (
	EventTypeToken = "{event_type}"
	TenantToken    = "{tenant}"
)

// FleetTemplate is a fleet's default template: each tenant's subjects
// under a prefix of their own (see ReadApart).
const FleetTemplate = TenantToken + "." + EventTypeToken

// Template is stream.subject_template: the tokens of a subject after
// stream.subject_prefix, where {event_type} stands for the row's event
// type (one or more tokens) and {tenant} for the tenant of the database
// file the row is in (one token).
type Template struct {
	// before and after are the template's text around {event_type},
	// {tenant} not yet filled in.
	before, after string
}

// ParseTemplate checks s: dot-separated tokens, each a literal usable in a
// subject, {event_type} exactly once and {tenant} at most once.
func ParseTemplate(s string) (Template, error) {
	events, tenants := 0, 0
	for _, tok := range strings.Split(s, ".") {
		switch tok {
		case EventTypeToken:
			events++
		case TenantToken:
			tenants++
		default:
			if strings.ContainsAny(tok, "{}") {
				return Template{}, fmt.Errorf("%q is not a placeholder: use %s and %s", tok, TenantToken, EventTypeToken)
			}
			if err := ValidateSubjectPart(tok); err != nil {
				return Template{}, fmt.Errorf("token %q: %v", tok, err)
			}
		}
	}
	if events != 1 {
		return Template{}, fmt.Errorf("it must hold %s exactly once, as a token of its own", EventTypeToken)
	}
	if tenants > 1 {
		return Template{}, fmt.Errorf("it may hold %s once at most", TenantToken)
	}
	before, after, _ := strings.Cut(s, EventTypeToken)
	return Template{before: before, after: after}, nil
}

// HasTenant reports whether the subjects name the tenant.
func (t Template) HasTenant() bool {
	return strings.Contains(t.before+t.after, TenantToken)
}

// ReadApart reports whether one tenant's messages can be read apart from
// the other tenants': {tenant} comes before {event_type} and nothing
// follows it, so that a tenant's Subjects' ReadFilter takes in its
// subjects alone.
func (t Template) ReadApart() bool {
	return strings.Contains(t.before, TenantToken) && t.after == ""
}

// Subjects returns the subjects of tenant's rows under prefix, or why the
// tenant's name cannot be a token of a subject.
func (t Template) Subjects(prefix, tenant string) (Subjects, error) {
	if t.HasTenant() {
		if err := ValidateTenant(tenant); err != nil {
			return Subjects{}, err
		}
	}
	fill := func(s string) string { return strings.ReplaceAll(s, TenantToken, tenant) }
	if before := strings.TrimSuffix(fill(t.before), "."); before != "" {
		prefix += "." + before
	}
	return Subjects{Prefix: prefix, Suffix: fill(t.after)}, nil
}

// ValidateTenant reports why name cannot be a tenant's name: it is one
// token of a subject.
func ValidateTenant(name string) error {
	if err := ValidateSubjectPart(name); err != nil {
		return fmt.Errorf("tenant %q cannot be a subject token: %v", name, err)
	}
	if strings.Contains(name, ".") {
		return fmt.Errorf("tenant %q cannot be a subject token: it contains '.'", name)
	}
	return nil
}

// Subjects are the subjects of one tenant's rows: Prefix, the event
// type, then Suffix.
type Subjects struct {
	Prefix string
	Suffix string // "" or starting with "."
}

// ReadFilter is the subject filter that takes in every one of these
// subjects under prefix (stream.subject_prefix): Prefix.> when nothing
// follows the event type, else prefix.>.
func (s Subjects) ReadFilter(prefix string) string {
	if s.Suffix != "" {
		return prefix + ".>"
	}
	return s.Prefix + ".>"
}

// Of returns the subject of an event type, or why it cannot form one.
func (s Subjects) Of(eventType string) (string, error) {
	if err := ValidateSubjectPart(eventType); err != nil {
		return "", fmt.Errorf("event_type %q cannot form a subject: %w", eventType, err)
	}
	subject := s.Prefix + "." + eventType + s.Suffix
	if len(subject) > MaxSubjectLen {
		return "", fmt.Errorf("event_type %.40q... cannot form a subject: the subject would be %d bytes, more than %d", eventType, len(subject), MaxSubjectLen)
	}
	return subject, nil
}
