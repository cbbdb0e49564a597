//go:build linux

package supervisor

// In-process tests: Run runs in the test process with signals injected
// through Options.Signals; the children are real processes (/bin/sh).
// They must not run in parallel: Run owns wait(2) for the whole process.

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestRestoreFailureNeverStartsChild(t *testing.T) {
	dir := t.TempDir()
	marker := filepath.Join(dir, "started")
	cp := &fakeCP{restoreErr: errors.New(`adapter "codex": restore incomplete: 2 paths not written: sessions/a.jsonl`)}
	r := startRun(t, context.Background(), cp, fast("/bin/sh", "-c", `touch "$0"; sleep 5`, marker))
	code, err := r.wait(t)
	if code == 0 {
		t.Errorf("exit code 0 after a failed restore")
	}
	if !errors.Is(err, ErrRestore) || !strings.Contains(err.Error(), `adapter "codex"`) || !strings.Contains(err.Error(), "sessions/a.jsonl") {
		t.Errorf("error %v: want ErrRestore naming the adapter and what failed", err)
	}
	time.Sleep(100 * time.Millisecond) // a child, had one been started, would have touched it by now
	if _, err := os.Stat(marker); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the child was started after a failed restore (marker: %v)", err)
	}
	if n := cp.count(""); n != 0 {
		t.Errorf("%d checkpoints after a failed restore, want 0", n)
	}
}

func TestStopDuringRestoreNeverStartsChild(t *testing.T) {
	dir := t.TempDir()
	marker := filepath.Join(dir, "started")
	cp := &slowRestore{}
	r := startRun(t, context.Background(), cp, fast("/bin/sh", "-c", `touch "$0"`, marker))
	eventually(t, 10*time.Second, "restore to start", func() bool { return cp.started.Load() })
	r.sigs <- syscall.SIGTERM
	code, err := r.wait(t)
	if code != 128+int(syscall.SIGTERM) || !errors.Is(err, ErrStopped) || !errors.Is(err, context.Canceled) {
		t.Errorf("got %d, %v; want 143 and ErrStopped wrapping the cancelled restore", code, err)
	}
	if _, err := os.Stat(marker); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("child started after a stop during restore")
	}
}

// slowRestore blocks in Restore until its context is cancelled.
type slowRestore struct {
	fakeCP
	started atomic.Bool
}

func (s *slowRestore) Restore(ctx context.Context) error {
	s.started.Store(true)
	<-ctx.Done()
	return ctx.Err()
}

func TestStartFailure(t *testing.T) {
	for _, tc := range []struct {
		name string
		cmd  []string
		want int
	}{
		{"not in PATH", []string{"agentstate-no-such-harness"}, 127},
		{"no such file", []string{"/nonexistent/harness"}, 127},
		{"not executable", []string{"/etc/hostname"}, 126},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cp := &fakeCP{}
			code, err := startRun(t, context.Background(), cp, fast(tc.cmd...)).wait(t)
			if code != tc.want || !errors.Is(err, ErrStart) {
				t.Errorf("got %d, %v; want %d and ErrStart", code, err, tc.want)
			}
			if n := cp.count(""); n != 0 {
				t.Errorf("%d checkpoints although nothing ran", n)
			}
		})
	}
}

// A child that ends on its own without being restarted: Run exits with its
// status after one final checkpoint, passing stdout/stderr through.
func TestExitsWithChild(t *testing.T) {
	for _, tc := range []struct {
		name    string
		script  string
		restart RestartPolicy
		want    int
	}{
		{"exit 0 is not a failure", "exit 0", RestartOnFailure, 0},
		{"exit 3 with restart never", "exit 3", RestartNever, 3},
		{"SIGTERM is a clean stop", "kill -TERM $$; sleep 5", RestartOnFailure, 128 + int(syscall.SIGTERM)},
		{"SIGINT is a clean stop", "kill -INT $$; sleep 5", RestartOnFailure, 128 + int(syscall.SIGINT)},
		{"SIGKILL with restart never", "kill -KILL $$", RestartNever, 128 + int(syscall.SIGKILL)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			starts := filepath.Join(dir, "starts")
			var stdout, stderr lockedBuffer
			o := fast("/bin/sh", "-c", `echo start >> "$0"; echo out; echo err >&2; `+tc.script, starts)
			o.Restart, o.Stdout, o.Stderr = tc.restart, &stdout, &stderr
			cp := &fakeCP{}
			code, err := startRun(t, context.Background(), cp, o).wait(t)
			if code != tc.want || err != nil {
				t.Errorf("got %d, %v; want %d, nil", code, err, tc.want)
			}
			if n := countLines(starts); n != 1 {
				t.Errorf("started %d times, want 1", n)
			}
			if c := cp.snapshot(); len(c) != 1 || c[0].trig != TriggerFinal {
				t.Errorf("checkpoints %+v, want one final", c)
			}
			if stdout.String() != "out\n" || stderr.String() != "err\n" {
				t.Errorf("stdout %q, stderr %q: not passed through", stdout.String(), stderr.String())
			}
		})
	}
}

func TestStdinPassedThrough(t *testing.T) {
	var out lockedBuffer
	o := fast("/bin/sh", "-c", "read x; echo got $x")
	o.Stdin, o.Stdout = strings.NewReader("hello\n"), &out
	code, err := startRun(t, context.Background(), &fakeCP{}, o).wait(t)
	if code != 0 || err != nil || out.String() != "got hello\n" {
		t.Errorf("got %d, %v, %q", code, err, out.String())
	}
}

// Restart until the cap, unless the child stayed up HealthyAfter, which
// resets the streak.
func TestRestarts(t *testing.T) {
	for _, tc := range []struct {
		name        string
		script      string
		healthy     time.Duration
		maxRestarts int
		wantCap     bool // else: still restarting after more starts than the cap allows; stopped by SIGTERM
	}{
		{"crash loop hits the cap", "exit 1", time.Hour, 3, true},
		{"crash by signal hits the cap", "kill -SEGV $$", time.Hour, 2, true},
		{"healthy uptime resets the counter", "sleep 0.3; exit 1", 100 * time.Millisecond, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			starts := filepath.Join(dir, "starts")
			o := fast("/bin/sh", "-c", `echo start >> "$0"; `+tc.script, starts)
			o.HealthyAfter, o.MaxRestarts = tc.healthy, tc.maxRestarts
			o.Metrics = NewMetrics()
			cp := &fakeCP{observe: func() string { return strconv.Itoa(countLines(starts)) }}
			r := startRun(t, context.Background(), cp, o)
			if tc.wantCap {
				code, err := r.wait(t)
				if code == 0 || !errors.Is(err, ErrRestartLimit) {
					t.Errorf("got %d, %v; want non-zero and ErrRestartLimit", code, err)
				}
				if n := countLines(starts); n != tc.maxRestarts+1 {
					t.Errorf("started %d times, want %d", n, tc.maxRestarts+1)
				}
				c := cp.snapshot()
				if len(c) != 1 || c[0].trig != TriggerFinal || c[0].seen != strconv.Itoa(tc.maxRestarts+1) {
					t.Errorf("checkpoints %+v: want one final one, after the last start", c)
				}
				if got := scrape(t, o.Metrics)["agentstate_child_restarts_total"]; got != float64(tc.maxRestarts) {
					t.Errorf("restarts metric %v, want %d", got, tc.maxRestarts)
				}
				return
			}
			want := tc.maxRestarts + 3
			eventually(t, 20*time.Second, "restarts beyond the cap", func() bool { return countLines(starts) >= want })
			if !r.running() {
				t.Fatalf("Run returned %d, %v although the child was healthy between crashes", r.code, r.err)
			}
			r.sigs <- syscall.SIGTERM
			code, err := r.wait(t)
			if err != nil || (code != 1 && code != 128+int(syscall.SIGTERM)) {
				t.Errorf("got %d, %v; want the child's status (1 or 143) and no error", code, err)
			}
			if c := cp.snapshot(); len(c) != 1 || c[0].trig != TriggerFinal {
				t.Errorf("checkpoints %+v, want one final", c)
			}
		})
	}
}

func TestStopDuringBackoff(t *testing.T) {
	dir := t.TempDir()
	starts := filepath.Join(dir, "starts")
	o := fast("/bin/sh", "-c", `echo start >> "$0"; exit 7`, starts)
	o.Backoff = Backoff{Initial: time.Hour}
	cp := &fakeCP{}
	r := startRun(t, context.Background(), cp, o)
	eventually(t, 10*time.Second, "backoff", func() bool { return strings.Contains(r.logs.String(), "restarting it") })
	r.sigs <- syscall.SIGINT
	code, err := r.wait(t)
	if code != 7 || err != nil {
		t.Errorf("got %d, %v; want the last child's status 7", code, err)
	}
	if n := countLines(starts); n != 1 {
		t.Errorf("started %d times", n)
	}
	if n := cp.count(TriggerFinal); n != 1 {
		t.Errorf("%d final checkpoints", n)
	}
}

func TestContextCancelStopsGracefully(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	ctx, cancel := context.WithCancel(context.Background())
	o := fast("/bin/sh", "-c", `trap 'echo bye >> "$0"; exit 0' TERM; echo $$ > "$0.pid"; while :; do sleep 0.01; done`, out)
	cp := &fakeCP{observe: func() string { b, _ := os.ReadFile(out); return string(b) }}
	r := startRun(t, ctx, cp, o)
	readPid(t, out+".pid")
	cancel()
	code, err := r.wait(t)
	c := cp.snapshot()
	if code != 0 || err != nil || len(c) != 1 || c[0].seen != "bye\n" {
		t.Errorf("got %d, %v, checkpoints %+v; want 0, nil and a final checkpoint that saw the child's last line", code, err, c)
	}
}

func TestSIGUSR1(t *testing.T) {
	for _, tc := range []struct {
		policy     Policy
		wantSignal int
		wantFinal  int
	}{
		{PolicyInterval, 1, 1},
		{PolicyManual, 1, 1},
		{PolicyNone, 0, 0},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			o := fast("/bin/sleep", "30")
			o.Policy = tc.policy
			o.Interval = time.Hour
			cp := &fakeCP{}
			r := startRun(t, context.Background(), cp, o)
			eventually(t, 10*time.Second, "child start", func() bool { return strings.Contains(r.logs.String(), "harness started") })
			r.sigs <- syscall.SIGUSR1
			if tc.wantSignal > 0 {
				eventually(t, 10*time.Second, "SIGUSR1 checkpoint", func() bool { return cp.count(TriggerSignal) == tc.wantSignal })
			} else {
				time.Sleep(200 * time.Millisecond)
			}
			r.sigs <- syscall.SIGTERM
			code, err := r.wait(t)
			if code != 128+int(syscall.SIGTERM) || err != nil {
				t.Errorf("got %d, %v", code, err)
			}
			if s, f := cp.count(TriggerSignal), cp.count(TriggerFinal); s != tc.wantSignal || f != tc.wantFinal || cp.count(TriggerInterval) != 0 {
				t.Errorf("signal %d final %d interval %d checkpoints; want %d, %d, 0", s, f, cp.count(TriggerInterval), tc.wantSignal, tc.wantFinal)
			}
		})
	}
}

func TestCheckpointFailuresKeepChildRunning(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pid")
	o := fast("/bin/sh", "-c", `echo $$ >> "$0"; exec sleep 30`, pidFile)
	o.Interval = 30 * time.Millisecond
	o.Metrics = NewMetrics()
	cp := &fakeCP{failFirst: 3}
	r := startRun(t, context.Background(), cp, o)
	pid := readPid(t, pidFile)
	eventually(t, 20*time.Second, "checkpoints to succeed after failures", func() bool {
		ok := 0
		for _, c := range cp.snapshot() {
			if c.err == nil {
				ok++
			}
		}
		return ok >= 2
	})
	if !processAlive(pid) || countLines(pidFile) != 1 {
		t.Fatalf("child %d alive=%v, started %d times: failed checkpoints disturbed it", pid, processAlive(pid), countLines(pidFile))
	}
	m := scrape(t, o.Metrics)
	if m["agentstate_checkpoint_failures_total"] != 3 || m["agentstate_checkpoint_last_success_timestamp_seconds"] == 0 || m["agentstate_child_up"] != 1 {
		t.Errorf("metrics %v", m)
	}
	r.sigs <- syscall.SIGTERM
	if code, err := r.wait(t); code != 128+int(syscall.SIGTERM) || err != nil {
		t.Errorf("got %d, %v", code, err)
	}
}

func TestFinalCheckpointFailure(t *testing.T) {
	cp := &fakeCP{failFirst: 1}
	code, err := startRun(t, context.Background(), cp, fast("/bin/true")).wait(t)
	if code != 1 || !errors.Is(err, ErrFinalCheckpoint) {
		t.Errorf("got %d, %v; want 1 and ErrFinalCheckpoint (0 would claim the state was saved)", code, err)
	}
}

// Slow checkpoints, a fast timer, a storm of SIGUSR1 and a stop in the
// middle of a checkpoint: never two at once, and the final one comes last.
func TestNoOverlappingCheckpoints(t *testing.T) {
	o := fast("/bin/sleep", "30")
	o.Interval = 15 * time.Millisecond
	cp := &fakeCP{delay: 60 * time.Millisecond}
	r := startRun(t, context.Background(), cp, o)
	for i := 0; i < 40; i++ {
		r.sigs <- syscall.SIGUSR1
		time.Sleep(5 * time.Millisecond)
	}
	// The storm kept one SIGUSR1 checkpoint queued, so ticks were skipped;
	// now ticks get their turn.
	eventually(t, 10*time.Second, "a timer checkpoint, then one in flight", func() bool {
		return cp.count(TriggerInterval) >= 1 && cp.inflight.Load() == 1
	})
	r.sigs <- syscall.SIGTERM
	r.wait(t)
	if cp.overlap.Load() {
		t.Fatal("two checkpoints overlapped")
	}
	c := cp.snapshot()
	for i := 1; i < len(c); i++ {
		if c[i].start.Before(c[i-1].end) {
			t.Errorf("checkpoint %d started before %d ended", i, i-1)
		}
	}
	if c[len(c)-1].trig != TriggerFinal || cp.count(TriggerFinal) != 1 || cp.count(TriggerSignal) == 0 || cp.count(TriggerInterval) == 0 {
		t.Errorf("checkpoints: %d total, last %s, %d final, %d signal, %d interval", len(c), c[len(c)-1].trig,
			cp.count(TriggerFinal), cp.count(TriggerSignal), cp.count(TriggerInterval))
	}
}

// An orphaned grandchild is re-parented to the supervisor (subreaper) and
// reaped, while the main child's own status still reaches Run.
func TestReapsOrphans(t *testing.T) {
	dir := t.TempDir()
	orphanPid := filepath.Join(dir, "orphan")
	o := fast("/bin/sh", "-c", `/bin/sh -c 'sleep 0.6 & echo $! > "$0"' "$0"; sleep 1.5; exit 5`, orphanPid)
	o.Restart = RestartNever
	r := startRun(t, context.Background(), &fakeCP{}, o)
	pid := readPid(t, orphanPid)
	eventually(t, 10*time.Second, "the orphan to be re-parented to us", func() bool { return ppidOf(pid) == os.Getpid() })
	eventually(t, 10*time.Second, "the orphan to be reaped (not left a zombie)", func() bool { return !procExists(pid) })
	if !r.running() {
		t.Fatalf("Run returned early: %d, %v", r.code, r.err)
	}
	if code, err := r.wait(t); code != 5 || err != nil {
		t.Errorf("got %d, %v; want the main child's status 5", code, err)
	}
}

// A child ignoring SIGTERM is SIGKILLed after Grace, and so is a
// grandchild left in its process group.
func TestGraceThenKill(t *testing.T) {
	dir := t.TempDir()
	gc := filepath.Join(dir, "grandchild")
	o := fast("/bin/sh", "-c", `trap '' TERM; /bin/sh -c 'trap "" TERM; echo $$ > "$0"; while :; do sleep 0.01; done' "$0" & while :; do sleep 0.01; done`, gc)
	o.Grace = 200 * time.Millisecond
	cp := &fakeCP{}
	r := startRun(t, context.Background(), cp, o)
	gpid := readPid(t, gc)
	r.sigs <- syscall.SIGTERM
	code, err := r.wait(t)
	if code != 128+int(syscall.SIGKILL) || err != nil {
		t.Errorf("got %d, %v; want 137", code, err)
	}
	if processAlive(gpid) {
		t.Errorf("grandchild %d survived", gpid)
	}
	if cp.count(TriggerFinal) != 1 {
		t.Errorf("no final checkpoint")
	}
}

func TestShouldRestart(t *testing.T) {
	exited := func(c int) unix.WaitStatus { return unix.WaitStatus(c << 8) }
	killed := func(s unix.Signal) unix.WaitStatus { return unix.WaitStatus(s) }
	for _, tc := range []struct {
		ws                unix.WaitStatus
		onFailure, always bool
		code              int
	}{
		{exited(0), false, true, 0},
		{exited(1), true, true, 1},
		{exited(255), true, true, 255},
		{killed(unix.SIGKILL), true, true, 137},
		{killed(unix.SIGSEGV), true, true, 139},
		{killed(unix.SIGTERM), false, true, 143},
		{killed(unix.SIGINT), false, true, 130},
		{killed(unix.SIGHUP), false, true, 129},
		{killed(unix.SIGPIPE), false, true, 141},
	} {
		if got := shouldRestart(RestartOnFailure, tc.ws); got != tc.onFailure {
			t.Errorf("on-failure, status %d: restart=%v", statusCode(tc.ws), got)
		}
		if got := shouldRestart(RestartAlways, tc.ws); got != tc.always {
			t.Errorf("always, status %d: restart=%v", statusCode(tc.ws), got)
		}
		if shouldRestart(RestartNever, tc.ws) {
			t.Errorf("never restarted")
		}
		if got := statusCode(tc.ws); got != tc.code {
			t.Errorf("status code %d, want %d", got, tc.code)
		}
	}
}

func TestBackoffAndParse(t *testing.T) {
	b := Backoff{Initial: time.Second, Max: 5 * time.Second}
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 5 * time.Second, 50: 5 * time.Second} {
		if got := b.Delay(n); got != want {
			t.Errorf("Delay(%d) = %v, want %v", n, got, want)
		}
	}
	for _, s := range []string{"interval", "manual", "none"} {
		if p, err := ParsePolicy(s); err != nil || p.String() != s {
			t.Errorf("ParsePolicy(%q) = %v, %v", s, p, err)
		}
	}
	for _, s := range []string{"on-failure", "always", "never"} {
		if p, err := ParseRestartPolicy(s); err != nil || p.String() != s {
			t.Errorf("ParseRestartPolicy(%q) = %v, %v", s, p, err)
		}
	}
	if _, err := ParsePolicy("hourly"); err == nil {
		t.Error("bad policy accepted")
	}
	if _, err := ParseRestartPolicy("sometimes"); err == nil {
		t.Error("bad restart policy accepted")
	}
}

// A closed Signals channel is not a stream of stop signals.
func TestClosedSignalsChannel(t *testing.T) {
	sigs := make(chan os.Signal)
	o := fast("/bin/sh", "-c", "sleep 0.2; exit 6")
	o.Signals, o.Restart = sigs, RestartNever
	close(sigs)
	done := make(chan struct{})
	var code int
	var err error
	go func() { defer close(done); code, err = Run(context.Background(), &fakeCP{}, o) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	if code != 6 || err != nil {
		t.Errorf("got %d, %v; want the child's 6", code, err)
	}
}
