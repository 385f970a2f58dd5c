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
	"go.uber.org/zap/zapcore"

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
	root := newRoot(stdout, stderr)
	root.SetArgs(args)
	err := root.Execute()
	if err != nil && !errors.Is(err, errNeedsAttention) {
		fmt.Fprintf(stderr, "outbox-relay: %v\n", err)
	}
	return exitCode(err)
}

// cli carries what every command needs.
type cli struct {
	stdout, stderr io.Writer
	configFile     string
	flags          *pflag.FlagSet // the config-key flags
}

func newRoot(stdout, stderr io.Writer) *cobra.Command {
	c := &cli{stdout: stdout, stderr: stderr}
	root := &cobra.Command{
		Use:   "outbox-relay [--config FILE] <command>",
		Short: "Relay a SQLite transactional outbox to NATS JetStream",
		Long: `outbox-relay claims due rows of a SQLite outbox table, publishes each to NATS
JetStream with Nats-Msg-Id set to its event id, and marks it done once the
stream has acknowledged it. "run" is the default command.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usagef("unknown command %q (see outbox-relay --help)", args[0])
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error { return c.runDaemon(cmd) },
	}
	root.CompletionOptions.DisableDefaultCmd = true
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.PersistentFlags().StringVar(&c.configFile, "config", "", "YAML configuration file")
	config.BindFlags(root.PersistentFlags())
	c.flags = root.PersistentFlags()

	root.AddCommand(
		&cobra.Command{
			Use:   "run",
			Short: "Run the relay daemon (the default)",
			Args:  cobra.NoArgs,
			RunE:  func(cmd *cobra.Command, _ []string) error { return c.runDaemon(cmd) },
		},
		c.migrateCommand(),
		c.streamsyncCommand(),
		c.statusCommand(),
		c.auditCommand(),
		c.deadLettersCommand(),
		c.healthcheckCommand(),
		c.demoAppCommand(),
		c.benchCommand(),
		c.benchClientCommand(),
		c.demoCommand(),
		&cobra.Command{
			Use:   "version",
			Short: "Print version, commit and Go version",
			Args:  cobra.NoArgs,
			RunE: func(*cobra.Command, []string) error {
				fmt.Fprintf(stdout, "outbox-relay %s (commit %s, %s)\n", version, buildCommit(), runtime.Version())
				return nil
			},
		},
	)
	// Flag and argument errors of every subcommand are usage errors too.
	var all []*cobra.Command
	var walk func(*cobra.Command)
	walk = func(c *cobra.Command) {
		for _, sub := range c.Commands() {
			all = append(all, sub)
			walk(sub)
		}
	}
	walk(root)
	for _, sub := range all {
		sub.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
		if sub.Args != nil {
			check := sub.Args
			sub.Args = func(cmd *cobra.Command, args []string) error {
				if err := check(cmd, args); err != nil {
					return usageError{err}
				}
				return nil
			}
		}
	}
	return root
}

// loadConfig reads the configuration from file, environment and flags.
func (c *cli) loadConfig() (config.Config, error) {
	return config.Load(c.configFile, c.flags)
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

// newLogger builds the root logger from the log section.
func newLogger(cfg config.Log, w io.Writer) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(cfg.Level)
	if err != nil {
		return nil, &config.Error{Err: fmt.Errorf("log.level: %w", err)}
	}
	enc := zap.NewProductionEncoderConfig()
	enc.TimeKey = "ts"
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	var encoder zapcore.Encoder
	if cfg.Format == "console" {
		enc.EncodeLevel = zapcore.CapitalLevelEncoder
		encoder = zapcore.NewConsoleEncoder(enc)
	} else {
		encoder = zapcore.NewJSONEncoder(enc)
	}
	// Locked: NATS callbacks log from their own goroutines.
	core := zapcore.NewCore(encoder, zapcore.Lock(zapcore.AddSync(w)), level)
	return zap.New(core), nil
}
