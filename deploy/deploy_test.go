// Package deploy holds no code: its tests check the deployment artifacts
// (Dockerfile, compose file, Prometheus and systemd configuration,
// config.example.yaml) with real parsers and tools, since no Docker engine
// runs where the tests do. It is a module of its own, so that the parsers
// (compose-go, buildkit) stay out of the relay's go.mod; the relay's
// TestDeployArtifacts runs these tests from the main module's suite.
package deploy

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// tool returns the path of an external checker; CI installs them all, a
// developer's machine may not have them.
func tool(t *testing.T, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI must install %s (Debian package %s)", name, pkg)
		}
		t.Skipf("%s not installed (Debian package %s)", name, pkg)
	}
	return p
}

// setConfigEnv makes env the only configuration variables of the process
// environment, which config.Load reads, until the test ends (see
// testenv.ReplaceEnv).
func setConfigEnv(t *testing.T, env []string) {
	t.Helper()
	var aliases []string
	for _, k := range config.Keys() {
		aliases = append(aliases, k.Alias)
	}
	testenv.ReplaceEnv(t, config.EnvPrefix, aliases, env)
}

// TestConfigExampleIsTheDefaults: the documented example loads, equals the
// built-in defaults, and names every key with its environment variable, so
// docs and code cannot drift.
func TestConfigExampleIsTheDefaults(t *testing.T) {
	setConfigEnv(t, nil)
	c, err := config.Load("../config.example.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, config.Default()) {
		t.Fatalf("config.example.yaml differs from the defaults:\n%+v\n%+v", c, config.Default())
	}
	raw, err := os.ReadFile("../config.example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var tree map[string]any
	if err := yaml.Unmarshal(raw, &tree); err != nil {
		t.Fatal(err)
	}
	for _, k := range config.Keys() {
		var node any = tree
		for _, part := range strings.Split(k.Name, ".") {
			m, ok := node.(map[string]any)
			if !ok {
				node = nil
				break
			}
			node = m[part]
		}
		if node == nil { // an empty value decodes as "" or false, never nil
			t.Errorf("config.example.yaml does not set %s", k.Name)
		}
		if !strings.Contains(string(raw), k.Env) {
			t.Errorf("config.example.yaml does not name %s's variable %s", k.Name, k.Env)
		}
	}
}

// loadCompose loads the compose file with the real compose-spec loader.
func loadCompose(t *testing.T) *types.Project {
	t.Helper()
	opts, err := cli.NewProjectOptions([]string{"docker-compose.yml"}, cli.WithWorkingDirectory("."), cli.WithName("outbox-relay-demo"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := cli.ProjectFromOptions(context.Background(), opts)
	if err != nil {
		t.Fatalf("compose file does not load: %v", err)
	}
	return p
}

func service(t *testing.T, p *types.Project, name string) types.ServiceConfig {
	t.Helper()
	s, err := p.GetService(name)
	if err != nil {
		t.Fatalf("compose file has no service %s", name)
	}
	return s
}

func env(s types.ServiceConfig, key string) string {
	if v := s.Environment[key]; v != nil {
		return *v
	}
	return ""
}

// dataVolume returns the named volume mounted at the directory of the
// service's database path, or at a directory above it.
func dataVolume(t *testing.T, s types.ServiceConfig) string {
	t.Helper()
	dbPath := env(s, config.EnvName("database.path"))
	if dbPath == "" {
		t.Fatalf("service %s does not set %s", s.Name, config.EnvName("database.path"))
	}
	for _, v := range s.Volumes {
		if dir := filepath.Dir(dbPath); v.Target == dir || strings.HasPrefix(dir, v.Target+"/") {
			if v.Type != types.VolumeTypeVolume && v.Type != types.VolumeTypeBind {
				t.Fatalf("service %s mounts %s as %s", s.Name, v.Target, v.Type)
			}
			return v.Source
		}
	}
	t.Fatalf("service %s does not mount the directory of %s (mount the directory, not the file, so -wal and -shm are shared)", s.Name, dbPath)
	return ""
}

// TestComposeSidecar: the relay and the application share the database
// directory, the relay reaches nats, Prometheus scrapes the relay's metrics
// port, and every variable the relay gets is a real configuration key.
func TestComposeSidecar(t *testing.T) {
	p := loadCompose(t)
	relay, app, nats, prom := service(t, p, "outbox-relay"), service(t, p, "app"), service(t, p, "nats"), service(t, p, "prometheus")

	if a, r := dataVolume(t, app), dataVolume(t, relay); a != r {
		t.Errorf("app mounts volume %q, the relay %q: they must share the database", a, r)
	}
	if env(app, config.EnvName("database.path")) != env(relay, config.EnvName("database.path")) {
		t.Error("app and relay use different database paths")
	}
	if !strings.Contains(strings.Join(nats.Command, " "), "--jetstream") {
		t.Errorf("nats runs without JetStream: %v", nats.Command)
	}
	if len(nats.Volumes) == 0 {
		t.Error("nats keeps its JetStream data in no volume")
	}
	if got := env(relay, "NATS_URL"); got != "nats://nats:4222" {
		t.Errorf("relay NATS_URL %q, want the nats service", got)
	}
	for _, dep := range []string{"nats", "app"} {
		if d, ok := relay.DependsOn[dep]; !ok || d.Condition != types.ServiceConditionHealthy {
			t.Errorf("relay does not wait for a healthy %s: %+v", dep, relay.DependsOn)
		}
	}

	known := map[string]bool{}
	for _, k := range config.Keys() {
		known[k.Env] = true
		if k.Alias != "" {
			known[k.Alias] = true
		}
	}
	for _, s := range []types.ServiceConfig{relay, app} {
		for k := range s.Environment {
			if !known[k] {
				t.Errorf("service %s sets %s, which is no configuration key", s.Name, k)
			}
		}
	}
	loadsItsEnvironment(t, relay)

	// Prometheus scrapes the port the relay listens on.
	_, port, err := net.SplitHostPort(env(relay, config.EnvName("metrics.listen")))
	if err != nil {
		t.Fatalf("relay metrics listen: %v", err)
	}
	targets := scrapeTargets(t)
	if len(targets) == 0 || targets[0] != net.JoinHostPort("outbox-relay", port) {
		t.Errorf("prometheus scrapes %v, the relay listens on port %s", targets, port)
	}
	mounted := false
	for _, v := range prom.Volumes {
		mounted = mounted || (filepath.Base(v.Source) == "prometheus.yml" && v.Target == "/etc/prometheus/prometheus.yml")
	}
	if !mounted {
		t.Error("prometheus does not get deploy/prometheus/prometheus.yml")
	}

	for _, s := range p.Services {
		if s.Restart == "" {
			t.Errorf("service %s has no restart policy", s.Name)
		}
		if s.HealthCheck == nil {
			t.Errorf("service %s has no healthcheck (or explicit disable)", s.Name)
		}
	}
	if hc := relay.HealthCheck; hc == nil || !strings.Contains(strings.Join(hc.Test, " "), "outbox-relay healthcheck") {
		t.Errorf("relay healthcheck %+v", relay.HealthCheck)
	}
	shutdown, err := time.ParseDuration(env(relay, config.EnvName("relay.shutdown_timeout")))
	if err != nil {
		shutdown = config.Default().Relay.ShutdownTimeout
	}
	if relay.StopGracePeriod == nil || time.Duration(*relay.StopGracePeriod) <= shutdown+5*time.Second {
		t.Errorf("relay stop_grace_period %v must exceed shutdown_timeout %v + 5 s", relay.StopGracePeriod, shutdown)
	}
}

// loadsItsEnvironment checks that the configuration loads from the
// service's environment.
func loadsItsEnvironment(t *testing.T, s types.ServiceConfig) {
	t.Helper()
	var envList []string
	for k, v := range s.Environment {
		if v != nil {
			envList = append(envList, k+"="+*v)
		}
	}
	setConfigEnv(t, envList)
	if _, err := config.Load("", nil); err != nil {
		t.Errorf("service %s's environment does not load: %v", s.Name, err)
	}
}

func scrapeTargets(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile("prometheus/prometheus.yml")
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	if err := yaml.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, sc := range cfg.ScrapeConfigs {
		if sc.JobName != "outbox-relay" {
			continue // the alerts select job="outbox-relay"
		}
		for _, st := range sc.StaticConfigs {
			out = append(out, st.Targets...)
		}
	}
	return out
}

// TestPrometheusConfig: the configuration and the alert rules it loads are
// valid, and the rules' unit tests (prometheus/alerts_test.yml: an alert
// fires when it should, saying what it should) pass.
func TestPrometheusConfig(t *testing.T) {
	promtool := tool(t, "promtool", "prometheus")
	for _, args := range [][]string{{"check", "config", "prometheus/prometheus.yml"}, {"test", "rules", "prometheus/alerts_test.yml"}} {
		if out, err := exec.Command(promtool, args...).CombinedOutput(); err != nil {
			t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// stages parses the Dockerfile with BuildKit's own parser.
func stages(t *testing.T) []instructions.Stage {
	t.Helper()
	f, err := os.Open("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := parser.Parse(f)
	if err != nil {
		t.Fatal(err)
	}
	st, _, err := instructions.Parse(res.AST, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestDockerfile: multi-stage, static build recipe, minimal non-root final
// image with the database volume, the metrics port and a shell-free
// healthcheck.
func TestDockerfile(t *testing.T) {
	st := stages(t)
	if len(st) < 2 {
		t.Fatalf("%d stages; want a build stage and a final one", len(st))
	}
	var buildRuns []string
	for _, c := range st[0].Commands {
		if r, ok := c.(*instructions.RunCommand); ok {
			buildRuns = append(buildRuns, strings.Join(r.CmdLine, " "))
		}
	}
	if !strings.Contains(strings.Join(buildRuns, "\n"), "./scripts/build-static.sh") {
		t.Errorf("the build stage does not run scripts/build-static.sh: %q", buildRuns)
	}
	script, err := os.ReadFile("../scripts/build-static.sh")
	if err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"CGO_ENABLED=1", "sqlite_omit_load_extension", "netgo", "osusergo", "-linkmode external", "-extldflags '-static'", "-X main.version=", "-X main.commit="} {
		if !strings.Contains(string(script), flag) {
			t.Errorf("scripts/build-static.sh lacks %q", flag)
		}
	}

	final := st[len(st)-1]
	if !strings.HasPrefix(final.BaseName, "gcr.io/distroless/static") && final.BaseName != "scratch" {
		t.Errorf("final image %q is not distroless/static or scratch", final.BaseName)
	}
	var user string
	var health *instructions.HealthCheckCommand
	var exposed, volumes []string
	for _, c := range final.Commands {
		switch c := c.(type) {
		case *instructions.UserCommand:
			user = c.User
		case *instructions.HealthCheckCommand:
			health = c
		case *instructions.ExposeCommand:
			exposed = append(exposed, c.Ports...)
		case *instructions.VolumeCommand:
			volumes = append(volumes, c.Volumes...)
		}
	}
	if uid := strings.Split(user, ":")[0]; user == "" || uid == "0" || uid == "root" {
		t.Errorf("final stage runs as %q; want a non-root user", user)
	}
	if health == nil || len(health.Health.Test) < 3 || health.Health.Test[0] != "CMD" ||
		!strings.HasSuffix(health.Health.Test[1], "outbox-relay") || health.Health.Test[2] != "healthcheck" {
		t.Errorf("healthcheck %+v: want the exec form running outbox-relay healthcheck (no shell in the image)", health)
	}
	port := strconv.Itoa(9108)
	if !strings.Contains(strings.Join(exposed, " "), port) {
		t.Errorf("final stage exposes %v, not the metrics port %s", exposed, port)
	}
	if !strings.Contains(strings.Join(volumes, " "), "/data") {
		t.Errorf("final stage volumes %v lack /data", volumes)
	}
}

// TestStaticBuild runs the Dockerfile's build recipe: the binary is
// statically linked and runs.
func TestStaticBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("a static cgo build takes about two minutes")
	}
	bin := filepath.Join(t.TempDir(), "outbox-relay")
	cmd := exec.Command("./scripts/build-static.sh", bin)
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "VERSION=9.9.9-test", "COMMIT=abc1234")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build-static.sh: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "outbox-relay 9.9.9-test (commit abc1234") {
		t.Fatalf("version: %v %q", err, out)
	}
	if file, err := exec.LookPath("file"); err == nil {
		out, _ := exec.Command(file, bin).CombinedOutput()
		if !strings.Contains(string(out), "statically linked") {
			t.Fatalf("file says: %s", out)
		}
	}
	out, _ = exec.Command("ldd", bin).CombinedOutput()
	if !strings.Contains(string(out), "not a dynamic executable") {
		t.Fatalf("ldd says: %s", out)
	}
}

// unitFile is the systemd unit with ExecStart pointed at a real binary, so
// systemd-analyze verify can check it.
func unitFile(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile("systemd/outbox-relay.service")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "outbox-relay")
	build := exec.Command("go", "build", "-o", bin, "./cmd/outbox-relay")
	build.Dir = ".." // the relay's own module
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	unit := filepath.Join(dir, "outbox-relay.service")
	if err := os.WriteFile(unit, []byte(strings.ReplaceAll(string(raw), "/usr/local/bin/outbox-relay", bin)), 0o644); err != nil {
		t.Fatal(err)
	}
	return unit
}

// TestSystemdUnit: the unit runs the daemon as its own user with the config
// file, restarts on failure, drains on SIGTERM within its stop timeout, and
// is hardened: systemd rates its exposure OK (below 4.0).
func TestSystemdUnit(t *testing.T) {
	raw, err := os.ReadFile("systemd/outbox-relay.service")
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string][]string{}
	for _, line := range strings.Split(string(raw), "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok && !strings.HasPrefix(line, "#") {
			keys[k] = append(keys[k], v)
		}
	}
	one := func(k string) string {
		if len(keys[k]) == 0 {
			return ""
		}
		return keys[k][len(keys[k])-1]
	}
	if u := one("User"); u == "" || u == "root" {
		t.Errorf("User=%q: want a dedicated user", u)
	}
	if !strings.Contains(one("ExecStart"), "--config /etc/outbox-relay/config.yaml") || !strings.HasSuffix(one("ExecStart"), " run") {
		t.Errorf("ExecStart=%q", one("ExecStart"))
	}
	if one("Restart") != "on-failure" || one("KillSignal") != "SIGTERM" {
		t.Errorf("Restart=%q KillSignal=%q", one("Restart"), one("KillSignal"))
	}
	stop, err := time.ParseDuration(one("TimeoutStopSec"))
	if err != nil || stop <= config.Default().Relay.ShutdownTimeout+5*time.Second {
		t.Errorf("TimeoutStopSec=%q must exceed relay.shutdown_timeout + 5 s", one("TimeoutStopSec"))
	}
	for _, k := range []string{"NoNewPrivileges", "ProtectSystem", "ReadWritePaths", "PrivateTmp", "ProtectHome"} {
		if one(k) == "" {
			t.Errorf("unit lacks %s=", k)
		}
	}
	if one("ProtectSystem") != "strict" {
		t.Errorf("ProtectSystem=%q, want strict", one("ProtectSystem"))
	}

	analyze := tool(t, "systemd-analyze", "systemd")
	unit := unitFile(t)
	if out, err := exec.Command(analyze, "verify", unit).CombinedOutput(); err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	out, err := exec.Command(analyze, "security", "--offline=yes", unit).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+) (\S+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no exposure level in:\n%s", out)
	}
	score, _ := strconv.ParseFloat(string(m[1]), 64)
	t.Logf("systemd-analyze security: exposure %.1f %s", score, m[2])
	if score >= 4.0 {
		t.Errorf("exposure %.1f %s; want below 4.0 (OK)", score, m[2])
	}
}

// TestComposeTenants: the tenants variant, laid over the compose file,
// loads; the application and the relay share the tenants' directory; the
// relay serves every file of it with the tenant in the subjects, on a
// configuration that loads; and the application's files match the
// relay's pattern.
func TestComposeTenants(t *testing.T) {
	opts, err := cli.NewProjectOptions([]string{"docker-compose.yml", "docker-compose.tenants.yml"}, cli.WithWorkingDirectory("."), cli.WithName("outbox-relay-demo"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := cli.ProjectFromOptions(context.Background(), opts)
	if err != nil {
		t.Fatalf("the tenants variant does not load: %v", err)
	}
	relay, app := service(t, p, "outbox-relay"), service(t, p, "app")
	pattern := env(relay, config.EnvName("database.path"))
	if !fleet.IsPattern(pattern) || env(app, config.EnvName("database.path")) != pattern {
		t.Fatalf("relay serves %q, the application writes %q: want one pattern", pattern, env(app, config.EnvName("database.path")))
	}
	if a, r := dataVolume(t, app), dataVolume(t, relay); a != r {
		t.Errorf("app mounts volume %q, the relay %q: they must share the tenants' directory", a, r)
	}
	if got := env(relay, config.EnvName("stream.subject_template")); !strings.Contains(got, "{tenant}") {
		t.Errorf("subject template %q does not name the tenant", got)
	}
	loadsItsEnvironment(t, relay)
	cmd := strings.Join(app.Command, " ")
	if !strings.Contains(cmd, "--tenants") {
		t.Fatalf("the application writes one file: %s", cmd)
	}
	if hc := strings.Join(app.HealthCheck.Test, " "); !strings.Contains(hc, "status --db tenant-") {
		t.Errorf("app healthcheck %q does not wait for a tenant's file", hc)
	}
	if ok, _ := filepath.Match(filepath.Base(pattern), "tenant-05.db"); !ok {
		t.Errorf("the application's files (tenant-05.db) do not match %s", pattern)
	}
}
