//go:build linux

package supervisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// The test binary re-executes itself as a harness child or as a supervisor
// (so tests can send a supervisor real signals, SIGKILL included).
const (
	envRole   = "AGENTSTATE_SUPERVISOR_TEST_ROLE" // "child" or "supervisor"
	envConfig = "AGENTSTATE_SUPERVISOR_TEST_CONFIG"
)

func TestMain(m *testing.M) {
	switch os.Getenv(envRole) {
	case "child":
		os.Exit(childMain())
	case "supervisor":
		os.Exit(supervisorMain())
	}
	os.Exit(m.Run())
}

// childConfig drives the "writer" harness: it appends a numbered,
// timestamped line to Out every EveryMS, and on SIGTERM/SIGINT/SIGHUP
// reacts as OnStop says: "flush" (wait a little, write "last line", exit
// ExitCode), "ignore" (keep writing), "default" (no handler: die by the signal).
type childConfig struct {
	Out      string
	PidFile  string
	EveryMS  int
	OnStop   string
	ExitCode int
}

func childMain() int {
	var c childConfig
	if err := json.Unmarshal([]byte(os.Getenv(envConfig)), &c); err != nil {
		fmt.Fprintln(os.Stderr, "child config:", err)
		return 99
	}
	stop := make(chan os.Signal, 4)
	if c.OnStop != "default" {
		signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	}
	f, err := os.OpenFile(c.Out, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 98
	}
	if err := writeAtomic(c.PidFile, []byte(strconv.Itoa(os.Getpid()))); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 97
	}
	fmt.Println("writer child started") // through the supervisor's stdout
	t := time.NewTicker(time.Duration(c.EveryMS) * time.Millisecond)
	for n := 1; ; n++ {
		select {
		case <-t.C:
			fmt.Fprintf(f, "line %d t=%d\n", n, time.Now().UnixNano())
		case <-stop:
			if c.OnStop == "ignore" {
				continue
			}
			time.Sleep(50 * time.Millisecond) // "flushing"
			fmt.Fprintf(f, "last line\n")
			_ = f.Close()
			return c.ExitCode
		}
	}
}

// supConfig drives a supervisor run in a subprocess with a fileCheckpointer.
type supConfig struct {
	Command      []string
	Policy       string
	Restart      string
	IntervalMS   int
	GraceMS      int
	Watch        string // the file a checkpoint copies
	SnapDir      string
	ChildPidFile string
	FinalDelayMS int // the final checkpoint takes this long
}

func supervisorMain() int {
	var c supConfig
	if err := json.Unmarshal([]byte(os.Getenv(envConfig)), &c); err != nil {
		fmt.Fprintln(os.Stderr, "supervisor config:", err)
		return 99
	}
	pol, _ := ParsePolicy(c.Policy)
	rp, _ := ParseRestartPolicy(c.Restart)
	cp := &fileCheckpointer{c: c}
	code, err := Run(context.Background(), cp, Options{
		Command:  c.Command,
		Env:      os.Environ(),
		Stdin:    os.Stdin,
		Stdout:   os.Stdout,
		Stderr:   os.Stderr,
		Policy:   pol,
		Restart:  rp,
		Interval: time.Duration(c.IntervalMS) * time.Millisecond,
		Grace:    time.Duration(c.GraceMS) * time.Millisecond,
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "supervisor: Run:", err)
	}
	return code
}

// fileCheckpointer "checkpoints" by copying the watched file into
// SnapDir/snap-NNNN-<trigger> (atomically), and logs each checkpoint with
// whether the child was still alive.
type fileCheckpointer struct {
	c supConfig
	n int
}

func (f *fileCheckpointer) Restore(ctx context.Context) error { return nil }

func (f *fileCheckpointer) Checkpoint(ctx context.Context) error {
	f.n++
	trig := TriggerOf(ctx)
	if trig == TriggerFinal {
		_ = os.WriteFile(filepath.Join(f.c.SnapDir, "final-started"), nil, 0o600)
		time.Sleep(time.Duration(f.c.FinalDelayMS) * time.Millisecond)
	}
	data, err := os.ReadFile(f.c.Watch)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := writeAtomic(filepath.Join(f.c.SnapDir, fmt.Sprintf("snap-%04d-%s", f.n, trig)), data); err != nil {
		return err
	}
	alive := "unknown"
	if b, err := os.ReadFile(f.c.ChildPidFile); err == nil {
		pid, _ := strconv.Atoi(string(b))
		alive = strconv.FormatBool(processAlive(pid))
	}
	lf, err := os.OpenFile(filepath.Join(f.c.SnapDir, "log"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	fmt.Fprintf(lf, "%d %s alive=%s\n", f.n, trig, alive)
	return lf.Close()
}

func writeAtomic(name string, data []byte) error {
	tmp := name + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, name)
}

// processAlive reports whether pid exists and is not a zombie.
func processAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

// procExists reports whether /proc/pid exists (a zombie exists).
func procExists(pid int) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	return err == nil
}

// ppidOf returns the parent pid of pid from /proc, or -1.
func ppidOf(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return -1
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	f := strings.Fields(s[i+1:])
	if len(f) < 2 {
		return -1
	}
	p, _ := strconv.Atoi(f[1])
	return p
}

// eventually polls cond until it holds or the (generous) deadline passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func readPid(t *testing.T, name string) int {
	t.Helper()
	var pid int
	eventually(t, 20*time.Second, "pid file "+name, func() bool {
		b, err := os.ReadFile(name)
		if err != nil {
			return false
		}
		pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err == nil && pid > 0
	})
	return pid
}

func countLines(name string) int {
	b, _ := os.ReadFile(name)
	return bytes.Count(b, []byte("\n"))
}

// fakeCP is an in-process Checkpointer that records every call and fails
// the test (through overlap) if two checkpoints ever run at once.
type fakeCP struct {
	restoreErr error
	failFirst  int           // the first failFirst checkpoints fail
	delay      time.Duration // each checkpoint takes this long
	observe    func() string // what the checkpoint "captured"
	results    []AdapterResult

	inflight atomic.Int32
	overlap  atomic.Bool
	restores atomic.Int32

	mu    sync.Mutex
	calls []ckCall
}

type ckCall struct {
	trig       Trigger
	start, end time.Time
	seen       string
	err        error
}

func (f *fakeCP) Restore(ctx context.Context) error {
	f.restores.Add(1)
	return f.restoreErr
}

func (f *fakeCP) Checkpoint(ctx context.Context) error {
	if f.inflight.Add(1) > 1 {
		f.overlap.Store(true)
	}
	defer f.inflight.Add(-1)
	c := ckCall{trig: TriggerOf(ctx), start: time.Now()}
	if f.delay > 0 {
		time.Sleep(f.delay)
	}
	if f.observe != nil {
		c.seen = f.observe()
	}
	f.mu.Lock()
	if len(f.calls) < f.failFirst {
		c.err = errors.New(`adapter "codex": store unreachable`)
	}
	c.end = time.Now()
	f.calls = append(f.calls, c)
	f.mu.Unlock()
	return c.err
}

func (f *fakeCP) LastResults() []AdapterResult {
	f.mu.Lock()
	defer f.mu.Unlock()
	var err error
	if n := len(f.calls); n > 0 {
		err = f.calls[n-1].err
	}
	out := make([]AdapterResult, len(f.results))
	for i, r := range f.results {
		r.Err = err
		out[i] = r
	}
	return out
}

func (f *fakeCP) snapshot() []ckCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]ckCall(nil), f.calls...)
}

func (f *fakeCP) count(trig Trigger) int {
	n := 0
	for _, c := range f.snapshot() {
		if trig == "" || c.trig == trig {
			n++
		}
	}
	return n
}

// run is an in-process Run with injected signals.
type run struct {
	sigs chan os.Signal
	done chan struct{}
	code int
	err  error
	logs *lockedBuffer
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// fast are Options with test-sized timings.
func fast(cmd ...string) Options {
	return Options{
		Command:      cmd,
		Interval:     time.Hour, // tests that want ticks set it
		Grace:        300 * time.Millisecond,
		HealthyAfter: time.Hour,
		Backoff:      Backoff{Initial: 10 * time.Millisecond, Max: 40 * time.Millisecond},
	}
}

func startRun(t *testing.T, ctx context.Context, cp Checkpointer, o Options) *run {
	t.Helper()
	r := &run{sigs: make(chan os.Signal, 8), done: make(chan struct{}), logs: &lockedBuffer{}}
	o.Signals = r.sigs
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(r.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	go func() {
		defer close(r.done)
		r.code, r.err = Run(ctx, cp, o)
	}()
	t.Cleanup(func() {
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			t.Errorf("Run did not return")
		}
		if t.Failed() {
			t.Logf("supervisor log:\n%s", r.logs.String())
		}
	})
	return r
}

func (r *run) wait(t *testing.T) (int, error) {
	t.Helper()
	select {
	case <-r.done:
		return r.code, r.err
	case <-time.After(30 * time.Second):
		t.Fatalf("Run did not return; log:\n%s", r.logs.String())
		return 0, nil
	}
}

func (r *run) running() bool {
	select {
	case <-r.done:
		return false
	default:
		return true
	}
}
