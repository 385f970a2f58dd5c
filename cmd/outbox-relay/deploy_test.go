package main

import (
	"os/exec"
	"testing"
)

// TestDeployArtifacts runs the checks of the deployment artifacts
// (Dockerfile, compose file, Prometheus and systemd configuration,
// config.example.yaml). They live in a module of their own (deploy/go.mod)
// so that their parsers stay out of the relay's dependencies; this test
// keeps them in the README's test command.
func TestDeployArtifacts(t *testing.T) {
	args := []string{"test", "./..."}
	if testing.Short() {
		args = append(args, "-short")
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = "../../deploy"
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go test in deploy/: %v\n%s", err, out)
	}
	t.Logf("deploy/: %s", out)
}
