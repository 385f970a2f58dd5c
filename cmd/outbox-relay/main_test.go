package main

import (
	"bufio"
	"bytes"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// runCLI runs the command line in-process and returns exit code and output.
func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestVersion(t *testing.T) {
	code, out, _ := runCLI(t, "version")
	if code != 0 || !strings.HasPrefix(out, "outbox-relay ") || !strings.Contains(out, "go1.") {
		t.Fatalf("version: %d %q", code, out)
	}
}

func TestUsageErrorsExit2(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(bad, []byte("relay:\n  batch_sise: 10\n"), 0o600)
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{args: []string{"frobnicate"}, want: `unknown command "frobnicate"`},
		{args: []string{"run", "--no-such-flag"}, want: "unknown flag"},
		{args: []string{"--config", bad, "migrate"}, want: "relay.batch_sise"},
		{args: []string{"migrate"}, env: map[string]string{"OUTBOX_RELAY_RELAY_LEASE": "ten minutes"}, want: "relay.lease"},
		{args: []string{"migrate", "--relay-poll-interval", "fast"}, want: "relay-poll-interval"},
		{args: []string{"run"}, env: map[string]string{"NATS_MODE": "kafka"}, want: "nats.mode"},
		{args: []string{"bench"}, want: "not implemented yet"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			code, _, errOut := runCLI(t, tc.args...)
			if code != exitUsage || !strings.Contains(errOut, tc.want) {
				t.Fatalf("exit %d, stderr %q; want 2 and %q", code, errOut, tc.want)
			}
		})
	}
}

func TestMigrateCommand(t *testing.T) {
	path := filepath.Join(t.TempDir(), "new.db")
	code, out, errOut := runCLI(t, "migrate", "--database-path", path)
	if code != 0 || !strings.Contains(out, "applied migrations [101 102]") {
		t.Fatalf("migrate: %d %q %q", code, out, errOut)
	}
	code, out, _ = runCLI(t, "migrate", "--database-path", path)
	if code != 0 || !strings.Contains(out, "up to date") {
		t.Fatalf("second migrate: %d %q", code, out)
	}
}

// binary builds the outbox-relay binary once per test run.
var binary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "outbox-relay-bin-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "outbox-relay")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build: %v: %s", err, out)
	}
	return bin, nil
})

func buildBinary(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin, err := binary()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

func TestMissingDatabaseIsReported(t *testing.T) {
	path := filepath.Join(t.TempDir(), "absent.db")
	code, _, errOut := runCLI(t, "run", "--database-path", path, "--nats-url", "nats://127.0.0.1:1", "--metrics-listen", "")
	if code != exitRuntime || !strings.Contains(errOut, path) || !strings.Contains(errOut, "does not exist") {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
}

// TestRunDaemonEmbedded runs the real binary with the embedded server:
// rows flow, /metrics and /readyz answer, SIGTERM exits 0.
func TestRunDaemonEmbedded(t *testing.T) {
	bin := buildBinary(t)
	dir := t.TempDir()
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	var evs []testenv.Event
	for i := 0; i < 500; i++ {
		evs = append(evs, testenv.NewEvent("DaemonThing", []byte(fmt.Sprint(i))))
	}
	if err := testenv.Insert(app, evs...); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "NATS_URL=embedded", "OUTBOX_RELAY_NATS_EMBEDDED_STORE_DIR="+filepath.Join(dir, "nats"), "OUTBOX_RELAY_LOG_LEVEL=debug")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := make(chan map[string]any, 1000)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) != nil {
				m = map[string]any{"msg": "unparsed: " + sc.Text()}
			}
			lines <- m
		}
		close(lines)
	}()
	var logs []map[string]any
	var metricsAddr string
	deadline := time.After(30 * time.Second)
	for metricsAddr == "" {
		select {
		case m := <-lines:
			logs = append(logs, m)
			if m["msg"] == "serving metrics" {
				metricsAddr = m["listen"].(string)
			}
		case <-deadline:
			t.Fatalf("no 'serving metrics' line; logs %v", logs)
		}
	}
	testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 500 })
	body := httpGet(t, "http://"+metricsAddr+"/metrics")
	if !strings.Contains(body, "outbox_relay_published_total 500") {
		t.Errorf("/metrics lacks published_total 500")
	}
	if got := httpGet(t, "http://"+metricsAddr+"/readyz"); got != "ok\n" {
		t.Errorf("/readyz %q", got)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for m := range lines {
		logs = append(logs, m)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v; logs %v", err, logs)
	}
	var stopped bool
	for _, m := range logs {
		if m["msg"] == "relay stopped" {
			stopped = true
		}
	}
	if !stopped {
		t.Fatalf("no 'relay stopped' line: %v", logs)
	}
}

// TestDemoRuns runs the quickstart for a few seconds.
func TestDemoRuns(t *testing.T) {
	bin := buildBinary(t)
	dir := t.TempDir()
	out, err := exec.Command(bin, "demo", "--dir", dir, "--duration", "3s", "--rate", "300").CombinedOutput()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	text := string(out)
	for _, want := range []string{"stream info EVENTS", "published", "demo stopped"} {
		if !strings.Contains(text, want) {
			t.Errorf("demo output lacks %q:\n%s", want, text)
		}
	}
	db, err := sql.Open("sqlite3", "file:"+filepath.Join(dir, "app.db")+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	counts := testenv.Counts(t, db)
	if counts["done"] < 300 || counts["pending"]+counts["processing"]+counts["dead_lettered"] != 0 {
		t.Fatalf("demo database: %v", counts)
	}
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	resp, err := httpClient.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

var httpClient = &http.Client{Timeout: 10 * time.Second}

// TestReadmeDocumentsEveryKey keeps the README's configuration table and
// the config struct from drifting apart.
func TestReadmeDocumentsEveryKey(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range config.Keys() {
		if !bytes.Contains(readme, []byte("`"+k.Name+"`")) {
			t.Errorf("README does not document %s", k.Name)
		}
	}
}
