//go:build linux

package supervisor

// Subprocess tests: the supervisor runs in a re-executed test binary, so it
// gets real signals (SIGKILL included) and installs its own handlers; the
// harness is the test binary again in its "writer" role.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

type subprocess struct {
	cmd      *exec.Cmd
	cfg      supConfig
	out      *lockedBuffer
	childPid string
	exited   chan struct{}
}

func startSupervisor(t *testing.T, child childConfig, cfg supConfig) *subprocess {
	t.Helper()
	return startSupervisorIn(t, child, cfg, false, nil)
}

// startSupervisorIn starts the supervisor, as PID 1 of a new PID namespace
// if pidns; wrap, if set, rewrites the harness command.
func startSupervisorIn(t *testing.T, child childConfig, cfg supConfig, pidns bool, wrap func([]string) []string) *subprocess {
	t.Helper()
	dir := t.TempDir()
	child.Out = filepath.Join(dir, "transcript")
	child.PidFile = filepath.Join(dir, "child.pid")
	if child.EveryMS == 0 {
		child.EveryMS = 10
	}
	cj, _ := json.Marshal(child)
	// GORACE: a race-enabled binary otherwise sleeps 1 s on exit.
	cfg.Command = []string{"/usr/bin/env", "GORACE=atexit_sleep_ms=0", envRole + "=child", envConfig + "=" + string(cj), os.Args[0]}
	if wrap != nil {
		cfg.Command = wrap(cfg.Command)
	}
	cfg.Watch = child.Out
	cfg.ChildPidFile = child.PidFile
	cfg.SnapDir = filepath.Join(dir, "snaps")
	if err := os.Mkdir(cfg.SnapDir, 0o700); err != nil {
		t.Fatal(err)
	}
	sj, _ := json.Marshal(cfg)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "GORACE=atexit_sleep_ms=0", envRole+"=supervisor", envConfig+"="+string(sj))
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if pidns {
		cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWPID
	}
	if err := cmd.Start(); err != nil {
		if pidns {
			t.Skipf("cannot create a PID namespace: %v", err)
		}
		t.Fatal(err)
	}
	sp := &subprocess{cmd: cmd, cfg: cfg, out: out, childPid: child.PidFile, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(sp.exited) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // as PID 1, its death kills the namespace
		if b, err := os.ReadFile(child.PidFile); err == nil && !pidns {
			if pid, _ := strconv.Atoi(string(b)); pid > 0 {
				_ = syscall.Kill(-pid, syscall.SIGKILL)
			}
		}
		<-sp.exited
		if t.Failed() {
			t.Logf("supervisor output:\n%s", out.String())
		}
	})
	return sp
}

func (s *subprocess) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := s.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v: %v", sig, err)
	}
}

func (s *subprocess) wait(t *testing.T) int {
	t.Helper()
	select {
	case <-s.exited:
	case <-time.After(30 * time.Second):
		t.Fatal("supervisor did not exit")
	}
	return s.cmd.ProcessState.ExitCode()
}

// snaps returns the snapshot file names in checkpoint order.
func (s *subprocess) snaps() []string {
	m, _ := filepath.Glob(filepath.Join(s.cfg.SnapDir, "snap-*"))
	var out []string
	for _, n := range m {
		if !strings.HasSuffix(n, ".tmp") {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}

func (s *subprocess) log() []string {
	b, _ := os.ReadFile(filepath.Join(s.cfg.SnapDir, "log"))
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

func TestSubprocessStop(t *testing.T) {
	for _, tc := range []struct {
		name     string
		onStop   string
		exit     int
		sig      syscall.Signal
		policy   string
		usr1     bool
		want     int
		wantLast bool // the child wrote "last line" on the signal
	}{
		{"SIGTERM, child flushes and exits 0", "flush", 0, syscall.SIGTERM, "interval", false, 0, true},
		{"SIGTERM, child flushes and exits 3", "flush", 3, syscall.SIGTERM, "interval", false, 3, true},
		{"SIGINT, child flushes", "flush", 0, syscall.SIGINT, "interval", false, 0, true},
		{"SIGTERM kills the child", "default", 0, syscall.SIGTERM, "interval", false, 128 + 15, false},
		{"SIGHUP kills the child", "default", 0, syscall.SIGHUP, "interval", false, 128 + 1, false},
		{"SIGTERM ignored, killed after grace", "ignore", 0, syscall.SIGTERM, "interval", false, 128 + 9, false},
		{"manual policy: SIGUSR1 then SIGTERM", "flush", 0, syscall.SIGTERM, "manual", true, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startSupervisor(t, childConfig{OnStop: tc.onStop, ExitCode: tc.exit},
				supConfig{Policy: tc.policy, Restart: "on-failure", IntervalMS: 100, GraceMS: 300})
			readPid(t, s.childPid)
			eventually(t, 20*time.Second, "the child to write", func() bool { return countLines(s.cfg.Watch) >= 3 })
			if tc.usr1 {
				s.signal(t, syscall.SIGUSR1)
				eventually(t, 20*time.Second, "the SIGUSR1 checkpoint", func() bool { return len(s.snaps()) == 1 })
			}
			s.signal(t, tc.sig)
			if code := s.wait(t); code != tc.want {
				t.Errorf("supervisor exit status %d, want the child's %d", code, tc.want)
			}
			snaps := s.snaps()
			if len(snaps) == 0 || !strings.HasSuffix(snaps[len(snaps)-1], "-final") {
				t.Fatalf("no final checkpoint: %v", snaps)
			}
			final, _ := os.ReadFile(snaps[len(snaps)-1])
			live, _ := os.ReadFile(s.cfg.Watch)
			if !bytes.Equal(final, live) {
				t.Errorf("final checkpoint holds %d bytes, the transcript %d: not everything the child wrote", len(final), len(live))
			}
			if got := bytes.HasSuffix(final, []byte("last line\n")); got != tc.wantLast {
				t.Errorf("final checkpoint ends with the child's last line: %v, want %v", got, tc.wantLast)
			}
			log := s.log()
			if l := log[len(log)-1]; !strings.HasSuffix(l, "final alive=false") {
				t.Errorf("final checkpoint log %q: want it taken after the child exited", l)
			}
			for _, l := range log {
				if tc.policy == "manual" && strings.Contains(l, " interval ") {
					t.Errorf("timer checkpoint under the manual policy: %q", l)
				}
			}
			if tc.usr1 && !strings.HasSuffix(log[0], " signal alive=true") {
				t.Errorf("first checkpoint %q: want the SIGUSR1 one while the child runs", log[0])
			}
		})
	}
}

// More signals while the final checkpoint runs do not abort it.
func TestSubprocessSecondSignalDuringFinalCheckpoint(t *testing.T) {
	s := startSupervisor(t, childConfig{OnStop: "flush", ExitCode: 4},
		supConfig{Policy: "interval", Restart: "on-failure", IntervalMS: 100, GraceMS: 300, FinalDelayMS: 800})
	readPid(t, s.childPid)
	s.signal(t, syscall.SIGTERM)
	eventually(t, 20*time.Second, "the final checkpoint to start", func() bool {
		_, err := os.Stat(filepath.Join(s.cfg.SnapDir, "final-started"))
		return err == nil
	})
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGUSR1, syscall.SIGTERM} {
		s.signal(t, sig)
		time.Sleep(20 * time.Millisecond)
	}
	if code := s.wait(t); code != 4 {
		t.Errorf("exit status %d, want the child's 4", code)
	}
	snaps := s.snaps()
	if len(snaps) == 0 || !strings.HasSuffix(snaps[len(snaps)-1], "-final") {
		t.Fatalf("final checkpoint lost: %v", snaps)
	}
	if final, _ := os.ReadFile(snaps[len(snaps)-1]); !bytes.HasSuffix(final, []byte("last line\n")) {
		t.Errorf("final checkpoint does not hold the child's last line")
	}
	if !strings.Contains(s.out.String(), "signal ignored: the final checkpoint is in progress") {
		t.Errorf("the extra signals were not seen during the final checkpoint")
	}
}

// SIGKILL of the supervisor kills the child too (PR_SET_PDEATHSIG), and the
// newest checkpoint misses at most about one interval of lines.
func TestSubprocessSIGKILL(t *testing.T) {
	const interval = 200 * time.Millisecond
	s := startSupervisor(t, childConfig{OnStop: "flush", EveryMS: 5},
		supConfig{Policy: "interval", Restart: "on-failure", IntervalMS: int(interval / time.Millisecond), GraceMS: 300})
	childPid := readPid(t, s.childPid)
	eventually(t, 20*time.Second, "3 timer checkpoints", func() bool { return len(s.snaps()) >= 3 })
	time.Sleep(8 * interval) // if timer checkpoints stopped now, the loss would exceed the bound below
	s.signal(t, syscall.SIGKILL)
	s.wait(t)
	eventually(t, 10*time.Second, "the child to die with the supervisor", func() bool { return !processAlive(childPid) })

	snaps := s.snaps()
	last, _ := os.ReadFile(snaps[len(snaps)-1])
	live, _ := os.ReadFile(s.cfg.Watch)
	if !bytes.HasPrefix(live, last) || len(last) == 0 {
		t.Fatalf("newest checkpoint (%d bytes) is not a prefix of the transcript (%d bytes)", len(last), len(live))
	}
	lost := stamps(t, live[len(last):])
	kept := stamps(t, last)
	if len(lost) == 0 {
		return
	}
	span := time.Duration(lost[len(lost)-1] - kept[len(kept)-1])
	if span > 5*interval {
		t.Errorf("lost %d lines spanning %v; want about one interval (%v)", len(lost), span, interval)
	}
	t.Logf("%d checkpoints; SIGKILL lost %d lines spanning %v", len(snaps), len(lost), span)
}

// stamps parses the t= timestamps of writer lines.
func stamps(t *testing.T, b []byte) []int64 {
	t.Helper()
	var out []int64
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		var n int
		var ts int64
		if _, err := fmt.Sscanf(sc.Text(), "line %d t=%d", &n, &ts); err != nil {
			t.Fatalf("bad line %q", sc.Text())
		}
		out = append(out, ts)
	}
	return out
}

// As PID 1 of a PID namespace (as in a container): an orphaned grandchild
// is re-parented to the supervisor and reaped, and SIGTERM (which reaches
// PID 1 only because it has a handler) still gives the full stop sequence.
func TestSubprocessAsPID1(t *testing.T) {
	orphan := filepath.Join(t.TempDir(), "orphan")
	// The harness starts a shell that backgrounds a grandchild and exits; the
	// grandchild records its pid as the host sees it (/proc is the host's),
	// sleeps and exits. Then the harness execs the writer.
	wrap := func(cmd []string) []string {
		return append([]string{"/bin/sh", "-c",
			`/bin/sh -c '/bin/sh -c "cd -P /proc/self && pwd > \"\$0\"; exec sleep 0.5" "$0" &' "$0"; exec "$@"`,
			orphan}, cmd...)
	}
	s := startSupervisorIn(t, childConfig{OnStop: "flush"},
		supConfig{Policy: "interval", Restart: "on-failure", IntervalMS: 100, GraceMS: 300}, true, wrap)
	readPid(t, s.childPid)
	var pid int
	eventually(t, 20*time.Second, "the orphan's pid", func() bool {
		b, err := os.ReadFile(orphan)
		pid, _ = strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(string(b)), "/proc/"))
		return err == nil && pid > 0
	})
	eventually(t, 20*time.Second, "the orphan to be re-parented to the supervisor", func() bool { return ppidOf(pid) == s.cmd.Process.Pid })
	eventually(t, 20*time.Second, "the orphan to be reaped", func() bool { return !procExists(pid) })
	s.signal(t, syscall.SIGTERM)
	if code := s.wait(t); code != 0 {
		t.Errorf("exit status %d, want the child's 0", code)
	}
	snaps := s.snaps()
	if len(snaps) == 0 || !strings.HasSuffix(snaps[len(snaps)-1], "-final") {
		t.Fatalf("no final checkpoint: %v", snaps)
	}
	if final, _ := os.ReadFile(snaps[len(snaps)-1]); !bytes.HasSuffix(final, []byte("last line\n")) {
		t.Errorf("final checkpoint does not hold the child's last line")
	}
}
