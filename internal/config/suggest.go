package config

import (
	"strings"

	"go.yaml.in/yaml/v3"
)

// writtenKeys records every dotted key of the mapping node as written, by
// its lowercased form.
func writtenKeys(node *yaml.Node, prefix string, out map[string]string) {
	if node.Kind != yaml.MappingNode {
		return
	}
	for i := 0; i+1 < len(node.Content); i += 2 {
		key, val := node.Content[i], node.Content[i+1]
		if val.Kind == yaml.AliasNode && val.Alias != nil {
			val = val.Alias
		}
		name := prefix + key.Value
		out[strings.ToLower(name)] = name
		writtenKeys(val, name+".", out)
	}
}

// nearestKey returns the known key closest to the unknown dotted name, or ""
// when none is close enough to be what was meant. Case, '_' and '-' do not
// count (batchSize is batch_size), and a key whose last part matches in
// another section (relay.duplicate_window for stream.duplicate_window) is
// close, and so is one that a key of the same section begins (nats-server's
// tls.ca_file for nats.tls.ca).
func nearestKey(name string, known map[string]bool) string {
	n := normKey(name)
	best, bestScore, bestFull := "", 0, 0
	for k := range known {
		nk := normKey(k)
		full := editDistance(n, nk)
		score := full
		if lastPart(n) == lastPart(nk) || sameSection(n, nk) && prefixes(lastPart(n), lastPart(nk)) {
			score = min(score, 1)
		}
		if score > maxDistance(n) {
			continue
		}
		if best == "" || score < bestScore || score == bestScore && (full < bestFull || full == bestFull && k < best) {
			best, bestScore, bestFull = k, score, full
		}
	}
	return best
}

// nearestEnv returns the variable of the key whose variable is closest to
// the unknown OUTBOX_RELAY_* name, or "".
func nearestEnv(name string, keys []Key) string {
	n := normKey(strings.TrimPrefix(name, EnvPrefix))
	best, bestD := "", 0
	for _, k := range keys {
		d := editDistance(n, normKey(strings.TrimPrefix(k.Env, EnvPrefix)))
		if d <= maxDistance(n) && (best == "" || d < bestD) {
			best, bestD = k.Env, d
		}
	}
	return best
}

// normKey folds what a hand-written key most often gets wrong: case and
// word separators.
func normKey(s string) string {
	return strings.NewReplacer("_", "", "-", "").Replace(strings.ToLower(s))
}

func lastPart(s string) string { return s[strings.LastIndex(s, ".")+1:] }

func sameSection(a, b string) bool {
	return a[:max(0, strings.LastIndex(a, "."))] == b[:max(0, strings.LastIndex(b, "."))]
}

// prefixes reports whether the shorter of a and b, of two letters or more,
// begins the other.
func prefixes(a, b string) bool {
	if len(a) > len(b) {
		a, b = b, a
	}
	return len(a) >= 2 && strings.HasPrefix(b, a)
}

// maxDistance is how many edits a name may be from a key and still be a
// slip of the hand rather than another word.
func maxDistance(s string) int {
	switch {
	case len(s) <= 6:
		return 1
	case len(s) < 16:
		return 2
	}
	return 3
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
