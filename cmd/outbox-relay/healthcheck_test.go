package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestHealthcheckProbesThePathGiven: with --url, --path names the path
// probed (in place of the URL's own); without --path the URL is probed as
// given, /healthz when it has no path.
func TestHealthcheckProbesThePathGiven(t *testing.T) {
	asked := make(chan string, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked <- r.URL.Path
		if r.URL.Path != "/readyz" && r.URL.Path != "/healthz" {
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--url", srv.URL, "--path", "/readyz"}, "/readyz"},
		{[]string{"--url", srv.URL + "/healthz", "--path", "/readyz"}, "/readyz"},
		{[]string{"--url", srv.URL + "/healthz"}, "/healthz"},
		{[]string{"--url", srv.URL}, "/healthz"},
	} {
		code, out, errOut := runCLI(t, append([]string{"healthcheck"}, tc.args...)...)
		got := "nothing"
		select {
		case got = <-asked: // sent before the answer that ended the command
		default:
		}
		if code != 0 || got != tc.want || !strings.Contains(out, "200") {
			t.Errorf("healthcheck %v: exit %d, probed %s (%q %q); want %s", tc.args, code, got, out, errOut, tc.want)
		}
	}
	if code, _, errOut := runCLI(t, "healthcheck", "--url", srv.URL, "--path", "readyz"); code != exitUsage || !strings.Contains(errOut, "--path") {
		t.Errorf("a path without /: exit %d %q", code, errOut)
	}
}
