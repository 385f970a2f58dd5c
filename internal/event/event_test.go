package event

import (
	"math"
	"regexp"
	"strings"
	"testing"
	"time"
)

func TestRetryBackoff(t *testing.T) {
	want := map[int]time.Duration{
		0: 5 * time.Second, 1: 5 * time.Second, 2: 10 * time.Second, 3: 20 * time.Second,
		4: 40 * time.Second, 5: 80 * time.Second, 6: 160 * time.Second, 7: 300 * time.Second,
		10: 300 * time.Second, 1000: 300 * time.Second,
	}
	for attempts, d := range want {
		if got := RetryBackoff(attempts); got != d {
			t.Errorf("RetryBackoff(%d) = %v, want %v", attempts, got, d)
		}
	}
}

func TestReject(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	r := Row{ID: 1, Attempts: 0}
	o := Reject(r, "too big", 3, now)
	if o.Settlement != Retry || o.Attempts != 1 || !o.AvailableAt.Equal(now.Add(5*time.Second)) || o.Error != "too big" {
		t.Fatalf("first rejection: %+v", o)
	}
	r.Attempts = 1
	if o := Reject(r, "x", 3, now); o.Settlement != Retry || o.Attempts != 2 || !o.AvailableAt.Equal(now.Add(10*time.Second)) {
		t.Fatalf("second rejection: %+v", o)
	}
	r.Attempts = 2
	if o := Reject(r, "x", 3, now); o.Settlement != DeadLetter || o.Attempts != 3 || o.Error != "x" {
		t.Fatalf("last rejection: %+v", o)
	}
}

func TestNewID(t *testing.T) {
	re := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	seen := map[string]bool{}
	for i := 0; i < 10000; i++ {
		id := NewID()
		if !re.MatchString(id) {
			t.Fatalf("NewID() = %q, not a v4 UUID", id)
		}
		if seen[id] {
			t.Fatalf("NewID() repeated %q", id)
		}
		seen[id] = true
	}
}

// TestValidateCreatedAt: Outbox-Created-At and ce-time are RFC 3339 times,
// whose years run from 0000 to 9999; a created_at outside them is refused,
// naming the column, its value and what to write.
func TestValidateCreatedAt(t *testing.T) {
	for _, ms := range []int64{
		0, 1767225600000, -1,
		time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC).UnixMilli(),
		time.Date(9999, 12, 31, 23, 59, 59, 999e6, time.UTC).UnixMilli(),
	} {
		if err := ValidateCreatedAt(ms); err != nil {
			t.Errorf("ValidateCreatedAt(%d) = %v; want nil", ms, err)
		}
	}
	for ms, why := range map[int64]string{
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC).UnixMilli():       "created_at 253402300800000 is the year 10000",
		time.Date(-1, 12, 31, 23, 59, 59, 999e6, time.UTC).UnixMilli(): "created_at -62167219200001 is the year -1",
		1767225600000 * 1000:    "Unix microseconds?",
		1767225600000 * 1000000: "Unix nanoseconds?",
		math.MaxInt64:           "created_at 9223372036854775807",
		math.MinInt64:           "created_at -9223372036854775808",
	} {
		err := ValidateCreatedAt(ms)
		if err == nil || !strings.Contains(err.Error(), why) || !strings.Contains(err.Error(), "RFC 3339") || !strings.Contains(err.Error(), "Unix milliseconds") {
			t.Errorf("ValidateCreatedAt(%d) = %v; want an error saying %q, RFC 3339 and Unix milliseconds", ms, err, why)
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
