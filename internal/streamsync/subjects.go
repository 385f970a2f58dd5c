package streamsync

import "strings"

// Covers reports whether one of the stream subjects filters matches every
// subject under prefix (that is, prefix.>). A filter such as "events.*"
// does not: it misses events.a.b.
func Covers(filters []string, prefix string) bool {
	want := strings.Split(prefix, ".")
	for _, f := range filters {
		toks := strings.Split(f, ".")
		for i, t := range toks {
			if t == ">" {
				if i <= len(want) {
					return true
				}
				break
			}
			if i >= len(want) || (t != "*" && t != want[i]) {
				break
			}
		}
	}
	return false
}
