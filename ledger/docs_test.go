package ledger_test

import (
	"os"
	"strings"
	"testing"
)

// TestDocsWorkerIsTheExample: the Go worker in docs/ledger.md is the
// example's work function, character for character, so that the page's
// code compiles and runs (Example_worker).
func TestDocsWorkerIsTheExample(t *testing.T) {
	src, err := os.ReadFile("example_worker_test.go")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../docs/ledger.md")
	if err != nil {
		t.Fatal(err)
	}
	from := strings.Index(string(src), "func work(")
	to := strings.Index(string(src)[from:], "\n}\n")
	if from < 0 || to < 0 {
		t.Fatal("example_worker_test.go has no func work")
	}
	fn := string(src)[from : from+to+3]
	if !strings.Contains(string(doc), "```go\n"+fn+"```\n") {
		t.Fatalf("docs/ledger.md does not show the example's worker as it is; paste this in its Go block:\n%s", fn)
	}
}
