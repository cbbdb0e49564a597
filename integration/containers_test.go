package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// composeStack is one docker-compose project of docker-compose.yml, with
// images built locally (scripts/build-images) and MinIO on a free port.
type composeStack struct {
	t       *testing.T
	compose []string
	root    string
	project string
	port    int
	env     []string
}

func upStack(t *testing.T, extraEnv ...string) *composeStack {
	t.Helper()
	compose := requireDocker(t)
	root, _ := filepath.Abs("..")
	buildImagesOnce(t, root)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &composeStack{t: t, compose: compose, root: root,
		project: fmt.Sprintf("astest%d", time.Now().UnixNano()%1e9), port: port,
		env: append(append(os.Environ(), fmt.Sprintf("MINIO_PORT=%d", port)), extraEnv...)}
	t.Cleanup(func() { _ = s.cmd("down", "-v", "--remove-orphans").Run() })
	if out, err := s.cmd("up", "-d", "minio", "create-bucket").CombinedOutput(); err != nil {
		t.Fatalf("compose up: %v\n%s", err, out)
	}
	s.waitBucket()
	return s
}

var imagesBuilt bool

func buildImagesOnce(t *testing.T, root string) {
	t.Helper()
	if imagesBuilt {
		return
	}
	if out, err := exec.Command(filepath.Join(root, "scripts", "build-images")).CombinedOutput(); err != nil {
		t.Fatalf("scripts/build-images: %v\n%s", err, out)
	}
	imagesBuilt = true
}

func (s *composeStack) cmd(args ...string) *exec.Cmd {
	cmd := exec.Command(s.compose[0], append(append(s.compose[1:], "-f", filepath.Join(s.root, "docker-compose.yml"), "-p", s.project), args...)...)
	cmd.Env = s.env
	return cmd
}

func (s *composeStack) must(args ...string) string {
	s.t.Helper()
	out, err := s.cmd(args...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("compose %v: %v\n%s", args, err, out)
	}
	return string(out)
}

func (s *composeStack) waitBucket() {
	s.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		out, _ := s.cmd("ps", "-a").CombinedOutput()
		if strings.Contains(string(out), "create-bucket") && (strings.Contains(string(out), "Exit 0") || strings.Contains(string(out), "exited (0)")) {
			return
		}
		if time.Now().After(deadline) {
			logs, _ := s.cmd("logs").CombinedOutput()
			s.t.Fatalf("create-bucket did not finish:\n%s\n%s", out, logs)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// agentID is the container id of the agent service.
func (s *composeStack) agentID() string {
	return strings.TrimSpace(s.must("ps", "-q", "agent"))
}

// transcript copies the rollout out of a (running or stopped) container.
func (s *composeStack) transcript(id string) []byte {
	s.t.Helper()
	dst := filepath.Join(s.t.TempDir(), "rollout.jsonl")
	if out, err := exec.Command("docker", "cp", id+":/work/demo/rollout.jsonl", dst).CombinedOutput(); err != nil {
		s.t.Fatalf("docker cp: %v\n%s", err, out)
	}
	b, _ := os.ReadFile(dst)
	return b
}

// newAgent replaces the agent container by a new one (new disk, same bucket).
func (s *composeStack) newAgent() string {
	s.t.Helper()
	s.must("rm", "-f", "-s", "agent")
	s.must("up", "-d", "--no-deps", "agent")
	time.Sleep(2 * time.Second) // restore, then the harness starts appending
	return s.agentID()
}

func (s *composeStack) logs() string {
	out, _ := s.cmd("logs", "agent").CombinedOutput()
	return string(out)
}

func lastTS(t *testing.T, b []byte) time.Time {
	t.Helper()
	lines := bytes.Split(bytes.TrimSuffix(b, []byte("\n")), []byte("\n"))
	var l struct {
		TS time.Time `json:"ts"`
	}
	if err := json.Unmarshal(lines[len(lines)-1], &l); err != nil {
		t.Fatalf("last line %q: %v", lines[len(lines)-1], err)
	}
	return l.TS
}

func commonPrefix(a, b []byte) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// TestContainerStopRestartRestoresEverything: docker stop (SIGTERM to
// agentstate run as PID 1) takes a final checkpoint; a new container from
// the same bucket restores everything the harness wrote before the stop.
func TestContainerStopRestartRestoresEverything(t *testing.T) {
	s := upStack(t)
	s.must("up", "-d", "--no-deps", "agent")
	time.Sleep(3 * time.Second)
	first := s.agentID()
	s.must("stop", "agent")
	before := s.transcript(first)
	if len(before) == 0 {
		t.Fatalf("the harness wrote nothing\n%s", s.logs())
	}
	second := s.newAgent()
	after := s.transcript(second)
	if !bytes.HasPrefix(after, before) {
		t.Fatalf("the new container restored %d of the %d bytes written before the stop\n%s",
			commonPrefix(after, before), len(before), s.logs())
	}
}

// TestContainerKillLosesAtMostOneInterval: docker kill (SIGKILL, no final
// checkpoint): the restored transcript misses at most one interval.
func TestContainerKillLosesAtMostOneInterval(t *testing.T) {
	s := upStack(t, "AGENT_STATE_CHECKPOINT_SECONDS=1")
	s.must("up", "-d", "--no-deps", "agent")
	time.Sleep(4 * time.Second)
	first := s.agentID()
	s.must("kill", "agent")
	before := s.transcript(first)
	second := s.newAgent()
	after := s.transcript(second)
	kept := commonPrefix(after, before)
	kept = bytes.LastIndexByte(before[:kept], '\n') + 1
	if kept == 0 {
		t.Fatalf("nothing was restored\n%s", s.logs())
	}
	if lost := lastTS(t, before).Sub(lastTS(t, before[:kept])); lost > 2*time.Second {
		t.Fatalf("restore lost %v of lines with a 1 s interval\n%s", lost, s.logs())
	}
}

// TestContainerCutOffFromStore: with the agent disconnected from MinIO the
// harness keeps running and checkpoints fail and are retried; reconnected,
// the next checkpoint commits everything, and nothing is lost.
func TestContainerCutOffFromStore(t *testing.T) {
	s := upStack(t, "AGENT_STATE_CHECKPOINT_SECONDS=1")
	s.must("up", "-d", "--no-deps", "agent")
	time.Sleep(3 * time.Second)
	id := s.agentID()
	network := s.project + "_default"
	if out, err := exec.Command("docker", "network", "disconnect", network, id).CombinedOutput(); err != nil {
		t.Fatalf("disconnect: %v\n%s", err, out)
	}
	// A checkpoint in flight retries inside the S3 client before it gives
	// up: wait for the failure to be logged, however long that takes.
	deadline := time.Now().Add(3 * time.Minute)
	for !strings.Contains(s.logs(), "checkpoint failed") {
		if time.Now().After(deadline) {
			t.Fatalf("no checkpoint failed while cut off\n%s", s.logs())
		}
		time.Sleep(time.Second)
	}
	during := s.transcript(id)
	if out, err := exec.Command("docker", "network", "connect", network, id).CombinedOutput(); err != nil {
		t.Fatalf("connect: %v\n%s", err, out)
	}
	// Wait for a checkpoint committed after reconnecting.
	n := strings.Count(s.logs(), "msg=checkpoint ")
	for deadline := time.Now().Add(3 * time.Minute); strings.Count(s.logs(), "msg=checkpoint ") <= n+1; {
		if time.Now().After(deadline) {
			t.Fatalf("no checkpoint committed after reconnecting\n%s", s.logs())
		}
		time.Sleep(time.Second)
	}
	if running := strings.TrimSpace(s.must("ps", "-q", "--filter", "status=running", "agent")); running == "" {
		t.Fatalf("the agent container stopped\n%s", s.logs())
	}
	// Everything written while cut off was committed after reconnecting:
	// a new container (after a kill, so no final checkpoint helps) has it.
	s.must("kill", "agent")
	second := s.newAgent()
	if after := s.transcript(second); !bytes.HasPrefix(after, during) {
		t.Fatalf("lines written while cut off were lost: %d of %d bytes\n%s", commonPrefix(after, during), len(during), s.logs())
	}
}
