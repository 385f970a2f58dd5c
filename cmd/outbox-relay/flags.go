package main

import (
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// keys chooses the configuration keys a command takes flags for.
type keys func(key string) bool

// allKeys: every key, for the commands that run a relay.
func allKeys(string) bool { return true }

// keysOf takes the keys named and the keys of the sections named
// ("database" takes database.path, database.table, ...), except those of
// the sections in but (a section a command cannot use, such as
// nats.embedded for one that connects to a server).
func keysOf(names []string, but ...string) keys {
	under := func(key string, names []string) bool {
		for _, n := range names {
			if key == n || strings.HasPrefix(key, n+".") {
				return true
			}
		}
		return false
	}
	return func(key string) bool { return under(key, names) && !under(key, but) }
}

// The configuration each kind of command reads.
var (
	// migrate and dead-letters.
	databaseKeys = keysOf([]string{"database"})
	// status: the file, whether dead letters park their keys, and with
	// --stream the stream's server and what the relay needs of it.
	statusKeys = keysOf([]string{"database", "ordering", "nats", "stream", "relay.ack_timeout", "log"}, "nats.embedded")
	// audit: the file, and the stream's server and name.
	auditKeys = keysOf([]string{"database", "nats", "stream.name", "relay.ack_timeout", "log"}, "nats.embedded")
	// The credentials and TLS of a command that connects to a server of
	// its choosing in JetStream mode (bench).
	connectionKeys = keysOf([]string{"nats"}, "nats.embedded", "nats.url", "nats.mode")
	// streamsync: the connection, the stream and what the relay manages on
	// it, and the log of the connection.
	streamKeys = keysOf([]string{"nats", "stream", "consumer", "relay.max_attempts", "relay.ack_timeout", "log"}, "nats.embedded")
)

// withConfig gives cmd the --config flag and a flag for each configuration
// key in want, after the command's own flags (a name the command uses for
// a flag of its own, such as bench's --nats-url, stays its own). Only the
// commands that read the configuration take these flags, each only those
// of the keys it uses, so that a command's help lists what it reads; the
// environment and the file set every key for every command.
func (c *cli) withConfig(cmd *cobra.Command, want keys) *cobra.Command {
	fs := cmd.Flags()
	fs.SortFlags = false // the command's own flags first
	if fs.Lookup("config") == nil {
		fs.StringVar(&c.configFile, "config", "", "YAML configuration file (keys: docs/configuration.md)")
	}
	all := pflag.NewFlagSet(cmd.Name(), pflag.ContinueOnError)
	config.BindFlags(all)
	for _, k := range config.Keys() {
		if want(k.Name) && fs.Lookup(k.Flag) == nil {
			fs.AddFlag(all.Lookup(k.Flag))
		}
	}
	return cmd
}
