package fleet

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestFilesLeavesOutSQLitesOwnFiles(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"b.db", "a.db", "a.db-wal", "a.db-shm", "b.db-journal", "notes.txt"} {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "c.db"), 0o700); err != nil {
		t.Fatal(err)
	}
	got, err := Files(filepath.Join(dir, "*"))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(dir, "a.db"), filepath.Join(dir, "b.db"), filepath.Join(dir, "notes.txt")}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Files(*) = %q, want %q", got, want)
	}
	if got, _ := Files(filepath.Join(dir, "*.db")); len(got) != 2 {
		t.Fatalf("Files(*.db) = %q, want a.db and b.db", got)
	}
}

func TestTenantsAndPatterns(t *testing.T) {
	for path, tenant := range map[string]string{"/data/acme.db": "acme", "/data/acme.corp.sqlite3": "acme.corp", "/data/globex": "globex"} {
		if got := Tenant(path); got != tenant {
			t.Errorf("Tenant(%q) = %q, want %q", path, got, tenant)
		}
	}
	for path, is := range map[string]bool{"/data/*.db": true, "/data/t-?.db": true, "/data/[ab].db": true, "/data/app.db": false, "/da*ta/app.db": false} {
		if IsPattern(path) != is {
			t.Errorf("IsPattern(%q) = %v, want %v", path, !is, is)
		}
	}
	if _, err := Files("/data/[.db"); err == nil || !strings.Contains(err.Error(), "database.path") {
		t.Errorf("a malformed pattern: %v, want an error naming database.path", err)
	}
}

func TestFindByTenantOrFileName(t *testing.T) {
	dir := t.TempDir()
	acme := filepath.Join(dir, "acme.db")
	if err := os.WriteFile(acme, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	pattern := filepath.Join(dir, "*.db")
	for _, name := range []string{"acme", "acme.db", acme} {
		if got, err := Find(pattern, name); err != nil || got != acme {
			t.Errorf("Find(%q) = %q, %v; want %q", name, got, err, acme)
		}
	}
	if _, err := Find(pattern, "globex"); err == nil || !strings.Contains(err.Error(), `"globex"`) {
		t.Errorf("Find(globex) = %v, want an error naming it", err)
	}
}
