package natsname

import (
	"fmt"
	"net/url"
	"regexp"
	"strings"
)

// ValidateServerURLs checks comma-separated server URLs (nats.url) and
// returns one error per server that is not a nats, tls, ws or wss URL with
// a host. A URL whose user information holds a character that ends it (a
// raw '/', '#', '?', ',', ' ' or '%') gets an error that names the
// character and its percent-encoding, since "is not a server URL" says
// nothing of the password that broke it. No error shows a credential (see
// RedactURLs).
func ValidateServerURLs(urls string) []error {
	parts := strings.Split(urls, ",")
	var errs []error
	for i, p := range parts {
		err := validateServerURL(strings.TrimSpace(p))
		if err != nil && i > 0 && splitByComma(parts[i-1], p) {
			err = fmt.Errorf("%w (if it is the end of a user or password that holds a raw ',', which separates servers, percent-encode the ',' as %%2C)", err)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

func validateServerURL(s string) error {
	if hint := userinfoHint(s); hint != "" {
		return fmt.Errorf("%q: %s", RedactURLs(s), hint)
	}
	u, err := url.Parse(s)
	if err != nil || u.Host == "" {
		return fmt.Errorf("%q is not a server URL such as nats://host:4222", RedactURLs(s))
	}
	switch u.Scheme {
	case "nats", "tls", "ws", "wss":
		return nil
	}
	return fmt.Errorf("%q: scheme %q is not one of nats, tls, ws, wss", RedactURLs(s), u.Scheme)
}

// userinfoHint says which character of the user information in
// scheme://user:password@host must be percent-encoded, or "". Everything
// before the last '@' is taken for the user information, as RedactURLs
// does: a server URL has no path, query or fragment that could hold one.
func userinfoHint(s string) string {
	i := strings.Index(s, "://")
	if i < 0 {
		return ""
	}
	rest := s[i+3:]
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return ""
	}
	user, pass, _ := strings.Cut(rest[:at], ":")
	for _, part := range []struct{ name, text string }{{"user", user}, {"password", pass}} {
		if c, ok := rawChar(part.text); ok {
			return fmt.Sprintf("the %s holds a raw %q, which a URL does not allow there: percent-encode it as %%%02X (or set nats.user and nats.password instead of putting them in the URL)", part.name, c, c)
		}
	}
	return ""
}

// rawChar returns the first character of s that must be percent-encoded in
// a URL's user information: one that ends it, a space, or a '%' that
// starts no escape.
func rawChar(s string) (byte, bool) {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '/' || c == '#' || c == '?' || c == ' ':
			return c, true
		case c == '%' && (i+2 >= len(s) || !isHex(s[i+1]) || !isHex(s[i+2])):
			return c, true
		}
	}
	return 0, false
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// splitByComma reports whether a and b are the halves of one URL whose user
// information held a ',': a has a scheme and no host part after an '@', b
// has an '@' and no scheme.
func splitByComma(a, b string) bool {
	a, b = strings.TrimSpace(a), strings.TrimSpace(b)
	return strings.Contains(a, "://") && !strings.Contains(a, "@") && strings.Contains(b, "@") && !strings.Contains(b, "://")
}

// mask replaces a credential in RedactURLs' output.
const mask = "xxxxx"

var schemeRe = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*$`)

// RedactURLs hides passwords and tokens embedded in (comma-separated)
// server URLs, for logs and errors. It reads the text rather than parsing
// it, so that it also masks what url.Parse refuses or reads otherwise
// (u:pw@host without a scheme, nats:u:pw@host, bad %-escapes, spaces): in
// each URL everything before the last '@' after the scheme is user
// information. Only the user name of "scheme://user:password@" is kept; a
// user part without a password is a token. A port that is not a number
// (what is left of a password cut at an unescaped comma) is masked too.
func RedactURLs(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		parts[i] = redactURL(p)
	}
	return strings.Join(parts, ",")
}

func redactURL(p string) string {
	start := 0 // where the user information or host begins
	scheme := false
	if i := strings.Index(p, "://"); i >= 0 && schemeRe.MatchString(strings.TrimSpace(p[:i])) {
		start, scheme = i+3, true
	}
	if at := strings.LastIndex(p, "@"); at >= 0 {
		if at < start { // an '@' before "://": no telling where it began
			start, scheme = 0, false
		}
		user, _, hasPass := strings.Cut(p[start:at], ":")
		if scheme && hasPass && user != "" {
			return p[:start] + user + ":" + mask + p[at:]
		}
		return p[:start] + mask + p[at:]
	}
	host := p[start:]
	if end := strings.IndexAny(host, "/?#"); end >= 0 {
		host = host[:end]
	}
	if colon := strings.LastIndex(host, ":"); colon >= 0 && colon > strings.LastIndex(host, "]") {
		if port := strings.TrimSpace(host[colon+1:]); strings.Trim(port, "0123456789") != "" {
			return p[:start+colon+1] + mask
		}
	}
	return p
}
