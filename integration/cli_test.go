package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The CLI under test is built once per test binary, statically
// (CGO_ENABLED=0), exactly as it ships; tests run it as separate processes
// so that a SIGKILL is a real kill.
var cliBuild struct {
	once sync.Once
	path string
	err  error
}

func agentstateBin(t testing.TB) string {
	t.Helper()
	cliBuild.once.Do(func() {
		dir, err := os.MkdirTemp("", "agentstate-bin-")
		if err != nil {
			cliBuild.err = err
			return
		}
		cliBuild.path = filepath.Join(dir, "agentstate")
		cmd := exec.Command("go", "build", "-o", cliBuild.path, "github.com/agentstate/agentstate/cmd/agentstate")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			cliBuild.err = errors.New("build agentstate: " + err.Error() + "\n" + string(out))
		}
	})
	if cliBuild.err != nil {
		t.Fatal(cliBuild.err)
	}
	return cliBuild.path
}

// cli runs agentstate commands against one store with one state directory.
type cli struct {
	t     testing.TB
	store string
	env   []string
	state string
}

func newCLI(t testing.TB, storeURL string, env []string) *cli {
	return &cli{t: t, store: storeURL, env: env, state: t.TempDir()}
}

func (c *cli) command(ctx context.Context, args ...string) *exec.Cmd {
	full := append([]string{"--store", c.store, "--state-dir", c.state}, args...)
	cmd := exec.CommandContext(ctx, agentstateBin(c.t), full...)
	cmd.Env = append(append(os.Environ(), c.env...), "HOME="+c.state)
	return cmd
}

// run runs a command and returns stdout, stderr and the exit code.
func (c *cli) run(args ...string) (stdout, stderr string, code int) {
	c.t.Helper()
	cmd := c.command(context.Background(), args...)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		c.t.Fatalf("run agentstate %v: %v", args, err)
	}
	return o.String(), e.String(), code
}

// mustJSON runs a command with --json, requires exit 0 and decodes stdout.
func (c *cli) mustJSON(v any, args ...string) {
	c.t.Helper()
	out, errOut, code := c.run(append(args, "--json")...)
	if code != 0 {
		c.t.Fatalf("agentstate %v: exit %d\n%s", args, code, errOut)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		c.t.Fatalf("agentstate %v: decode output %q: %v", args, out, err)
	}
}

type checkpointOut struct {
	Seq           uint64 `json:"seq"`
	Committed     bool   `json:"committed"`
	Files         int    `json:"files"`
	FilesRead     int    `json:"files_read"`
	FilesChanged  int    `json:"files_changed"`
	BytesUploaded int64  `json:"bytes_uploaded"`
	Requests      int64  `json:"requests"`
	// SegmentsCompacted: segments the checkpoint's compaction retired.
	SegmentsCompacted int `json:"segments_compacted"`
}

type restoreOut struct {
	Seq      uint64   `json:"seq"`
	Empty    bool     `json:"empty"`
	Rejected []string `json:"rejected"`
	Files    int      `json:"files"`
	Written  int      `json:"written"`
	Failed   []struct {
		Path string `json:"path"`
	} `json:"failed"`
}

func (c *cli) checkpoint(lineage, dir string) checkpointOut {
	c.t.Helper()
	var out checkpointOut
	c.mustJSON(&out, "checkpoint", "--lineage", lineage, "--dir", dir)
	return out
}

func (c *cli) restore(lineage, dir string) restoreOut {
	c.t.Helper()
	var out restoreOut
	c.mustJSON(&out, "restore", "--lineage", lineage, "--dir", dir)
	return out
}

// peakRSS is the largest resident set of the finished process, in bytes.
func peakRSS(ps *os.ProcessState) int64 {
	if ru, ok := ps.SysUsage().(*syscall.Rusage); ok && runtime.GOOS == "linux" {
		return ru.Maxrss * 1024
	}
	return 0
}

// diffTrees runs `diff -r --no-dereference` (GNU diff) as an independent
// check that two trees hold the same names, contents and link targets.
func diffTrees(t testing.TB, a, b string) {
	t.Helper()
	out, err := exec.Command("diff", "-r", "--no-dereference", a, b).CombinedOutput()
	if err != nil {
		t.Fatalf("diff -r %s %s: %v\n%s", a, b, err, out)
	}
}

func waitTimeout(cmd *exec.Cmd, d time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		_ = cmd.Process.Kill()
		return errors.New("timed out")
	}
}

// TestDemo runs the README's first command as users do (the built binary)
// and checks that it ends by verifying the restore.
func TestDemo(t *testing.T) {
	cmd := exec.Command(agentstateBin(t), "demo")
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir(), "AGENTSTATE_STORE=", "AGENTSTATE_STATE_DIR=")
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("demo OK")) {
		t.Fatalf("agentstate demo: %v\n%s", err, out)
	}
	if !bytes.Contains(out, []byte("no change, 0 requests")) {
		t.Fatalf("demo: the checkpoint of the restored tree should cost no request:\n%s", out)
	}
}

// withoutCABundle drops AWS_CA_BUNDLE (set on some machines) from a
// command's environment: the AWS SDKs in rclone and Litestream fail to apply
// it to a plain-HTTP loopback endpoint, where it is irrelevant anyway.
func withoutCABundle(cmd *exec.Cmd) *exec.Cmd {
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = slices.DeleteFunc(cmd.Env, func(kv string) bool { return strings.HasPrefix(kv, "AWS_CA_BUNDLE=") })
	return cmd
}

// syncBuffer collects a child's output while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
