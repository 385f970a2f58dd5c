package main

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/fleet"
)

// tenantsNamed is how many tenants an error asking for --db names as
// examples: enough to show what a name looks like, few enough for a line.
const tenantsNamed = 5

// withDB gives cmd the --db flag, among its own flags: the commands that
// read one database (status, audit, dead-letters) work on one file of a
// fleet, which --db chooses.
func (c *cli) withDB(cmd *cobra.Command) *cobra.Command {
	cmd.Flags().StringVar(&c.db, "db", "", "when database.path is a fleet's pattern, the file to work on: its "+
		"`TENANT` (acme), file name (acme.db) or path")
	return cmd
}

// chooseDB returns the file the command works on: database.path itself
// when it names one file, else the file of its fleet that --db names.
// --db is required on a fleet, since a command that changes or lists rows
// must not guess which tenant's; with a single file, --db must name it,
// so that a --db meant for a fleet never acts on another file.
func (c *cli) chooseDB(path string) (string, error) {
	if !fleet.IsPattern(path) {
		if c.db != "" && !designates(c.db, path) {
			return "", usagef("--db %q: database.path %s is a single file, not a fleet's pattern; drop --db, or set database.path to the fleet's pattern (such as /data/tenants/*.db)", c.db, path)
		}
		return path, nil
	}
	if c.db == "" {
		return "", fleetNeedsDB(path)
	}
	pattern, name := path, c.db
	if strings.ContainsRune(name, filepath.Separator) {
		// A path as the operator typed it, against matches of the pattern
		// as configured: compared absolute.
		pattern, name = absolute(pattern), absolute(name)
	}
	file, err := fleet.Find(pattern, name)
	if err != nil {
		return "", fmt.Errorf("--db: %w%s", err, tenantExamples(path))
	}
	return file, nil
}

// fleetNeedsDB is the error of a command given a fleet without --db: it
// says how many files there are and names a few tenants to choose from.
func fleetNeedsDB(pattern string) error {
	files, err := fleet.Files(pattern)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("database.path %s is a fleet's pattern that matches no file: check database.path (status lists a fleet's files)", pattern)
	}
	return usagef("database.path %s is a fleet of %d files: choose one with --db TENANT%s", pattern, len(files), tenantExamples(pattern))
}

// tenantExamples lists the first tenants of pattern's fleet, for an error
// that asks for one: " (tenants: a, b, c, and 4 more)"; empty when there
// are none.
func tenantExamples(pattern string) string {
	files, err := fleet.Files(pattern)
	if err != nil || len(files) == 0 {
		return ""
	}
	var names []string
	for _, f := range files[:min(len(files), tenantsNamed)] {
		names = append(names, fleet.Tenant(f))
	}
	more := ""
	if n := len(files) - len(names); n > 0 {
		more = fmt.Sprintf(", and %d more (status lists them all)", n)
	}
	return fmt.Sprintf(" (tenants: %s%s)", strings.Join(names, ", "), more)
}

// designates reports whether name, as --db takes it, names the single
// file at path: its path, file name or tenant.
func designates(name, path string) bool {
	return name == fleet.Tenant(path) || name == filepath.Base(path) || absolute(name) == absolute(path)
}

// absolute is path made absolute, or as given when it cannot be.
func absolute(path string) string {
	if abs, err := filepath.Abs(path); err == nil {
		return abs
	}
	return path
}
