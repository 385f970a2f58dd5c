package natsname

import (
	"strings"
	"testing"
)

func TestRedactURLs(t *testing.T) {
	got := RedactURLs("nats://u:pw@a:4222,nats://tok@b:4222,nats://c:4222")
	if strings.Contains(got, "pw") || strings.Contains(got, "tok") || !strings.Contains(got, "c:4222") {
		t.Fatal(got)
	}
}

// TestRedactURLsForms: the masking used for logs and errors hides the
// credentials of every URL form and leaves everything else as it is.
func TestRedactURLsForms(t *testing.T) {
	for in, want := range map[string]string{
		"nats://u:pw@a:4222,nats://tok@b:4222,nats://c:4222": "nats://u:xxxxx@a:4222,nats://xxxxx@b:4222,nats://c:4222",
		"nats://127.0.0.1:4222":                              "nats://127.0.0.1:4222",
		"nats://[::1]:4222, tls://h:4443":                    "nats://[::1]:4222, tls://h:4443",
		"embedded":                                           "embedded",
		"":                                                   "",
		"u:pw@127.0.0.1:4222":                                "xxxxx@127.0.0.1:4222",
		"tok@h:4222":                                         "xxxxx@h:4222",
		"nats:u:pw@h:4222":                                   "xxxxx@h:4222",
		"nats://u:p%zz@h:4222":                               "nats://u:xxxxx@h:4222",
		"nats://u:p w@h:4222":                                "nats://u:xxxxx@h:4222",
		"nats://u:p/w@h:4222":                                "nats://u:xxxxx@h:4222",
		"nats://u:p@w@h:4222":                                "nats://u:xxxxx@h:4222",
		"nats://:pw@h:4222":                                  "nats://xxxxx@h:4222",
		"nats://u:pw":                                        "nats://u:xxxxx",
		"ws://h:443/path":                                    "ws://h:443/path",
	} {
		if got := RedactURLs(in); got != want {
			t.Errorf("RedactURLs(%q) = %q, want %q", in, got, want)
		}
	}
}
