// Command outbox-relay moves rows of a SQLite transactional outbox to NATS
// JetStream. See README.md.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// Set by the build: -ldflags "-X main.version=... -X main.commit=...".
var (
	version = "dev"
	commit  = ""
)

// Exit codes (docs/contract.md).
const (
	exitOK      = 0
	exitRuntime = 1
	exitUsage   = 2
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// usageError is a command-line mistake: exit code 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// exitCode maps an error to the process exit code.
func exitCode(err error) int {
	var ue usageError
	var ce *config.Error
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue), errors.As(err, &ce):
		return exitUsage
	}
	return exitRuntime
}

// run is main without the process: it returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	c := &cli{stdout: stdout, stderr: stderr}
	root := c.newRoot()
	root.SetArgs(args)
	err := root.Execute()
	if err != nil && !errors.Is(err, errNeedsAttention) {
		c.reportError(err)
	}
	return exitCode(err)
}

// cli carries what every command needs.
type cli struct {
	stdout, stderr io.Writer
	configFile     string
	flags          *pflag.FlagSet // the running command's flags, config keys among them
	// db is --db: the file of a fleet a command works on (chooseDB).
	db string
	// jsonLog is the logger of a long-running command whose logs are
	// JSON: the error it ends on is logged there (reportError).
	jsonLog *zap.Logger
}

func (c *cli) newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "outbox-relay",
		Short: "Relay a SQLite transactional outbox to NATS JetStream",
		Long: `outbox-relay claims due rows of a SQLite outbox table, publishes each to NATS
JetStream with Nats-Msg-Id set to its event id, and marks it done once the
stream has acknowledged it. "run" is the default command, and takes the same
flags here (outbox-relay run --help lists them).

Every configuration key is also an environment variable (OUTBOX_RELAY_...) and
a YAML key (--config FILE); each command has flags for the keys it reads.
Keys, defaults and precedence: docs/configuration.md.`,
		Example: `  outbox-relay demo                                  # the whole job on an embedded JetStream server
  outbox-relay migrate --database-path app.db        # create the outbox table
  outbox-relay --config /etc/outbox-relay.yaml       # run the relay
  outbox-relay status --database-path app.db`,
		Version:       versionLine(),
		SilenceUsage:  true,
		SilenceErrors: true,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usagef("unknown command %q (see outbox-relay --help)", args[0])
			}
			return nil
		},
		// Every command: config.Load reads the keys' flags from the
		// command that runs.
		PersistentPreRun: func(cmd *cobra.Command, _ []string) { c.flags = cmd.Flags() },
		RunE:             func(cmd *cobra.Command, _ []string) error { return c.runDaemon(cmd) },
	}
	root.SetVersionTemplate("{{.Version}}\n")
	root.CompletionOptions.DisableDefaultCmd = true
	root.SetOut(c.stdout)
	root.SetErr(c.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	c.withConfig(root, allKeys)
	// run's help lists them; the root's lists the commands.
	root.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name != "config" {
			f.Hidden = true
		}
	})
	root.AddCommand(c.commands()...)
	usageErrors(root)
	return root
}

// commands are the root's commands, each with the configuration flags of
// the keys it reads (withConfig); version reads none.
func (c *cli) commands() []*cobra.Command {
	return []*cobra.Command{
		c.withConfig(c.runCommand(), allKeys),
		c.withConfig(c.migrateCommand(), databaseKeys),
		c.withConfig(c.streamsyncCommand(), streamKeys),
		c.withConfig(c.withDB(c.statusCommand()), statusKeys),
		c.withConfig(c.withDB(c.auditCommand()), auditKeys),
		c.deadLettersCommand(), // its subcommands: --db and databaseKeys
		c.withConfig(c.healthcheckCommand(), keysOf([]string{"metrics"})),
		c.withConfig(c.demoAppCommand(), keysOf([]string{"database", "log"})),
		c.withConfig(c.benchCommand(), connectionKeys),
		c.withConfig(c.benchClientCommand(), connectionKeys),
		c.withConfig(c.demoCommand(), allKeys),
		{
			Use:     "version",
			Short:   "Print version, commit and Go version",
			Example: "  outbox-relay version\n  outbox-relay --version",
			Args:    cobra.NoArgs,
			RunE: func(*cobra.Command, []string) error {
				fmt.Fprintln(c.stdout, versionLine())
				return nil
			},
		},
	}
}

// usageErrors makes the flag and argument errors of every command under
// root usage errors (exit code 2).
func usageErrors(root *cobra.Command) {
	var walk func(*cobra.Command)
	walk = func(cmd *cobra.Command) {
		for _, sub := range cmd.Commands() {
			sub.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
			if check := sub.Args; check != nil {
				sub.Args = func(cmd *cobra.Command, args []string) error {
					if err := check(cmd, args); err != nil {
						return usageError{err}
					}
					return nil
				}
			}
			walk(sub)
		}
	}
	walk(root)
}

// loadConfig reads the configuration from file, environment and the
// running command's flags.
func (c *cli) loadConfig() (config.Config, error) {
	return config.Load(c.configFile, c.flags)
}

// versionLine is what version and --version print.
func versionLine() string {
	return fmt.Sprintf("outbox-relay %s (commit %s, %s)", version, buildCommit(), runtime.Version())
}

// buildCommit is the commit stamped at build time, or the one Go recorded.
func buildCommit() string {
	if commit != "" {
		return commit
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			if s.Key == "vcs.revision" {
				return s.Value
			}
		}
	}
	return "unknown"
}
