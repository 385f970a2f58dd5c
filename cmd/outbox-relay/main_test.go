package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/bench"
	"github.com/outbox-relay/outbox-relay/internal/child"
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
		{args: []string{"run", "--relay-poll-interval", "fast"}, want: "relay-poll-interval"},
		{args: []string{"migrate", "--relay-poll-interval", "1s"}, want: "unknown flag: --relay-poll-interval"},
		{args: []string{"run"}, env: map[string]string{"NATS_MODE": "kafka"}, want: "nats.mode"},
		{args: []string{"bench", "--rows", "0"}, want: "--rows must be positive"},
		{args: []string{"bench", "--keys", "-1"}, want: "--keys"},
		{args: []string{"bench", "--group", "1001"}, want: "--group must be between 0 and 1000"},
		{args: []string{"bench-client", "--messages", "-1"}, want: "--messages"},
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
	// Every migration, from the first; later ones are added as the schema grows.
	if code != 0 || !regexp.MustCompile(`applied migrations \[101 102 103 104 105 106( \d+)*\] to event_queue`).MatchString(out) {
		t.Fatalf("migrate: %d %q %q", code, out, errOut)
	}
	code, out, _ = runCLI(t, "migrate", "--database-path", path)
	if code != 0 || !strings.Contains(out, "up to date") {
		t.Fatalf("second migrate: %d %q", code, out)
	}
}

// binDir holds the binary that binary builds; TestMain removes it.
var binDir string

// TestMain removes the built binary once every test has run.
func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// binary builds the outbox-relay binary once per test run.
var binary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "outbox-relay-bin-")
	if err != nil {
		return "", err
	}
	binDir = dir
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

// process is an outbox-relay command running as a child of the test.
type process struct {
	*child.Process
	t *testing.T
}

// startDaemon runs the binary with args and extra environment, at debug
// level.
func startDaemon(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	cmd := exec.Command(buildBinary(t), args...)
	cmd.Env = append(append(os.Environ(), "OUTBOX_RELAY_LOG_LEVEL=debug"), env...)
	return startProcess(t, cmd)
}

// startProcess starts cmd, a command of the binary; the test's end kills
// it.
func startProcess(t *testing.T, cmd *exec.Cmd) *process {
	t.Helper()
	p, err := child.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	d := &process{Process: p, t: t}
	// A failed test shows what the process wrote: failure messages need
	// not.
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s wrote:\n%s", cmd.Args, d.log())
		}
	})
	return d
}

// exitWithin waits up to limit for the process to exit by itself and
// returns its exit code.
func (d *process) exitWithin(limit time.Duration) int {
	d.t.Helper()
	select {
	case <-d.Exited():
	case <-time.After(limit):
		d.t.Fatalf("outbox-relay still runs after %v", limit)
	}
	return d.State().ExitCode()
}

// waitFor waits for a log line with message msg and returns its fields.
func (d *process) waitFor(msg string) map[string]any {
	d.t.Helper()
	line, err := d.WaitFor(msg, 30*time.Second)
	if err != nil {
		d.t.Fatalf("outbox-relay %v", err)
	}
	return line.Fields
}

// stop sends SIGTERM and expects exit code 0.
func (d *process) stop() {
	d.t.Helper()
	if err := d.Stop(syscall.SIGTERM, time.Minute); err != nil {
		d.t.Fatalf("outbox-relay after SIGTERM: %v", err)
	}
}

// log is every line the process has written.
func (d *process) log() string {
	var b strings.Builder
	for _, l := range d.Lines() {
		b.WriteString(l.Text + "\n")
	}
	return b.String()
}

// levels counts log lines per level.
func (d *process) levels() map[string]int {
	out := map[string]int{}
	for _, l := range d.Lines() {
		out[fmt.Sprint(l.Fields["level"])]++
	}
	return out
}

// TestRunDaemonEmbedded runs the real binary with the embedded server:
// rows flow, /metrics and /readyz answer, SIGTERM exits 0.
func TestRunDaemonEmbedded(t *testing.T) {
	dir := t.TempDir()
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 500, "DaemonThing")
	d := startDaemon(t, []string{"NATS_URL=embedded", "OUTBOX_RELAY_NATS_EMBEDDED_STORE_DIR=" + filepath.Join(dir, "nats")},
		"run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	metricsAddr := d.waitFor("serving metrics")["listen"].(string)
	testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 500 })
	// The counter moves right after the commit that marks the rows done.
	testenv.Eventually(t, 10*time.Second, "published_total 500 on /metrics", func() bool {
		return strings.Contains(httpGet(t, "http://"+metricsAddr+"/metrics"), "outbox_relay_published_total 500")
	})
	if got := httpGet(t, "http://"+metricsAddr+"/readyz"); !strings.HasPrefix(got, "ok: leading, ") {
		t.Errorf("/readyz %q", got)
	}
	// status reads the file while the relay runs, and sees the relay.
	code, out, errOut := runCLI(t, "status", "--database-path", path, "--json")
	var st struct {
		Rows   map[string]int64 `json:"rows"`
		Relays []any            `json:"relays"`
	}
	if err := json.Unmarshal([]byte(out), &st); code != 0 || err != nil || st.Rows["done"] != 500 || len(st.Relays) != 1 {
		t.Errorf("status while running: %d %v %+v %s", code, err, st, errOut)
	}
	// The image's healthcheck probes /healthz: 0 while the relay runs, 1 after.
	if code, out, errOut := runCLI(t, "healthcheck", "--url", "http://"+metricsAddr+"/healthz"); code != 0 || !strings.Contains(out, "200") {
		t.Errorf("healthcheck of a running relay: %d %q %q", code, out, errOut)
	}
	d.stop()
	if len(d.Find("relay stopped")) != 1 {
		t.Fatal("no 'relay stopped' line")
	}
	if code, _, errOut := runCLI(t, "healthcheck", "--url", "http://"+metricsAddr+"/healthz"); code != 1 || !strings.Contains(errOut, metricsAddr) {
		t.Errorf("healthcheck of a stopped relay: %d %q", code, errOut)
	}
}

// TestDemoAppWrites runs the compose demo's example application: it
// creates the schema and writes events until stopped.
func TestDemoAppWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	d := startDaemon(t, nil, "demo-app", "--database-path", path, "--rate", "50")
	d.waitFor("demo application writing events") // the schema exists from here on
	app := testenv.AppDB(t, path)
	testenv.Eventually(t, 30*time.Second, "events written", func() bool { return testenv.Counts(t, app)["pending"] >= 20 })
	d.stop()
}

// operatorStream creates the stream an operator made by hand before the
// relay existed (the server's 2 min dedup window) and a consumer with
// max_deliver 3.
func operatorStream(t *testing.T, js jetstream.JetStream, maxAge time.Duration) jetstream.StreamConfig {
	t.Helper()
	ctx := context.Background()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "EVENTS", Description: "made by hand", Subjects: []string{"events.>", "audit.>"}, MaxAge: maxAge,
		MaxMsgSize: 1 << 20, Discard: jetstream.DiscardOld, Metadata: map[string]string{"owner": "ops"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "worker", Description: "app worker", MaxDeliver: 3,
		MaxAckPending: 50, FilterSubject: "events.>", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	return s.CachedInfo().Config
}

// TestStartupReconciles: the daemon patches the window and the consumer's
// delivery limits at startup, logs each change at warn level, counts them,
// and on the next start has nothing to say.
func TestStartupReconciles(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	before := operatorStream(t, js, 0)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 50, "Reconciled")
	env := []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_CONSUMER_DURABLE=worker", "EVENT_QUEUE_MAX_ATTEMPTS=7"}
	d := startDaemon(t, env, "run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	metricsAddr := d.waitFor("serving metrics")["listen"].(string)
	testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 50 })
	if got := len(d.Find("patched stream config")) + len(d.Find("patched consumer config")); got != 3 {
		t.Fatalf("%d patch lines, want 3 (duplicate_window, allow_atomic, max_deliver)", got)
	}
	body := httpGet(t, "http://"+metricsAddr+"/metrics")
	for _, want := range []string{`outbox_relay_stream_config_patched_total{field="duplicate_window"} 1`, `outbox_relay_stream_config_patched_total{field="max_deliver"} 1`} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	d.stop()
	ctx := context.Background()
	s, _ := js.Stream(ctx, "EVENTS")
	after := s.CachedInfo().Config
	before.Duplicates, before.AllowAtomicPublish = time.Hour, true
	// The server notes the API level a stream with allow_atomic needs.
	before.Metadata = maps.Clone(before.Metadata)
	if before.Metadata == nil {
		before.Metadata = map[string]string{}
	}
	before.Metadata["_nats.req.level"] = after.Metadata["_nats.req.level"]
	if a, b := fmt.Sprintf("%+v", after), fmt.Sprintf("%+v", before); a != b {
		t.Fatalf("stream after startup:\n%s\nwant\n%s", a, b)
	}
	c, _ := s.Consumer(ctx, "worker")
	if cfg := c.CachedInfo().Config; cfg.MaxDeliver != 7 || cfg.MaxAckPending != 50 || cfg.Description != "app worker" || cfg.FilterSubject != "events.>" {
		t.Fatalf("consumer after startup %+v", cfg)
	}
	again := startDaemon(t, env, "run", "--database-path", path, "--metrics-listen", "")
	again.waitFor("relay starting")
	testenv.InsertN(t, app, 10, "Again")
	testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 60 })
	again.stop()
	if lv := again.levels(); lv["warn"]+lv["error"] != 0 {
		t.Fatal("second startup logged warnings")
	}
}

// TestRejectedUpdateStillPublishes: the server refuses a 1 h window on a
// stream with max_age 30 min; the relay says how to fix it and publishes.
func TestRejectedUpdateStillPublishes(t *testing.T) {
	n := testenv.StartNATS(t)
	operatorStream(t, n.JetStream(t), 30*time.Minute)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 20, "Rejected")
	d := startDaemon(t, []string{"NATS_URL=" + n.URL()}, "run", "--database-path", path, "--metrics-listen", "")
	line := d.waitFor("the server rejected the stream update the relay needs; starting anyway. Fix it by hand with the command")
	if line["command"] != "nats stream edit EVENTS --max-age 1h --dupe-window 1h -f" || line["level"] != "warn" {
		t.Fatalf("rejection line %v", line)
	}
	testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 20 })
	d.stop()
}

// TestStreamsyncCommand: --dry-run lists the drift and changes nothing;
// without it the changes are applied; a rejected update exits 1 with the
// command to run.
func TestStreamsyncCommand(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	before := operatorStream(t, js, 0)
	t.Setenv("NATS_URL", n.URL())
	t.Setenv("OUTBOX_RELAY_CONSUMER_DURABLE", "worker")
	code, out, errOut := runCLI(t, "streamsync", "--dry-run")
	if code != 0 || !strings.Contains(out, "duplicate_window   2m -> 1h") || !strings.Contains(out, "max_deliver        3 -> 10") || !strings.Contains(out, "nothing applied") {
		t.Fatalf("dry run: exit %d\n%s%s", code, out, errOut)
	}
	code, out, _ = runCLI(t, "streamsync", "--dry-run", "--json")
	var plan struct {
		DryRun  bool `json:"dry_run"`
		Changes struct {
			Stream []struct{ Field, Old, New string } `json:"stream"`
		} `json:"changes"`
	}
	if err := json.Unmarshal([]byte(out), &plan); err != nil || code != 0 || !plan.DryRun || len(plan.Changes.Stream) != 2 || plan.Changes.Stream[0].New != "1h" || plan.Changes.Stream[1].Field != "allow_atomic" {
		t.Fatalf("dry run --json: exit %d, %v\n%s", code, err, out)
	}
	s, _ := js.Stream(context.Background(), "EVENTS")
	if got := s.CachedInfo().Config; fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", before) {
		t.Fatal("--dry-run changed the stream")
	}
	code, out, _ = runCLI(t, "streamsync")
	if code != 0 || !strings.Contains(out, "applied 3 change(s)") {
		t.Fatalf("streamsync: exit %d\n%s", code, out)
	}
	code, out, _ = runCLI(t, "streamsync", "--dry-run")
	if code != 0 || !strings.Contains(out, "in sync") {
		t.Fatalf("after applying: exit %d\n%s", code, out)
	}

	n2 := testenv.StartNATS(t)
	operatorStream(t, n2.JetStream(t), 30*time.Minute)
	t.Setenv("NATS_URL", n2.URL())
	code, out, _ = runCLI(t, "streamsync", "--log-level", "error")
	if code != exitRuntime || !strings.Contains(out, "fix it by hand: nats stream edit EVENTS --max-age 1h --dupe-window 1h -f") {
		t.Fatalf("rejected: exit %d\n%s", code, out)
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

// TestReadmeRecipes keeps the README's promises to a new user without
// pinning its prose: it opens with the two commands (the embedded demo and
// the test suite), .ci/run runs that test command, it links every page in
// docs/ and CONTRIBUTING.md, CHANGELOG.md and LICENSE, every file it or a
// docs page links to exists, and the pages it sends operators to hold the
// recipes: the compose and systemd ones in docs/operations.md, the bench
// command that measured the performance targets in docs/performance.md.
func TestReadmeRecipes(t *testing.T) {
	readme := readRepoFile(t, "README.md")
	first := strings.SplitN(readme, "```", 3)
	if len(first) < 3 || !strings.Contains(first[1], "go run ./cmd/outbox-relay demo") || !strings.Contains(first[1], "go test -race -timeout 30m ./...") {
		t.Fatalf("the README's first code block is not the two commands:\n%s", first[min(1, len(first)-1)])
	}
	if ci := readRepoFile(t, ".ci/run"); !strings.Contains(ci, "\ngo test -race -timeout 30m ./...\n") {
		t.Error(".ci/run does not run the README's test command")
	}

	entries, err := os.ReadDir("../../docs")
	if err != nil {
		t.Fatal(err)
	}
	pages := map[string]string{"README.md": readme}
	var want []string
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		name := "docs/" + e.Name()
		want = append(want, name)
		if strings.HasSuffix(name, ".md") {
			pages[name] = readRepoFile(t, name)
		}
	}
	if len(want) == 0 {
		t.Fatal("docs/ holds no pages")
	}
	want = append(want, "CONTRIBUTING.md", "CHANGELOG.md", "LICENSE")
	links := relativeLinks(readme)
	if len(links) == 0 {
		t.Fatal("found no relative links in the README: the link parser is broken")
	}
	linked := map[string]bool{}
	for _, l := range links {
		linked[filepath.ToSlash(filepath.Clean(l))] = true
	}
	for _, w := range want {
		if !linked[w] {
			t.Errorf("README does not link %s", w)
		}
	}
	for page, text := range pages {
		for _, l := range relativeLinks(text) {
			if _, err := os.Stat(filepath.Join("../..", filepath.Dir(page), l)); err != nil {
				t.Errorf("%s links %s, which does not exist", page, l)
			}
		}
	}

	for file, wants := range map[string][]string{
		"docs/operations.md":  {"deploy/docker-compose.yml", "systemctl enable --now outbox-relay"},
		"docs/performance.md": {"go run ./cmd/outbox-relay bench --done-rows 1000000 --rate 1000 --duration 30s --idle 60s"},
	} {
		text := readRepoFile(t, file)
		for _, w := range wants {
			if !strings.Contains(text, w) {
				t.Errorf("%s lacks %q", file, w)
			}
		}
	}
}

// readRepoFile returns a file of the repository, named from its root.
func readRepoFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("../..", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// relativeLinks returns the targets of the Markdown links in text that
// name a file of the repository ([text](target)), without their #fragment:
// not web addresses, not links within the page.
func relativeLinks(text string) []string {
	var out []string
	parts := strings.Split(text, "](")
	for _, p := range parts[1:] {
		end := strings.IndexAny(p, ") \n")
		if end < 0 {
			continue
		}
		target, _, _ := strings.Cut(p[:end], "#")
		if target == "" || strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
			continue
		}
		out = append(out, target)
	}
	return out
}

// TestSchemaModes: verify refuses a file without the outbox schema and
// names what is missing; off leaves the file alone.
func TestSchemaModes(t *testing.T) {
	n := testenv.StartNATS(t)
	path := filepath.Join(t.TempDir(), "app.db")
	empty, err := sql.Open("sqlite3", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	defer empty.Close()
	if _, err := empty.Exec(`CREATE TABLE app_data (id INTEGER PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(buildBinary(t), "run", "--database-path", path, "--metrics-listen", "")
	cmd.Env = append(os.Environ(), "NATS_URL="+n.URL(), "OUTBOX_RELAY_SCHEMA_MODE=verify")
	out, err := cmd.CombinedOutput()
	if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(string(out), "event_queue") {
		t.Fatalf("schema.mode verify on a file without the outbox: exit %d (%v)\n%s", code, err, out)
	}
	// Off checks nothing, but a missing table cannot heal by waiting.
	cmd = exec.Command(buildBinary(t), "run", "--database-path", path, "--metrics-listen", "")
	cmd.Env = append(os.Environ(), "NATS_URL="+n.URL(), "OUTBOX_RELAY_SCHEMA_MODE=off")
	out, err = cmd.CombinedOutput()
	if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(string(out), "no table event_queue") || !strings.Contains(string(out), "schema.mode is off") {
		t.Fatalf("schema.mode off on a file without the outbox: exit %d (%v)\n%s", code, err, out)
	}
	var tables []string
	rows, err := empty.Query(`SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var name string
		rows.Scan(&name)
		tables = append(tables, name)
	}
	rows.Close()
	if fmt.Sprint(tables) != "[app_data]" {
		t.Fatalf("schema.mode verify or off changed the schema: tables %v", tables)
	}
}

// TestLogLevelAndFormat: log.format console writes lines for people,
// json (the default) one object a line; log.level warn drops info lines.
func TestLogLevelAndFormat(t *testing.T) {
	bin := buildBinary(t)
	// logs runs the demo application until it has committed events (so it
	// is past the line below, whatever the level), and returns its log.
	logs := func(env ...string) string {
		t.Helper()
		path := filepath.Join(t.TempDir(), "app.db")
		cmd := exec.Command(bin, "demo-app", "--database-path", path)
		cmd.Env = append(os.Environ(), env...)
		d := startProcess(t, cmd)
		testenv.Eventually(t, 30*time.Second, "the demo application's first events", func() bool {
			db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
			if err != nil {
				return false
			}
			defer db.Close()
			var n int
			return db.QueryRow(`SELECT count(*) FROM event_queue`).Scan(&n) == nil && n > 0
		})
		d.Kill()
		return d.log()
	}
	const started = "demo application writing events"
	if out := logs("OUTBOX_RELAY_LOG_FORMAT=console"); !strings.Contains(out, started) || strings.HasPrefix(out, "{") {
		t.Errorf("console format:\n%s", out)
	}
	out := logs("OUTBOX_RELAY_LOG_FORMAT=json")
	var line map[string]any
	if err := json.Unmarshal([]byte(strings.SplitN(out, "\n", 2)[0]), &line); err != nil || !strings.Contains(out, started) {
		t.Errorf("json format (%v):\n%s", err, out)
	}
	if out := logs("OUTBOX_RELAY_LOG_LEVEL=warn"); strings.Contains(out, started) {
		t.Errorf("log.level warn still logs info lines:\n%s", out)
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

// TestDocsDocumentEveryKey keeps the configuration table in
// docs/configuration.md and the config struct from drifting apart.
func TestDocsDocumentEveryKey(t *testing.T) {
	doc, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range config.Keys() {
		if !bytes.Contains(doc, []byte("`"+k.Name+"`")) {
			t.Errorf("docs/configuration.md does not document %s", k.Name)
		}
	}
}

// httpStatus returns the status code and body of a GET.
func httpStatus(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := httpClient.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestReadyzFollowsTheBroker: /readyz answers 503 with the reason while
// the broker is down and 200 again after it is back; /healthz stays 200.
func TestReadyzFollowsTheBroker(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	d := startDaemon(t, []string{"NATS_URL=" + n.URL()}, "run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	addr := "http://" + d.waitFor("serving metrics")["listen"].(string)
	testenv.Eventually(t, 20*time.Second, "ready", func() bool { code, _ := httpStatus(t, addr+"/readyz"); return code == 200 })
	n.Stop()
	var body string
	testenv.Eventually(t, 20*time.Second, "/readyz 503", func() bool {
		var code int
		code, body = httpStatus(t, addr+"/readyz")
		return code == 503
	})
	if !strings.HasPrefix(body, "broker: ") || strings.Count(body, "\n") != 1 {
		t.Errorf("/readyz reason %q: want one line about the broker", body)
	}
	if code, _ := httpStatus(t, addr+"/healthz"); code != 200 {
		t.Errorf("/healthz %d while the broker is down; the loops still run", code)
	}
	n.Restart()
	testenv.Eventually(t, 30*time.Second, "/readyz 200 again", func() bool { code, _ := httpStatus(t, addr+"/readyz"); return code == 200 })
	d.stop()
}

// TestReadyzFollowsTheDatabase: while database.path does not name the file
// the relay opened, /readyz answers 503 naming it and the relay logs it
// once at error level; moved back, the relay is ready again. Replaced by
// another file (a restore), the relay exits 1 without writing to the old
// file's WAL, which stays beside the new file.
func TestReadyzFollowsTheDatabase(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	d := startDaemon(t, []string{"NATS_URL=" + n.URL()}, "run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	addr := "http://" + d.waitFor("serving metrics")["listen"].(string)
	ready := func() bool { code, _ := httpStatus(t, addr+"/readyz"); return code == 200 }
	testenv.Eventually(t, 20*time.Second, "ready", ready)

	moved := path + ".moved"
	if err := os.Rename(path, moved); err != nil {
		t.Fatal(err)
	}
	if code, body := httpStatus(t, addr+"/readyz"); code != 503 || !strings.HasPrefix(body, "database: database "+path+": ") ||
		!strings.Contains(body, "no such file or directory") || strings.Count(body, "\n") != 1 {
		t.Errorf("/readyz %d %q: want 503 and one line naming %s and the missing file", code, body, path)
	}
	if line := d.waitFor("cannot read the outbox"); line["level"] != "error" || !strings.Contains(fmt.Sprint(line["error"]), path) {
		t.Errorf("log line %v: want error level naming %s", line, path)
	}
	if code, _ := httpStatus(t, addr+"/healthz"); code != 200 {
		t.Errorf("/healthz %d while the file is away; the loops still run", code)
	}
	if err := os.Rename(moved, path); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "/readyz 200 once the file is back", ready)
	d.waitFor("outbox readable again")
	if got := len(d.Find("cannot read the outbox")); got != 1 {
		t.Errorf("%d error lines for one failure; want 1", got)
	}

	// A restore: a copy of the database renamed over it.
	restored := path + ".restored"
	if _, err := app.Exec(`VACUUM INTO ?`, restored); err != nil {
		t.Fatal(err)
	}
	app.Close()
	if err := os.Rename(restored, path); err != nil {
		t.Fatal(err)
	}
	// The old file's -wal stays beside the restored one: once the relay
	// sees the replacement it must not add to it (heartbeats, claims or
	// checkpoints). A write it began before the rename may still commit
	// until then.
	line := d.waitFor("relay cannot go on; exiting without writing to the old file")
	if msg := fmt.Sprint(line["error"]); !strings.Contains(msg, path) || !strings.Contains(msg, "database file replaced") {
		t.Errorf("log line %v: want the path and the replacement", line)
	}
	before, err := os.ReadFile(path + "-wal")
	if err != nil {
		t.Fatal(err)
	}
	if code := d.exitWithin(15 * time.Second); code != exitRuntime {
		t.Fatalf("exit %d after the database was replaced; want %d", code, exitRuntime)
	}
	if after, err := os.ReadFile(path + "-wal"); err != nil || !bytes.Equal(after, before) {
		t.Errorf("the relay wrote to the old file's WAL after it was replaced (%v)", err)
	}
}

// preparedDB has rows in every state, two dead letters among them.
func preparedDB(t *testing.T) (string, *sql.DB) {
	t.Helper()
	path := testenv.NewDB(t)
	db := testenv.AppDB(t, path)
	for _, q := range []string{
		`INSERT INTO event_queue (id, event_id, event_type, payload, status, processed_at) VALUES (1, 'e1', 'A', 'x', 'done', 1000)`,
		`INSERT INTO event_queue (id, event_id, event_type, payload, status, attempts, last_error, processed_at) VALUES (2, 'e2', 'Big', 'x', 'dead_lettered', 10, 'nats: API error: code=400 err_code=10054 description=message size exceeds maximum allowed', 2000)`,
		`INSERT INTO event_queue (id, event_id, event_type, payload, status, attempts, last_error, processed_at) VALUES (3, 'e3', 'bad type', 'x', 'dead_lettered', 1, 'event_type "bad type" cannot form a subject: it contains whitespace', 3000)`,
		`INSERT INTO event_queue (id, event_id, event_type, payload, created_at, available_at) VALUES (4, 'e4', 'A', 'x', 5000, 5000)`,
		`INSERT INTO event_queue (id, event_id, event_type, payload, status, claimed_at, claimed_by) VALUES (5, 'e5', 'A', 'x', 'processing', 6000, 'someone')`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	return path, db
}

func TestStatusCommand(t *testing.T) {
	path, _ := preparedDB(t)
	code, out, errOut := runCLI(t, "status", "--database-path", path, "--json")
	if code != 0 {
		t.Fatalf("status: %d %s", code, errOut)
	}
	var st struct {
		Database  string               `json:"database"`
		Rows      map[string]int64     `json:"rows"`
		OldestAge float64              `json:"oldest_pending_age_seconds"`
		LastDead  []struct{ ID int64 } `json:"last_dead_letters"`
		Relays    []any                `json:"relays"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if st.Database != path || st.Rows["pending"] != 1 || st.Rows["processing"] != 1 || st.Rows["done"] != 1 || st.Rows["dead_lettered"] != 2 {
		t.Fatalf("status %+v", st)
	}
	if st.OldestAge < float64(time.Now().Unix()-10) || len(st.LastDead) != 2 || st.LastDead[0].ID != 3 {
		t.Fatalf("oldest pending age %v, last dead letters %+v", st.OldestAge, st.LastDead)
	}
	code, out, _ = runCLI(t, "status", "--database-path", path)
	if code != 0 || !strings.Contains(out, "pending 1   processing 1   done 1   dead_lettered 2") || !strings.Contains(out, "cannot form a subject") {
		t.Fatalf("status text:\n%s", out)
	}
}

func TestDeadLettersCommands(t *testing.T) {
	path, db := preparedDB(t)
	code, out, _ := runCLI(t, "dead-letters", "list", "--database-path", path, "--json", "--limit", "1")
	var dls []struct {
		ID        int64  `json:"id"`
		EventID   string `json:"event_id"`
		EventType string `json:"event_type"`
		Attempts  int    `json:"attempts"`
		LastError string `json:"last_error"`
		Processed string `json:"processed_at"`
	}
	if err := json.Unmarshal([]byte(out), &dls); err != nil || code != 0 {
		t.Fatalf("list: %d %v\n%s", code, err, out)
	}
	if len(dls) != 1 || dls[0].ID != 3 || dls[0].EventID != "e3" || dls[0].EventType != "bad type" || dls[0].Attempts != 1 ||
		!strings.Contains(dls[0].LastError, "whitespace") || !strings.HasPrefix(dls[0].Processed, "1970-01-01T00:00:03") {
		t.Fatalf("list --limit 1: %+v", dls)
	}
	code, out, _ = runCLI(t, "dead-letters", "list", "--database-path", path)
	if code != 0 || !strings.Contains(out, "EVENT_ID") || !strings.Contains(out, "err_code=10054") {
		t.Fatalf("list text:\n%s", out)
	}
	if code, _, errOut := runCLI(t, "dead-letters", "retry", "--database-path", path); code != exitUsage || !strings.Contains(errOut, "--all or row ids") {
		t.Fatalf("retry without ids: %d %s", code, errOut)
	}
	code, out, _ = runCLI(t, "dead-letters", "retry", "--database-path", path, "2", "4")
	if code != 0 || !strings.Contains(out, "requeued 1 dead-lettered row(s)") {
		t.Fatalf("retry 2 4: %d\n%s", code, out)
	}
	var status, lastError string
	var attempts int
	var availableAt int64
	var processed sql.NullInt64
	db.QueryRow(`SELECT status, attempts, available_at, last_error, processed_at FROM event_queue WHERE id = 2`).Scan(&status, &attempts, &availableAt, &lastError, &processed)
	if status != "pending" || attempts != 0 || time.Since(time.UnixMilli(availableAt)) > time.Minute || !strings.Contains(lastError, "10054") || processed.Valid {
		t.Fatalf("requeued row: %s %d %d %q %v", status, attempts, availableAt, lastError, processed)
	}
	code, out, _ = runCLI(t, "dead-letters", "retry", "--database-path", path, "--all")
	if code != 0 || !strings.Contains(out, "requeued 1 dead-lettered row(s)") {
		t.Fatalf("retry --all: %d\n%s", code, out)
	}
	if c := testenv.Counts(t, db); c["dead_lettered"] != 0 || c["pending"] != 3 {
		t.Fatalf("after retry --all: %v", c)
	}
}

// TestMaxDeliveriesAdvisory: a consumer with max_deliver 2 naks a message
// twice; the relay logs it at error level with the event id, counts it,
// and records it where dead-letters list --consumer shows it.
func TestMaxDeliveriesAdvisory(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	cons, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "worker", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: 2})
	if err != nil {
		t.Fatal(err)
	}
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_CONSUMER_DURABLE=worker", "EVENT_QUEUE_MAX_ATTEMPTS=2"},
		"run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	addr := "http://" + d.waitFor("serving metrics")["listen"].(string)
	d.waitFor("relay starting")
	testenv.Eventually(t, 10*time.Second, "the relay to listen for advisories", func() bool {
		return n.Srv.GlobalAccount().SubscriptionInterest("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.EVENTS.worker")
	})
	ev := testenv.NewEvent("Unprocessable", []byte("nope"))
	if err := testenv.Insert(app, ev); err != nil {
		t.Fatal(err)
	}
	delivered := 0
	for i := 0; i < 2; i++ {
		msgs, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for m := range msgs.Messages() {
			m.Nak()
			delivered++
		}
	}
	if delivered != 2 {
		t.Fatalf("the consumer got the message %d times, want 2", delivered)
	}
	// The server notices the exhausted message when it next looks for one
	// to deliver: ask once more (nothing comes).
	if msgs, err := cons.Fetch(1, jetstream.FetchMaxWait(time.Second)); err == nil {
		for range msgs.Messages() {
			t.Fatal("a third delivery despite max_deliver 2")
		}
	}
	line := d.waitFor("event exhausted max deliveries")
	if line["level"] != "error" || line["event_id"] != *ev.EventID || line["deliveries"] != float64(2) {
		t.Fatalf("log line %v", line)
	}
	if body := httpGet(t, addr+"/metrics"); !strings.Contains(body, "outbox_relay_consumer_exhausted_total 1") {
		t.Error("/metrics lacks consumer_exhausted_total 1")
	}
	d.stop()
	code, out, _ := runCLI(t, "dead-letters", "list", "--consumer", "--json", "--database-path", path)
	var ex []struct {
		EventID    string `json:"event_id"`
		StreamSeq  uint64 `json:"stream_seq"`
		Subject    string `json:"subject"`
		Deliveries int64  `json:"deliveries"`
	}
	if err := json.Unmarshal([]byte(out), &ex); err != nil || code != 0 {
		t.Fatalf("list --consumer: %d %v\n%s", code, err, out)
	}
	if len(ex) != 1 || ex[0].EventID != *ev.EventID || ex[0].StreamSeq != 1 || ex[0].Subject != "events.Unprocessable" || ex[0].Deliveries != 2 {
		t.Fatalf("exhausted records %+v", ex)
	}
}

// TestDeletedStreamIsRecreated: a stream deleted while the relay runs is an
// outage; the relay recreates it (stream.create) and goes on, spending no
// attempts.
func TestDeletedStreamIsRecreated(t *testing.T) {
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	d := startDaemon(t, []string{"NATS_URL=" + n.URL()}, "run", "--database-path", path, "--metrics-listen", "")
	testenv.InsertN(t, app, 10, "Before")
	testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 10 })
	if err := js.DeleteStream(context.Background(), "EVENTS"); err != nil {
		t.Fatal(err)
	}
	testenv.InsertN(t, app, 10, "After")
	testenv.Eventually(t, 60*time.Second, "rows done after the stream was deleted", func() bool { return testenv.Counts(t, app)["done"] == 20 })
	var attempts int
	app.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue`).Scan(&attempts)
	if attempts != 0 {
		t.Fatalf("a deleted stream spent %d attempts", attempts)
	}
	s, err := js.Stream(context.Background(), "EVENTS")
	if err != nil || s.CachedInfo().Config.Duplicates != time.Hour {
		t.Fatalf("stream not recreated as configured: %v", err)
	}
	d.stop()
}

// TestUncapturedPrefixKeepsRelayNotReady: a stream that does not capture
// <prefix>.> makes the relay log the fix, claim nothing and answer 503.
func TestUncapturedPrefixKeepsRelayNotReady(t *testing.T) {
	n := testenv.StartNATS(t)
	if _, err := n.JetStream(t).CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 5, "Waiting")
	d := startDaemon(t, []string{"NATS_URL=" + n.URL()}, "run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	addr := "http://" + d.waitFor("serving metrics")["listen"].(string)
	line := d.waitFor("stream does not capture the relay's subjects; the relay stays not ready until it does")
	if line["level"] != "error" || !strings.Contains(fmt.Sprint(line["fix"]), "nats stream edit EVENTS --subjects 'orders.>,events.>' -f") {
		t.Fatalf("error line %v", line)
	}
	testenv.Eventually(t, 10*time.Second, "/readyz 503", func() bool {
		code, body := httpStatus(t, addr+"/readyz")
		return code == 503 && strings.Contains(body, "does not capture events.>")
	})
	if c := testenv.Counts(t, app); c["pending"] != 5 {
		t.Fatalf("rows touched while not ready: %v", c)
	}
	d.stop()
}

// TestBenchWithConsoleLogs: the bench reads its relay children's logs, so
// a log format chosen for the bench's own process does not stop it from
// seeing a child start.
func TestBenchWithConsoleLogs(t *testing.T) {
	bin := buildBinary(t)
	cmd := exec.Command(bin, "bench", "--rows", "500", "--ceiling-in-flight", "500", "--json")
	cmd.Env = append(os.Environ(), "OUTBOX_RELAY_LOG_FORMAT=console")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("bench with OUTBOX_RELAY_LOG_FORMAT=console: %v\n%s", err, out)
	}
	var rep struct {
		Drain struct {
			Rows int `json:"rows"`
		} `json:"drain"`
	}
	if err := json.Unmarshal(out, &rep); err != nil || rep.Drain.Rows != 500 {
		t.Fatalf("report %s (%v)", out, err)
	}
}

// TestBenchSmoke runs a small bench with the real binary and parses its
// JSON report: every measurement is there and plausible.
func TestBenchSmoke(t *testing.T) {
	bin := buildBinary(t)
	// The relay children serve no metrics: with the default port taken (as
	// by a relay running on the machine), they still start.
	if l, err := net.Listen("tcp", ":9108"); err == nil {
		defer l.Close()
	}
	out, err := exec.Command(bin, "bench", "--rows", "3000", "--ceiling-in-flight", "500,1000", "--done-rows", "5000", "--rate", "200", "--duration", "2s", "--idle", "2s", "--json").Output()
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, out)
	}
	var rep struct {
		Ceiling        float64            `json:"ceiling_rows_per_second"`
		CeilingByBatch map[string]float64 `json:"ceiling_by_batch"`
		Drain          struct {
			Rows       int     `json:"rows"`
			RowsPerSec float64 `json:"rows_per_second"`
			CPU        float64 `json:"cpu_seconds"`
			RSS        float64 `json:"peak_rss_mib"`
			MappedRSS  float64 `json:"mapped_files_mib"`
			LagP50     float64 `json:"lag_p50_ms"`
			LagP99     float64 `json:"lag_p99_ms"`
		} `json:"drain"`
		DrainRatio float64 `json:"drain_to_ceiling"`
		DoneRatio  float64 `json:"with_done_to_empty"`
		Rate       struct {
			Rows       int     `json:"rows"`
			Offered    int     `json:"offered_rate"`
			LagP99     float64 `json:"lag_p99_ms"`
			AckLagRows int     `json:"ack_lag_rows"`
			AckLagP99  float64 `json:"ack_lag_p99_ms"`
			Checkpoint *int    `json:"writer_autocheckpoint"`
			WriterP50  float64 `json:"writer_tx_p50_us"`
			WriterMax  float64 `json:"writer_tx_max_us"`
			CPUPercent float64 `json:"cpu_percent_of_one_core"`
		} `json:"rate"`
		WriterAlone struct {
			Rows      int     `json:"rows"`
			WriterP99 float64 `json:"writer_tx_p99_us"`
		} `json:"writer_alone"`
		WriterRatio float64 `json:"writer_p99_with_relay_to_alone"`
		Client      struct {
			Messages   int     `json:"messages"`
			CPUPercent float64 `json:"cpu_percent_of_one_core"`
		} `json:"standard_client"`
		CPUToClient float64  `json:"relay_cpu_to_standard_client"`
		Idle        *float64 `json:"idle_cpu_percent_of_one_core"`
	}
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if strings.Contains(string(out), "keyed") || strings.Contains(string(out), "sync_client") {
		t.Fatalf("a keyed drain or its sync client without --keys:\n%s", out)
	}
	if rep.Ceiling <= 0 || len(rep.CeilingByBatch) != 2 || rep.Drain.Rows != 3000 || rep.Drain.RowsPerSec <= 0 || rep.Drain.CPU <= 0 || rep.Drain.RSS <= 0 ||
		rep.DrainRatio <= 0 || rep.DoneRatio <= 0 || rep.Rate.Offered != 200 || rep.Rate.Rows < 300 || rep.Idle == nil {
		t.Fatalf("report %+v", rep)
	}
	// The program's code is mapped, and counts in the peak.
	if rep.Drain.MappedRSS <= 0 || rep.Drain.MappedRSS >= rep.Drain.RSS {
		t.Fatalf("mapped files %v MiB of a peak RSS of %v MiB", rep.Drain.MappedRSS, rep.Drain.RSS)
	}
	// A seeded row waits for the drain: its delivery lag is not zero.
	if rep.Drain.LagP50 <= 0 || rep.Drain.LagP99 < rep.Drain.LagP50 {
		t.Fatalf("drain lag p50 %v ms, p99 %v ms", rep.Drain.LagP50, rep.Drain.LagP99)
	}
	// Every message was read back from the stream; a row is acknowledged
	// before it is settled (both clocks in milliseconds, hence the 1 ms).
	if rep.Rate.Checkpoint == nil || *rep.Rate.Checkpoint != 1000 {
		t.Fatalf("the writer does not checkpoint as SQLite does by default: %v", rep.Rate.Checkpoint)
	}
	if rep.Rate.AckLagRows != rep.Rate.Rows || rep.Rate.AckLagP99 > rep.Rate.LagP99+1 {
		t.Fatalf("commit-to-PubAck lag over %d of %d rows, p99 %v ms against %v ms to done", rep.Rate.AckLagRows, rep.Rate.Rows, rep.Rate.AckLagP99, rep.Rate.LagP99)
	}
	if rep.Rate.WriterP50 <= 0 || rep.Rate.WriterMax < rep.Rate.WriterP50 {
		t.Fatalf("writer's transactions: p50 %v µs, max %v µs", rep.Rate.WriterP50, rep.Rate.WriterMax)
	}
	// The relay's CPU while the writer wrote, and the same writer alone.
	if rep.Rate.CPUPercent <= 0 || rep.WriterAlone.Rows < 300 || rep.WriterAlone.WriterP99 <= 0 || rep.WriterRatio <= 0 {
		t.Fatalf("rate CPU %v%%, writer alone %+v, ratio %v", rep.Rate.CPUPercent, rep.WriterAlone, rep.WriterRatio)
	}
	// The standard client's floor at the same rate, in a process of its own.
	if rep.Client.Messages < 300 || rep.Client.CPUPercent <= 0 || rep.CPUToClient <= 0 {
		t.Fatalf("standard client %+v, relay / client %v", rep.Client, rep.CPUToClient)
	}
	// The same report for people: every measurement has its line.
	var full bench.Report
	if err := json.Unmarshal(out, &full); err != nil {
		t.Fatal(err)
	}
	var text bytes.Buffer
	bench.Print(&text, &full)
	for _, want := range []string{"ceiling,  500 in flight", "ceiling (best)", "relay drain", "lag p50", "CPU", "peak RSS", "mapped files",
		"drain / ceiling", "drain, 5000 done rows", "with done / empty", "200 rows/s offered", "commit to PubAck", "writer, due to committed", "relay CPU", "% of one core",
		"writer alone (no relay)", "writer p99, relay / alone", "standard client alone", "relay CPU / client CPU", "idle CPU"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("the printed report lacks %q:\n%s", want, text.String())
		}
	}
}

// TestBenchKeys: with --keys the bench drains the rows a second time with
// that many ordering keys, reports both rates and their ratio, and reads
// the stream back to check each key's order; then the standard client
// publishes as many messages one PubAck at a time, and the keyed drain's
// rate over its rate is reported; the printed report says so.
func TestBenchKeys(t *testing.T) {
	bin := buildBinary(t)
	out, err := exec.Command(bin, "bench", "--rows", "600", "--ceiling-in-flight", "500", "--keys", "7", "--json").Output()
	if err != nil {
		t.Fatalf("bench --keys 7: %v\n%s", err, out)
	}
	type run struct {
		Rows            int     `json:"rows"`
		RowsPerSec      float64 `json:"rows_per_second"`
		CPU             float64 `json:"cpu_seconds"`
		OrderedMessages int     `json:"order_checked_messages"`
		OrderedKeys     int     `json:"order_checked_keys"`
	}
	var rep struct {
		Drain      run     `json:"drain"`
		Keys       int     `json:"keys"`
		KeyedDrain *run    `json:"keyed_drain"`
		KeyedRatio float64 `json:"keyed_to_unordered"`
		SyncRun    *struct {
			Messages   int     `json:"messages"`
			MsgsPerSec float64 `json:"msgs_per_second"`
		} `json:"sync_client"`
		Sync        float64 `json:"sync_client_msgs_per_second"`
		KeyedToSync float64 `json:"keyed_to_sync_publish"`
	}
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	k := rep.KeyedDrain
	if rep.Keys != 7 || k == nil || k.Rows != 600 || k.RowsPerSec <= 0 || k.CPU <= 0 || rep.KeyedRatio <= 0 || rep.Drain.Rows != 600 {
		t.Fatalf("report %s", out)
	}
	// The order check read every row back, of every key; the unordered
	// drain has none.
	if k.OrderedMessages != 600 || k.OrderedKeys != 7 || rep.Drain.OrderedMessages != 0 {
		t.Fatalf("order checked over %d messages of %d keys (unordered drain: %d); want 600 of 7 (0)", k.OrderedMessages, k.OrderedKeys, rep.Drain.OrderedMessages)
	}
	// The synchronous publisher's yardstick, on as many messages as rows.
	if s := rep.SyncRun; s == nil || s.Messages != 600 || s.MsgsPerSec <= 0 || rep.Sync != s.MsgsPerSec || rep.KeyedToSync <= 0 {
		t.Fatalf("sync client %+v, %v msgs/s, keyed / sync %v; want 600 messages and rates", s, rep.Sync, rep.KeyedToSync)
	}
	var full bench.Report
	if err := json.Unmarshal(out, &full); err != nil {
		t.Fatal(err)
	}
	var text bytes.Buffer
	bench.Print(&text, &full)
	for _, want := range []string{"relay drain ", "drain / ceiling", "relay drain, 7 keys", "keyed / unordered", "order checked", "600 messages of 7 keys",
		"standard client, sync", "one PubAck awaited at a time (600 messages)", "keyed / sync client"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("the printed report lacks %q:\n%s", want, text.String())
		}
	}
}

// TestBenchAgainstAServer: with --nats-url the bench measures on that
// server, touches none of its streams, and removes its own.
func TestBenchAgainstAServer(t *testing.T) {
	bin := buildBinary(t)
	n := testenv.StartNATS(t)
	js := n.JetStream(t)
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "APP", Subjects: []string{"app.>"}}); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, "bench", "--rows", "500", "--ceiling-in-flight", "500", "--nats-url", n.URL(), "--json").Output()
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, out)
	}
	var rep struct {
		Ceiling float64 `json:"ceiling_rows_per_second"`
		Drain   struct {
			Rows int `json:"rows"`
		} `json:"drain"`
	}
	if err := json.Unmarshal(out, &rep); err != nil || rep.Ceiling <= 0 || rep.Drain.Rows != 500 {
		t.Fatalf("report %+v (%v)\n%s", rep, err, out)
	}
	var names []string
	for name := range js.StreamNames(ctx).Name() {
		names = append(names, name)
	}
	if len(names) != 1 || names[0] != "APP" {
		t.Fatalf("streams after the bench: %v; want only the application's APP", names)
	}
}

// TestBenchWithCredentials: credentials in the --config file reach every
// process the bench starts (the relay children and the standard client),
// not only the bench's own connection.
func TestBenchWithCredentials(t *testing.T) {
	bin := buildBinary(t)
	n := testenv.StartNATS(t, func(o *server.Options) { o.Username, o.Password = "bench", "s3cret-pw" })
	cfg := filepath.Join(t.TempDir(), "relay.yaml")
	if err := os.WriteFile(cfg, []byte("nats:\n  user: bench\n  password: s3cret-pw\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, "bench", "--config", cfg, "--nats-url", n.URL(), "--rows", "300", "--ceiling-in-flight", "500",
		"--rate", "50", "--duration", "1s", "--json").CombinedOutput()
	if err != nil {
		t.Fatalf("bench with credentials in --config: %v\n%s", err, out)
	}
}

// TestWrongPasswordExits1: bad credentials stop startup with a clear
// message and exit code 1, without hanging and without the password.
func TestWrongPasswordExits1(t *testing.T) {
	bin := buildBinary(t)
	n := testenv.StartNATS(t, func(o *server.Options) { o.Username, o.Password = "relay", "right-pw" })
	path := testenv.NewDB(t)
	cmd := exec.Command(bin, "run", "--database-path", path, "--metrics-listen", "")
	cmd.Env = append(os.Environ(), "NATS_URL="+n.URL(), "OUTBOX_RELAY_NATS_USER=relay", "OUTBOX_RELAY_NATS_PASSWORD=wrong-pw-123")
	d := startProcess(t, cmd)
	if code := d.exitWithin(30 * time.Second); code != exitRuntime {
		t.Fatalf("exit code %d, want 1", code)
	}
	if stderr := d.log(); !strings.Contains(strings.ToLower(stderr), "authorization violation") || strings.Contains(stderr, "wrong-pw-123") {
		t.Fatalf("stderr %q: want the reason, not the password", stderr)
	}
}

// TestSecretsNeverShown runs the relay with a password, a token and a creds
// file, at debug level, and checks that no secret appears in any log line
// or in status output.
func TestSecretsNeverShown(t *testing.T) {
	jwtAuth := testenv.NewJWTAuth(t)
	for _, tc := range []struct {
		name    string
		server  func(*server.Options)
		env     func(url string) []string
		secrets []string
	}{
		{"password", func(o *server.Options) { o.Username, o.Password = "relay", "pw-SECRET-1" },
			func(url string) []string {
				return []string{"NATS_URL=" + url, "OUTBOX_RELAY_NATS_USER=relay", "OUTBOX_RELAY_NATS_PASSWORD=pw-SECRET-1"}
			}, []string{"pw-SECRET-1"}},
		{"password in the URL", func(o *server.Options) { o.Username, o.Password = "relay", "pw-SECRET-2" },
			func(url string) []string {
				return []string{"NATS_URL=" + strings.Replace(url, "nats://", "nats://relay:pw-SECRET-2@", 1)}
			}, []string{"pw-SECRET-2"}},
		{"token", func(o *server.Options) { o.Authorization = "tok-SECRET-3" },
			func(url string) []string { return []string{"NATS_URL=" + url, "OUTBOX_RELAY_NATS_TOKEN=tok-SECRET-3"} }, []string{"tok-SECRET-3"}},
		{"creds file", jwtAuth.Configure,
			func(url string) []string {
				return []string{"NATS_URL=" + url, "OUTBOX_RELAY_NATS_CREDS=" + jwtAuth.CredsFile}
			},
			[]string{jwtAuth.UserJWT, jwtAuth.UserSeed}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := testenv.StartNATS(t, tc.server)
			path := testenv.NewDB(t)
			app := testenv.AppDB(t, path)
			testenv.InsertN(t, app, 20, "Secret")
			d := startDaemon(t, tc.env(n.URL()), "run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
			addr := "http://" + d.waitFor("serving metrics")["listen"].(string)
			testenv.Eventually(t, 30*time.Second, "rows done", func() bool { return testenv.Counts(t, app)["done"] == 20 })
			metricsBody := httpGet(t, addr+"/metrics")
			d.stop()
			var everything strings.Builder
			everything.WriteString(d.log())
			everything.WriteString(metricsBody)
			for _, kv := range tc.env(n.URL()) { // status with the same secrets at hand
				k, v, _ := strings.Cut(kv, "=")
				t.Setenv(k, v)
			}
			for _, args := range [][]string{{"status"}, {"status", "--json"}} {
				code, out, errOut := runCLI(t, append(args, "--database-path", path)...)
				if code != 0 {
					t.Fatalf("%v: %d %s", args, code, errOut)
				}
				everything.WriteString(out + errOut)
			}
			for _, secret := range tc.secrets {
				if strings.Contains(everything.String(), secret) {
					t.Fatalf("a secret appears in the logs, metrics or status output")
				}
			}
			if n := len(d.Lines()); n < 5 {
				t.Fatalf("only %d log lines: the check saw nothing", n)
			}
		})
	}
}

// TestReadyzNamesDeniedSubject: /readyz says why when the server refuses
// the relay's publishes on a subject.
func TestReadyzNamesDeniedSubject(t *testing.T) {
	n := testenv.StartNATS(t, func(o *server.Options) {
		o.Users = []*server.User{{Username: "relay", Password: "pw", Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Allow: []string{"events.allowed.>", "$JS.API.>", "_INBOX.>"}},
		}}}
	})
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 1, "denied.thing")
	d := startDaemon(t, []string{"NATS_URL=" + n.URL(), "OUTBOX_RELAY_NATS_USER=relay", "OUTBOX_RELAY_NATS_PASSWORD=pw", "OUTBOX_RELAY_RELAY_ACK_TIMEOUT=500ms"},
		"run", "--database-path", path, "--metrics-listen", "127.0.0.1:0")
	addr := "http://" + d.waitFor("serving metrics")["listen"].(string)
	testenv.Eventually(t, 30*time.Second, "/readyz naming the denied subject", func() bool {
		code, body := httpStatus(t, addr+"/readyz")
		return code == 503 && strings.Contains(body, "permission denied on subject events.denied.thing")
	})
	d.stop()
}
