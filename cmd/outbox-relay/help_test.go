package main

import (
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// TestHelpListsWhatEachCommandReads: version's help is a few lines
// without a flag of the configuration; run's has every key's flag; status
// has the database's and, for --stream, the server's, but not the relay
// loop's; every command shows examples;
// --version prints what version prints.
func TestHelpListsWhatEachCommandReads(t *testing.T) {
	code, out, _ := runCLI(t, "version", "--help")
	if lines := strings.Count(out, "\n"); code != 0 || lines > 15 || strings.Contains(out, "--config") || strings.Contains(out, "--database-path") {
		t.Errorf("version --help: exit %d, %d lines; want a few and no configuration flag:\n%s", code, lines, out)
	}
	code, out, _ = runCLI(t, "run", "--help")
	for _, k := range config.Keys() {
		if !strings.Contains(out, "--"+k.Flag+" ") {
			t.Errorf("run --help lacks --%s", k.Flag)
		}
	}
	if code != 0 || !strings.Contains(out, "--config") || !strings.Contains(out, "Examples:") {
		t.Errorf("run --help: exit %d\n%s", code, out)
	}
	code, out, _ = runCLI(t, "status", "--help")
	if code != 0 || !strings.Contains(out, "--database-path") || !strings.Contains(out, "--nats-url") || strings.Contains(out, "--relay-batch-size") {
		t.Errorf("status --help: exit %d; want the database's and the server's flags, not the relay loop's\n%s", code, out)
	}
	if code, _, errOut := runCLI(t, "status", "--relay-batch-size", "5"); code != exitUsage || !strings.Contains(errOut, "--relay-batch-size") {
		t.Errorf("status --relay-batch-size: exit %d %q; want 2 naming the flag", code, errOut)
	}

	_, want, _ := runCLI(t, "version")
	if code, out, errOut := runCLI(t, "--version"); code != 0 || out != want {
		t.Errorf("--version: exit %d, %q %q; want %q", code, out, errOut, want)
	}

	var walk func(cmd *cobra.Command)
	walk = func(cmd *cobra.Command) {
		for _, sub := range cmd.Commands() {
			if !sub.Hidden && sub.Name() != "help" && sub.Example == "" {
				t.Errorf("%s has no examples", sub.CommandPath())
			}
			walk(sub)
		}
	}
	walk((&cli{}).newRoot())
}
