//go:build linux

package supervisor

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// exitInfo is how a main child ended.
type exitInfo struct {
	pid int
	ws  unix.WaitStatus
	at  time.Time
}

// code is the status a shell would report: the exit code, or 128+n after
// death by signal n.
func (e exitInfo) code() int { return statusCode(e.ws) }

func statusCode(ws unix.WaitStatus) int {
	switch {
	case ws.Exited():
		return ws.ExitStatus()
	case ws.Signaled():
		return 128 + int(ws.Signal())
	}
	return 1
}

func (e exitInfo) String() string {
	if e.ws.Signaled() {
		return fmt.Sprintf("killed by %v", e.ws.Signal())
	}
	return fmt.Sprintf("exit status %d", e.ws.ExitStatus())
}

// shouldRestart applies the restart policy to how a child ended on its own.
func shouldRestart(p RestartPolicy, ws unix.WaitStatus) bool {
	switch p {
	case RestartNever:
		return false
	case RestartAlways:
		return true
	}
	if ws.Exited() {
		return ws.ExitStatus() != 0
	}
	if ws.Signaled() {
		switch ws.Signal() {
		case unix.SIGHUP, unix.SIGINT, unix.SIGTERM, unix.SIGPIPE:
			return false
		}
	}
	return true
}

// reaper is the only caller of wait(2) while Run runs: a SIGCHLD-driven
// wait4(-1, WNOHANG) loop. It reaps every child (orphans re-parented to the
// subreaper included) and routes the main child's status to exited.
type reaper struct {
	log    *slog.Logger
	mu     sync.Mutex // held across fork+register and across each reap pass
	main   int        // pid of the running main child, 0 if none
	exited chan exitInfo
	sigchl chan os.Signal
	quit   chan struct{}
	done   chan struct{}

	prevSubreaper int
}

// pollEvery is a safety net under SIGCHLD (which coalesces, but the loop
// drains everything each time, so this should never find anything).
const pollEvery = time.Second

func startReaper(log *slog.Logger) *reaper {
	r := &reaper{
		log:    log,
		exited: make(chan exitInfo, 1),
		sigchl: make(chan os.Signal, 1),
		quit:   make(chan struct{}),
		done:   make(chan struct{}),
	}
	var prev int32
	if err := unix.Prctl(unix.PR_GET_CHILD_SUBREAPER, uintptr(unsafe.Pointer(&prev)), 0, 0, 0); err == nil {
		r.prevSubreaper = int(prev)
	}
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		log.Warn("cannot become a child subreaper; orphans go to init", "err", err)
	}
	signal.Notify(r.sigchl, unix.SIGCHLD)
	go r.loop()
	return r
}

func (r *reaper) loop() {
	defer close(r.done)
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-r.sigchl:
		case <-t.C:
		case <-r.quit:
			r.reap()
			return
		}
		r.reap()
	}
}

func (r *reaper) reap() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return // ECHILD: no children; 0: none has exited
		}
		if !ws.Exited() && !ws.Signaled() {
			continue // stopped/continued: not an exit
		}
		if pid == r.main {
			r.main = 0
			r.exited <- exitInfo{pid: pid, ws: ws, at: time.Now()} // capacity 1, one main child at a time
			continue
		}
		r.log.Debug("reaped orphan", "pid", pid, "status", statusCode(ws))
	}
}

func (r *reaper) stop() {
	close(r.quit)
	<-r.done
	signal.Stop(r.sigchl)
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, uintptr(r.prevSubreaper), 0, 0, 0); err != nil {
		r.log.Debug("cannot reset child subreaper", "err", err)
	}
}

// spawner forks every child from one goroutine locked to its OS thread.
// PR_SET_PDEATHSIG fires when the thread that forked the child exits, not
// when the process does (go.dev/issue/27505); this thread lives until Run
// has finished with its children. close ends the goroutine while still locked,
// so the runtime retires the thread, which SIGKILLs any child still alive.
type spawner struct{ reqs chan func() }

func newSpawner() *spawner {
	s := &spawner{reqs: make(chan func())}
	go func() {
		runtime.LockOSThread() // never unlocked, on purpose
		for fn := range s.reqs {
			fn()
		}
	}()
	return s
}

func (s *spawner) do(fn func()) {
	done := make(chan struct{})
	s.reqs <- func() { fn(); close(done) }
	<-done
}

func (s *spawner) close() { close(s.reqs) }

// stdio holds the three descriptors every incarnation of the child gets, and
// the pipes and copy goroutines for readers/writers that are not files.
type stdio struct {
	files   [3]*os.File // what the child gets
	own     []*os.File  // descriptors we opened and close at the end
	outRead []*os.File  // read ends of output pipes, force-closed after a bounded wait
	inWrite *os.File
	copies  sync.WaitGroup
}

func newStdio(in io.Reader, out, errw io.Writer) (*stdio, error) {
	s := &stdio{}
	fail := func(err error) (*stdio, error) { s.close(0); return nil, err }
	switch f := in.(type) {
	case *os.File:
		s.files[0] = f
	case nil:
		dn, err := os.Open(os.DevNull)
		if err != nil {
			return fail(err)
		}
		s.own = append(s.own, dn)
		s.files[0] = dn
	default:
		pr, pw, err := os.Pipe()
		if err != nil {
			return fail(err)
		}
		s.own = append(s.own, pr)
		s.files[0], s.inWrite = pr, pw
		go func() {
			_, _ = io.Copy(pw, in)
			_ = pw.Close()
		}()
	}
	for i, w := range []io.Writer{out, errw} {
		switch f := w.(type) {
		case *os.File:
			s.files[1+i] = f
		case nil:
			dn, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
			if err != nil {
				return fail(err)
			}
			s.own = append(s.own, dn)
			s.files[1+i] = dn
		default:
			pr, pw, err := os.Pipe()
			if err != nil {
				return fail(err)
			}
			s.own = append(s.own, pw)
			s.outRead = append(s.outRead, pr)
			s.files[1+i] = pw
			s.copies.Add(1)
			go func() {
				defer s.copies.Done()
				_, _ = io.Copy(w, pr)
			}()
		}
	}
	return s, nil
}

// close closes our copies of the child's descriptors, gives the output
// copiers up to wait to drain (a process that escaped the group may hold the
// pipe open), then force-closes them.
func (s *stdio) close(wait time.Duration) {
	for _, f := range s.own {
		_ = f.Close()
	}
	if s.inWrite != nil {
		_ = s.inWrite.Close()
	}
	done := make(chan struct{})
	go func() { s.copies.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(wait):
	}
	for _, f := range s.outRead {
		_ = f.Close()
	}
	<-done
}

// foreground reports whether f is a terminal whose foreground process group
// is ours: then the child's group is made the foreground one.
func foreground(f *os.File) bool {
	fd := int(f.Fd())
	if _, err := unix.IoctlGetTermios(fd, unix.TCGETS); err != nil {
		return false
	}
	pg, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP)
	return err == nil && pg == unix.Getpgrp()
}

// startChild forks and execs path with the child in its own process group.
func startChild(sp *spawner, r *reaper, path string, o *Options, sio *stdio, fg bool) (pid int, err error) {
	fds := []uintptr{sio.files[0].Fd(), sio.files[1].Fd(), sio.files[2].Fd()}
	sys := &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if fg {
		sys.Foreground = true
		sys.Ctty = int(fds[0])
	}
	attr := &syscall.ProcAttr{Dir: o.Dir, Env: o.Env, Files: fds, Sys: sys}
	sp.do(func() {
		r.mu.Lock() // the reaper must not see this pid exit before it is registered
		defer r.mu.Unlock()
		pid, err = syscall.ForkExec(path, o.Command, attr)
		if err == nil {
			r.main = pid
		}
	})
	runtime.KeepAlive(sio)
	return pid, err
}

// startCode is the exit status for a command that could not be started, as
// a shell would report it.
func startCode(err error) int {
	if errors.Is(err, exec.ErrNotFound) || errors.Is(err, unix.ENOENT) {
		return 127
	}
	return 126
}

// signalGroup sends sig to process group pgid; a group that is gone is fine.
func signalGroup(pgid int, sig unix.Signal) error {
	err := unix.Kill(-pgid, sig)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	return err
}

// groupAlive reports whether process group pgid still has a member (zombies
// count until reaped).
func groupAlive(pgid int) bool {
	err := unix.Kill(-pgid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}

// waitGroupGone polls until process group pgid is empty or the deadline passes.
func waitGroupGone(pgid int, deadline time.Time) bool {
	for {
		if !groupAlive(pgid) {
			return true
		}
		if !time.Now().Before(deadline) {
			return false
		}
		time.Sleep(min(10*time.Millisecond, time.Until(deadline)+time.Millisecond))
	}
}
