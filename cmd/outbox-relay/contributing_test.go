package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestContributingMapsEveryPackage: CONTRIBUTING.md's table of where
// things live names every directory of the repository that holds Go code
// (a name ending in "/" stands for everything below it), and every path
// it names exists.
func TestContributingMapsEveryPackage(t *testing.T) {
	text := readRepoFile(t, "CONTRIBUTING.md")
	_, table, ok := strings.Cut(text, "## Where things live")
	if !ok {
		t.Fatal(`CONTRIBUTING.md has no "Where things live" section`)
	}
	table, _, _ = strings.Cut(table, "\n## ")
	var listed []string
	for line := range strings.Lines(table) {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		first, _, _ := strings.Cut(strings.TrimPrefix(line, "|"), "|")
		for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(first, -1) {
			listed = append(listed, m[1])
		}
	}
	root := "../.."
	for _, p := range listed {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Errorf("CONTRIBUTING.md names %s, which is not in the tree", p)
		}
	}
	covered := func(dir string) bool {
		return slices.ContainsFunc(listed, func(p string) bool {
			return p == dir || strings.HasSuffix(p, "/") && strings.HasPrefix(dir+"/", p)
		})
	}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") && path != root || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		dir, _ := filepath.Rel(root, filepath.Dir(path))
		if dir != "." && !covered(filepath.ToSlash(dir)) {
			t.Errorf("%s holds Go code, but CONTRIBUTING.md's table of where things live does not name it", dir)
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
