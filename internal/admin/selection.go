package admin

import "time"

// ParseWhen reads a time a filter is bounded by (Filter.Since, Until): a
// duration ago at now (24h), or an RFC 3339 time. It reports false for
// anything else.
func ParseWhen(s string, now time.Time) (time.Time, bool) {
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), true
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, true
	}
	return time.Time{}, false
}

// Select is the selection of every dead letter f takes (all), or of the
// rows with ids among them, each id once, in the order given.
func Select(all bool, ids []int64, f Filter) Selection {
	sel := Selection{All: all, Filter: f}
	seen := map[int64]bool{}
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			sel.IDs = append(sel.IDs, id)
		}
	}
	return sel
}
