package config

import (
	"strings"
	"testing"
)

// TestUnknownKeysAsWritten: an unknown key is shown as the file spells it
// (viper lowercases every key), with the nearest known key when one is
// close, and no guess when none is.
func TestUnknownKeysAsWritten(t *testing.T) {
	for _, tc := range []struct {
		file, want, near string
	}{
		{"relay:\n  batchSize: 5\n", "relay.batchSize", "relay.batch_size"},
		{"relay:\n  maxInFlight: 5\n", "relay.maxInFlight", "relay.max_in_flight"},
		{"Relay:\n  shutdownTimeout: 5s\n", "Relay.shutdownTimeout", "relay.shutdown_timeout"},
		{"nats:\n  urll: nats://a:4222\n", "nats.urll", "nats.url"},
		{"natz:\n  url: nats://a:4222\n", "natz.url", "nats.url"},
		{"relay:\n  duplicate_window: 1h\n", "relay.duplicate_window", "stream.duplicate_window"},
		{"nats:\n  TLS:\n    CAfile: /x\n", "nats.TLS.CAfile", "nats.tls.ca"},
		{"nats:\n  tls:\n    insecureSkipVerify: true\n", "nats.tls.insecureSkipVerify", "nats.tls.insecure_skip_verify"},
		{"nats:\n  creds_file: /x\n", "nats.creds_file", "nats.creds"},
		{"colour: red\n", "colour", ""},
		{"relay:\n  frobnicate: 3\n", "relay.frobnicate", ""},
	} {
		msg := loadErr(t, tc.file)
		if !strings.Contains(msg, "unknown config key "+tc.want+" in ") {
			t.Errorf("%q: error %q does not show the key as written, %s", tc.file, msg, tc.want)
		}
		switch {
		case tc.near != "" && !strings.Contains(msg, "(did you mean "+tc.near+"?)"):
			t.Errorf("%q: error %q does not suggest %s", tc.file, msg, tc.near)
		case tc.near == "" && strings.Contains(msg, "did you mean"):
			t.Errorf("%q: error %q suggests a key that is not close", tc.file, msg)
		}
	}
	// Several at once: each with its own suggestion.
	msg := loadErr(t, "relay:\n  batchSize: 5\n  ackTimeout: 1s\n")
	if !strings.Contains(msg, "relay.batchSize in") || !strings.Contains(msg, "relay.ackTimeout in") ||
		!strings.Contains(msg, "did you mean relay.batch_size?") || !strings.Contains(msg, "did you mean relay.ack_timeout?") {
		t.Errorf("two unknown keys: %q", msg)
	}
	// A misspelt variable gets the nearest variable.
	msg = loadErr(t, "", "OUTBOX_RELAY_RELAY_BATCHSIZE=5")
	if !strings.Contains(msg, "OUTBOX_RELAY_RELAY_BATCHSIZE") || !strings.Contains(msg, "did you mean OUTBOX_RELAY_RELAY_BATCH_SIZE?") {
		t.Errorf("unknown variable: %q", msg)
	}
}
