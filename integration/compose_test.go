package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// composeCmd finds docker-compose (v1) or the docker compose plugin (v2).
func composeCmd() []string {
	if p, err := exec.LookPath("docker-compose"); err == nil {
		return []string{p}
	}
	if exec.Command("docker", "compose", "version").Run() == nil {
		return []string{"docker", "compose"}
	}
	return nil
}

// requireDocker skips without a reachable Docker daemon, except in CI,
// where the container tests must run.
func requireDocker(t *testing.T) []string {
	t.Helper()
	compose := composeCmd()
	err := exec.Command("docker", "info").Run()
	if err == nil && compose != nil {
		return compose
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true but Docker or docker-compose is not available (docker info: %v)", err)
	}
	t.Skip("no Docker daemon or docker-compose: skipping the container tests")
	return nil
}

// TestComposeStack brings up docker-compose.yml (images built locally by
// scripts/build-images, no registry) and checkpoints into its MinIO through
// the bucket its one-shot service created, as the README shows.
func TestComposeStack(t *testing.T) {
	s := upStack(t)
	s.must("up", "-d") // the whole stack: the agent and the GC service too
	s3env := []string{
		fmt.Sprintf("AWS_ENDPOINT_URL_S3=http://127.0.0.1:%d", s.port), "AWS_REGION=us-east-1",
		"AWS_ACCESS_KEY_ID=agentstate", "AWS_SECRET_ACCESS_KEY=agentstate-dev-secret",
		"AWS_EC2_METADATA_DISABLED=true",
	}
	src := filepath.Join(t.TempDir(), "home")
	os.MkdirAll(src, 0o700)
	os.WriteFile(filepath.Join(src, "settings.json"), []byte(`{"theme":"dark"}`), 0o600)
	c := newCLI(t, "s3://agentstate", s3env)
	if res := c.checkpoint("claude", src); res.Seq != 1 {
		t.Fatalf("checkpoint into the compose MinIO: %+v", res)
	}
	dst := filepath.Join(t.TempDir(), "back")
	newCLI(t, "s3://agentstate", s3env).restore("claude", dst)
	if b, err := os.ReadFile(filepath.Join(dst, "settings.json")); err != nil || string(b) != `{"theme":"dark"}` {
		t.Fatalf("restored from the compose MinIO: %q, %v", b, err)
	}
	// The GC service runs its loop against the same bucket.
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, _ := s.cmd("logs", "gc").CombinedOutput()
		running := strings.TrimSpace(s.must("ps", "-q", "--filter", "status=running", "gc"))
		if running != "" && strings.Contains(string(out), "manifests") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the GC service is not running a GC loop (running %q):\n%s", running, out)
		}
		time.Sleep(time.Second)
	}
}
