// Package fleet names the database files of a fleet: a database.path whose
// file name is a glob pattern (/data/tenants/*.db) stands for every file
// that matches it, each the database of one tenant, named by its file.
package fleet

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// IsPattern reports whether path names a fleet: its file name holds a
// glob pattern ('*', '?' or '[').
func IsPattern(path string) bool {
	return strings.ContainsAny(filepath.Base(path), "*?[")
}

// Tenant returns the tenant of a database file: its file name without
// the extension (acme.db is acme's).
func Tenant(path string) string {
	base := filepath.Base(path)
	return strings.TrimSuffix(base, filepath.Ext(base))
}

// sidecars are the files SQLite and the relay keep beside a database,
// which a pattern such as "*" matches too but are no tenant's database.
var sidecars = []string{"-wal", "-shm", "-journal", ".nats"}

// Files lists the regular files that match pattern, sorted, leaving out
// SQLite's own files beside a database (-wal, -shm, -journal).
func Files(pattern string) ([]string, error) {
	if _, err := filepath.Match(filepath.Base(pattern), ""); err != nil {
		return nil, fmt.Errorf("database.path %q: %w", pattern, err)
	}
	matches, err := filepath.Glob(pattern)
	if err != nil {
		return nil, fmt.Errorf("database.path %q: %w", pattern, err)
	}
	files := matches[:0]
	for _, m := range matches {
		if sidecar(m) {
			continue
		}
		if fi, err := os.Stat(m); err != nil || !fi.Mode().IsRegular() {
			continue // gone since, or a directory
		}
		files = append(files, m)
	}
	sort.Strings(files)
	return files, nil
}

// DirProblem says why the directory of pattern cannot be matched now (nil:
// it can): it is missing or is not a directory (gone: its files are gone
// too), or it cannot be read (gone false: its files may be there still,
// and filepath.Glob would say nothing).
func DirProblem(pattern string) (gone bool, err error) {
	dir := filepath.Dir(pattern)
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return true, fmt.Errorf("the database directory %s is missing", dir)
	case err != nil:
		return false, fmt.Errorf("cannot read the database directory: %w", err)
	case !fi.IsDir():
		return true, fmt.Errorf("the database directory %s is not a directory", dir)
	}
	d, err := os.Open(dir)
	if err == nil {
		_, err = d.Readdirnames(1)
		d.Close()
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return false, fmt.Errorf("cannot read the database directory: %w", err)
	}
	return false, nil
}

func sidecar(path string) bool {
	for _, s := range sidecars {
		if strings.HasSuffix(path, s) {
			return true
		}
	}
	return false
}

// Find returns the file of pattern's fleet that name designates: a
// tenant's name, or a path or file name matching the pattern.
func Find(pattern, name string) (string, error) {
	files, err := Files(pattern)
	if err != nil {
		return "", err
	}
	for _, f := range files {
		if name == Tenant(f) || name == f || name == filepath.Base(f) {
			return f, nil
		}
	}
	return "", fmt.Errorf("no database of %s is named %q (%d files match; name one by its tenant or its file name)", pattern, name, len(files))
}
