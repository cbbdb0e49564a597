package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// runCmd starts `agentstate run` on one plain lineage with the given
// child, as a container entrypoint would.
func (c *cli) runCmd(dir string, flags []string, child ...string) (*exec.Cmd, *syncBuffer) {
	args := append([]string{"run", "--lineage", "app", "--dir", dir}, flags...)
	cmd := c.command(context.Background(), append(append(args, "--"), child...)...)
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	return cmd, logs
}

func exitStatus(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

func restoredFile(t *testing.T, c *cli, name string) []byte {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "dst")
	newCLI(t, c.store, c.env).restore("app", dst)
	b, _ := os.ReadFile(filepath.Join(dst, name))
	return b
}

// TestRunSIGTERMFinalCheckpoint: SIGTERM is forwarded, the child writes a
// last line and exits 7; the final checkpoint holds that line and run
// exits 7.
func TestRunSIGTERMFinalCheckpoint(t *testing.T) {
	storeURL, env := newBucket(t)
	dir := t.TempDir()
	c := newCLI(t, storeURL, env)
	script := `trap 'echo "{\"last\":true}" >> log.jsonl; exit 7' TERM; while :; do echo '{"n":1}' >> log.jsonl; sleep 0.01; done`
	cmd, logs := c.runCmd(dir, []string{"--checkpoint-interval", "5s"}, "sh", "-c", "cd "+dir+" && "+script)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(700 * time.Millisecond)
	cmd.Process.Signal(syscall.SIGTERM)
	if code := exitStatus(waitTimeout(cmd, time.Minute)); code != 7 {
		t.Fatalf("run exited %d, want the child's 7\n%s", code, logs)
	}
	live, _ := os.ReadFile(filepath.Join(dir, "log.jsonl"))
	got := restoredFile(t, c, "log.jsonl")
	if !bytes.HasSuffix(got, []byte(`{"last":true}`+"\n")) || !bytes.Equal(got, live) {
		t.Fatalf("final checkpoint does not hold the child's last line (%d of %d bytes)\n%s", len(got), len(live), logs)
	}
}

// TestRunSIGKILLLosesAtMostOneInterval: kill -9 of run and its child; a
// fresh restore misses at most the lines of the last interval.
func TestRunSIGKILLLosesAtMostOneInterval(t *testing.T) {
	storeURL, env := newBucket(t)
	dir := t.TempDir()
	c := newCLI(t, storeURL, env)
	interval := 400 * time.Millisecond
	cmd, logs := c.runCmd(dir, []string{"--checkpoint-interval", interval.String()},
		agentstateBin(t), "demo-writer", filepath.Join(dir, "rollout.jsonl"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond)
	killed := time.Now()
	syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // run and the harness
	waitTimeout(cmd, time.Minute)
	got := restoredFile(t, c, "rollout.jsonl")
	lines := bytes.Split(bytes.TrimSuffix(got, []byte("\n")), []byte("\n"))
	var last struct {
		TS time.Time `json:"ts"`
	}
	if err := json.Unmarshal(lines[len(lines)-1], &last); err != nil {
		t.Fatalf("last restored line %q: %v\n%s", lines[len(lines)-1], err, logs)
	}
	// One interval, plus what a checkpoint itself takes on a loaded machine.
	if lost := killed.Sub(last.TS); lost > interval+time.Second {
		t.Fatalf("restore lost %v of lines (interval %v)\n%s", lost, interval, logs)
	}
}

// TestRunRefusesToStartAfterFailedRestore: a store that cannot be reached
// is an incomplete restore: the child never starts.
func TestRunRefusesToStartAfterFailedRestore(t *testing.T) {
	_, env := newBucket(t)
	env = append(env, "AWS_ENDPOINT_URL_S3=http://127.0.0.1:1") // nothing listens there
	c := newCLI(t, "s3://unreachable/x", env)
	dir := t.TempDir()
	marker := filepath.Join(t.TempDir(), "started")
	cmd, logs := c.runCmd(dir, nil, "sh", "-c", "touch "+marker)
	err := cmd.Run()
	if exitStatus(err) == 0 {
		t.Fatalf("run exited 0 after a failed restore\n%s", logs)
	}
	if _, err := os.Stat(marker); err == nil {
		t.Fatalf("the harness was started after a failed restore\n%s", logs)
	}
	if !strings.Contains(logs.String(), `adapter "app"`) {
		t.Fatalf("the error does not name the adapter:\n%s", logs)
	}
}

// TestRunRestartsCrashingChildUntilCap: restarted with backoff up to the
// cap, then a final checkpoint and a non-zero exit.
func TestRunRestartsCrashingChildUntilCap(t *testing.T) {
	storeURL, env := newBucket(t)
	dir := t.TempDir()
	c := newCLI(t, storeURL, env)
	cmd, logs := c.runCmd(dir, []string{"--max-restarts", "2", "--restart-backoff", "50ms", "--checkpoint-interval", "1h"},
		"sh", "-c", "echo start >> "+filepath.Join(dir, "starts.txt")+"; exit 1")
	if code := exitStatus(waitTimeout(startOrFail(t, cmd), time.Minute)); code == 0 {
		t.Fatalf("run exited 0 at the restart cap\n%s", logs)
	}
	if got := string(restoredFile(t, c, "starts.txt")); got != "start\nstart\nstart\n" {
		t.Fatalf("final checkpoint holds %q, want 3 starts (1 + 2 restarts)\n%s", got, logs)
	}
}

func startOrFail(t *testing.T, cmd *exec.Cmd) *exec.Cmd {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd
}

// TestHandCheckpointWaitsForTimerCheckpoint: checkpoints started by hand
// while run checkpoints on a short timer take the lineage lock in turn:
// all succeed, and the lineage is one unbroken chain.
func TestHandCheckpointWaitsForTimerCheckpoint(t *testing.T) {
	storeURL, env := newBucket(t)
	dir := t.TempDir()
	c := newCLI(t, storeURL, env)
	cmd, logs := c.runCmd(dir, []string{"--checkpoint-interval", "50ms"},
		agentstateBin(t), "demo-writer", filepath.Join(dir, "rollout.jsonl"))
	startOrFail(t, cmd)
	defer func() { cmd.Process.Signal(syscall.SIGTERM); waitTimeout(cmd, time.Minute) }()
	time.Sleep(500 * time.Millisecond)
	for i := range 8 {
		if _, errOut, code := c.run("checkpoint", "--lineage", "app", "--dir", dir); code != 0 {
			t.Fatalf("hand checkpoint %d: exit %d: %s\n%s", i, code, errOut, logs)
		}
	}
	var list []struct {
		Seq, Parent uint64
	}
	c.mustJSON(&list, "ls", "--lineage", "app")
	for i, m := range list {
		if m.Parent != m.Seq-1 || (i > 0 && list[i-1].Seq != m.Seq+1) {
			t.Fatalf("the lineage forked or has a gap at seq %d (parent %d)", m.Seq, m.Parent)
		}
	}
	if strings.Contains(logs.String(), "committed by this writer before a crash") {
		t.Fatalf("two checkpoints overlapped:\n%s", logs)
	}
}

// TestRunMetricsAndStatus: --metrics-addr serves Prometheus metrics that
// say a checkpoint succeeded, and `agentstate status` shows it.
func TestRunMetricsAndStatus(t *testing.T) {
	storeURL, env := newBucket(t)
	dir := t.TempDir()
	c := newCLI(t, storeURL, env)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cmd, logs := c.runCmd(dir, []string{"--checkpoint-interval", "200ms", "--metrics-addr", addr},
		agentstateBin(t), "demo-writer", filepath.Join(dir, "rollout.jsonl"))
	startOrFail(t, cmd)
	defer func() { cmd.Process.Signal(syscall.SIGTERM); waitTimeout(cmd, time.Minute) }()
	var body string
	for deadline := time.Now().Add(30 * time.Second); ; {
		if resp, err := http.Get("http://" + addr + "/metrics"); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
			if strings.Contains(body, `agentstate_adapter_last_success_timestamp_seconds{adapter="app"}`) &&
				!strings.Contains(body, "agentstate_checkpoints_total 0") {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics never showed a successful checkpoint:\n%s\n%s", body, logs)
		}
		time.Sleep(100 * time.Millisecond)
	}
	var st []struct {
		Lineage   string `json:"lineage"`
		Seq       uint64 `json:"seq"`
		LastError string `json:"last_error"`
	}
	c.mustJSON(&st, "status", "--lineage", "app")
	if len(st) != 1 || st[0].Seq == 0 || st[0].LastError != "" {
		t.Fatalf("status %+v", st)
	}
}

// TestRunKeepsPrivateCredentialsFromTheHarness: with the bucket's keys as
// AGENTSTATE_S3_*, run checkpoints with them, and the harness finds them
// neither in its environment nor in run's, through /proc/$PPID/environ.
// run and the harness run as one non-root user (nobody, when the test runs
// as root: root may read any process).
func TestRunKeepsPrivateCredentialsFromTheHarness(t *testing.T) {
	storeURL, env := newBucket(t)
	private := []string{"HOME=/nonexistent"}
	var secret string
	for _, kv := range env {
		name, value, _ := strings.Cut(kv, "=")
		switch name {
		case "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN":
			private = append(private, "AGENTSTATE_S3_"+strings.TrimPrefix(name, "AWS_")+"="+value)
			if name == "AWS_SECRET_ACCESS_KEY" {
				secret = value
			}
		default:
			private = append(private, kv)
		}
	}
	if secret == "" {
		t.Fatal("the bucket's env has no secret key")
	}
	base, err := os.MkdirTemp("", "agentstate-creds-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	bin, err := os.ReadFile(agentstateBin(t))
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(base, "agentstate"), bin, 0o755)
	for _, d := range []string{"dir", "state", "out"} {
		os.Mkdir(filepath.Join(base, d), 0o700)
	}
	os.WriteFile(filepath.Join(base, "dir", "f"), []byte("x"), 0o600)
	var cred *syscall.Credential
	if os.Getuid() == 0 {
		cred = &syscall.Credential{Uid: 65534, Gid: 65534}
		os.Chmod(base, 0o755)
		filepath.Walk(base, func(p string, _ os.FileInfo, _ error) error { return os.Lchown(p, 65534, 65534) })
	}
	out := filepath.Join(base, "out")
	cmd := exec.Command(filepath.Join(base, "agentstate"), "--store", storeURL, "--state-dir", filepath.Join(base, "state"),
		"run", "--lineage", "app", "--dir", filepath.Join(base, "dir"), "--",
		"sh", "-c", `env > "$0/env"; cat /proc/$PPID/environ > "$0/parent" 2>&1; true`, out)
	cmd.Env = append(withoutAWS(os.Environ()), private...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if code := exitStatus(waitTimeout(cmd, time.Minute)); code != 0 {
		t.Fatalf("run exited %d\n%s", code, logs)
	}
	childEnv, err := os.ReadFile(filepath.Join(out, "env"))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(childEnv, []byte(secret)) || bytes.Contains(childEnv, []byte("AGENTSTATE_S3_")) {
		t.Fatalf("the harness saw the bucket's credentials:\n%s", childEnv)
	}
	if !bytes.Contains(childEnv, []byte("AWS_REGION=")) {
		t.Fatalf("the harness lost the rest of the environment:\n%s", childEnv)
	}
	parentEnv, _ := os.ReadFile(filepath.Join(out, "parent"))
	if bytes.Contains(parentEnv, []byte(secret)) {
		t.Fatal("the harness read the bucket's credentials from /proc/$PPID/environ")
	}
	if got := restoredFile(t, newCLI(t, storeURL, env), "f"); string(got) != "x" {
		t.Fatalf("the final checkpoint with the private keys holds %q\n%s", got, logs)
	}
}

// withoutAWS drops AWS_ variables, so only the test's own reach a command.
func withoutAWS(environ []string) []string {
	var out []string
	for _, kv := range environ {
		if !strings.HasPrefix(kv, "AWS_") {
			out = append(out, kv)
		}
	}
	return out
}
