//go:build linux

package supervisor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// killWait bounds the wait for a SIGKILLed process group to disappear.
	killWait = 5 * time.Second
	// stdioDrain bounds the wait for the child's output to be copied out
	// after the end (only for Stdout/Stderr that are not files).
	stdioDrain = time.Second
)

type supervisor struct {
	cp   Checkpointer
	o    Options
	log  *slog.Logger
	m    *Metrics
	bg   context.Context // ctx without its cancellation: checkpoints are never cut short by a stop
	sigs <-chan os.Signal
	path string
	fg   bool
	r    *reaper
	sp   *spawner
	sio  *stdio
	w    *worker
	ckMu sync.Mutex // belt and braces: one Checkpoint at a time
}

type child struct {
	pid     int // also its process group id
	started time.Time
}

// Run restores, then runs opts.Command under supervision until it exits for
// good or a stop signal (or ctx's cancellation, treated as SIGTERM) ends it,
// and returns the exit status to exit with. err says what went wrong besides
// the child's own status: [ErrRestore], [ErrStart], [ErrRestartLimit],
// [ErrFinalCheckpoint], [ErrStopped]. See the package documentation for the
// behaviour in detail.
func Run(ctx context.Context, cp Checkpointer, opts Options) (exitCode int, err error) {
	if len(opts.Command) == 0 || opts.Command[0] == "" {
		return 1, errors.New("supervisor: no command to run")
	}
	if cp == nil {
		return 1, errors.New("supervisor: nil Checkpointer")
	}
	o := opts.withDefaults()
	s := &supervisor{cp: cp, o: o, log: o.Logger, m: o.Metrics, bg: context.WithoutCancel(ctx), sigs: o.Signals}
	if s.sigs == nil {
		ch := make(chan os.Signal, 8)
		signal.Notify(ch, unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGUSR1)
		defer signal.Stop(ch)
		s.sigs = ch
	}
	name := o.Command[0]
	// The child runs as our user: without this it could read our
	// environment and memory (store credentials) through /proc/<pid>. The
	// flag does not pass to the child, which is dumpable again at exec.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		s.log.Warn("cannot make the supervisor non-dumpable; the harness may read its environment through /proc", "err", err)
	}

	t0 := time.Now()
	stop, err := s.restore(ctx)
	switch {
	case stop != 0:
		return 128 + int(stop), errors.Join(fmt.Errorf("%w: %v during restore, %s not started", ErrStopped, stop, name), err)
	case ctx.Err() != nil:
		return 1, errors.Join(fmt.Errorf("%w: %w, %s not started", ErrStopped, context.Cause(ctx), name), err)
	case err != nil:
		s.log.Error("restore incomplete: not starting the harness", "command", name, "err", err)
		return 1, fmt.Errorf("%w, %s not started: %w", ErrRestore, name, err)
	}
	s.log.Info("restore complete", "duration", time.Since(t0))

	s.path, err = exec.LookPath(name)
	if err != nil {
		return startCode(err), fmt.Errorf("%w %q: %w", ErrStart, name, err)
	}
	s.sio, err = newStdio(o.Stdin, o.Stdout, o.Stderr)
	if err != nil {
		return 1, fmt.Errorf("supervisor: stdio: %w", err)
	}
	if f, ok := o.Stdin.(*os.File); ok {
		s.fg = foreground(f)
	}
	s.r = startReaper(s.log)
	s.sp = newSpawner()
	defer func() {
		s.sp.close()
		s.r.stop()
		s.sio.close(stdioDrain)
		s.m.setChildUp(false)
	}()
	return s.loop(ctx)
}

func (s *supervisor) restore(ctx context.Context) (stop unix.Signal, err error) {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- s.cp.Restore(rctx) }()
	for {
		select {
		case err := <-errc:
			return stop, err
		case sig, ok := <-s.sigs:
			if !ok {
				s.sigs = nil
				continue
			}
			if !isStop(sig) {
				s.log.Info("signal ignored during restore", "signal", sig)
				continue
			}
			if stop == 0 {
				stop = sysSig(sig)
				s.log.Warn("stop signal during restore: cancelling it, the harness will not start", "signal", sig)
				cancel()
			}
		}
	}
}

func (s *supervisor) loop(ctx context.Context) (int, error) {
	ch, err := s.start()
	if err != nil {
		return startCode(err), err // nothing ran: nothing to checkpoint
	}
	if s.o.Policy != PolicyNone {
		s.w = startWorker(s)
	}
	var tick <-chan time.Time
	if s.o.Policy == PolicyInterval {
		t := time.NewTicker(s.o.Interval)
		defer t.Stop()
		tick = t.C
	}
	var (
		done     = ctx.Done()
		streak   int // restarts since the child last stayed up HealthyAfter
		last     exitInfo
		restart  *time.Timer
		restartC <-chan time.Time
	)
	defer func() {
		if restart != nil {
			restart.Stop()
		}
	}()
	for {
		select {
		case <-tick:
			s.w.tick()
		case sig, ok := <-s.sigs:
			switch {
			case !ok:
				s.sigs = nil
			case sig == unix.SIGUSR1:
				s.manual()
			case isStop(sig):
				return s.shutdown(ch, sysSig(sig), last)
			case ch != nil:
				s.forward(ch.pid, sysSig(sig))
			}
		case <-done:
			s.log.Info("context cancelled: stopping as on SIGTERM", "cause", context.Cause(ctx))
			return s.shutdown(ch, unix.SIGTERM, last)
		case ex := <-s.r.exited:
			last = ex
			up := ex.at.Sub(ch.started)
			pgid := ch.pid
			ch = nil
			s.m.setChildUp(false)
			if !shouldRestart(s.o.Restart, ex.ws) {
				s.log.Info("harness exited; not restarting it", "pid", ex.pid, "status", ex.String(), "uptime", up, "restart", s.o.Restart.String())
				s.settleTerm(pgid)
				return s.finish(ex.code(), nil)
			}
			if up >= s.o.HealthyAfter {
				streak = 0
			}
			if streak >= s.o.MaxRestarts {
				s.log.Error("harness keeps exiting: restart cap reached", "pid", ex.pid, "status", ex.String(), "restarts", streak, "cap", s.o.MaxRestarts)
				s.settleTerm(pgid)
				code := ex.code()
				if code == 0 {
					code = 1
				}
				return s.finish(code, fmt.Errorf("%w: %s ended (%v) after %d restarts in a row (cap %d, reset after %v up)",
					ErrRestartLimit, s.o.Command[0], ex, streak, s.o.MaxRestarts, s.o.HealthyAfter))
			}
			streak++
			d := s.o.Backoff.Delay(streak)
			s.log.Warn("harness exited unexpectedly: restarting it", "pid", ex.pid, "status", ex.String(), "uptime", up,
				"restart", streak, "cap", s.o.MaxRestarts, "in", d)
			s.settleTerm(pgid)
			restart = time.NewTimer(d)
			restartC = restart.C
		case <-restartC:
			restartC = nil
			if ch, err = s.start(); err != nil {
				return s.finish(startCode(err), err)
			}
			s.m.restarted()
		}
	}
}

func (s *supervisor) start() (*child, error) {
	t := time.Now()
	pid, err := startChild(s.sp, s.r, s.path, &s.o, s.sio, s.fg)
	if err != nil {
		s.log.Error("cannot start the harness", "path", s.path, "err", err)
		return nil, fmt.Errorf("%w %q: %w", ErrStart, s.path, err)
	}
	s.m.setChildUp(true)
	// Only the program: arguments may hold secrets.
	s.log.Info("harness started", "pid", pid, "command", s.o.Command[0])
	return &child{pid: pid, started: t}, nil
}

// shutdown forwards a stop signal to the child's process group, gives the
// group Grace to exit, SIGKILLs what is left, then takes the final checkpoint.
func (s *supervisor) shutdown(ch *child, sig unix.Signal, last exitInfo) (int, error) {
	if ch == nil {
		s.log.Info("stop requested while the harness was waiting to restart", "signal", sig)
		return s.finish(last.code(), nil)
	}
	s.log.Info("stopping: signal forwarded to the harness", "signal", sig, "pid", ch.pid, "grace", s.o.Grace)
	deadline := time.Now().Add(s.o.Grace)
	s.forward(ch.pid, sig)
	grace := time.NewTimer(s.o.Grace)
	defer grace.Stop()
	for {
		select {
		case ex := <-s.r.exited:
			s.m.setChildUp(false)
			s.log.Info("harness exited", "pid", ex.pid, "status", ex.String())
			s.settleUntil(ch.pid, deadline)
			return s.finish(ex.code(), nil)
		case sig2, ok := <-s.sigs:
			if !ok {
				s.sigs = nil
				continue
			}
			if sig2 == unix.SIGUSR1 {
				s.log.Info("SIGUSR1 ignored while stopping: the final checkpoint follows")
				continue
			}
			s.log.Info("signal while stopping: forwarded; the final checkpoint still follows", "signal", sig2)
			s.forward(ch.pid, sysSig(sig2))
		case <-grace.C:
			s.log.Warn("harness did not exit within the grace period: killing its process group", "pid", ch.pid, "grace", s.o.Grace)
			s.forward(ch.pid, unix.SIGKILL)
			select {
			case ex := <-s.r.exited:
				s.m.setChildUp(false)
				s.settleUntil(ch.pid, time.Now())
				return s.finish(ex.code(), nil)
			case <-time.After(killWait):
				s.log.Error("harness not gone after SIGKILL: taking the final checkpoint anyway", "pid", ch.pid)
				return s.finish(128+int(unix.SIGKILL), nil)
			}
		}
	}
}

// settleTerm stops what is left of a process group whose leader has exited:
// SIGTERM, Grace, SIGKILL.
func (s *supervisor) settleTerm(pgid int) {
	if !groupAlive(pgid) {
		return
	}
	s.log.Info("stopping what is left of the harness's process group", "pgid", pgid)
	s.forward(pgid, unix.SIGTERM)
	s.settleUntil(pgid, time.Now().Add(s.o.Grace))
}

// settleUntil waits until the process group is empty or the deadline has
// passed, then SIGKILLs the rest, so the final checkpoint sees a quiescent tree.
func (s *supervisor) settleUntil(pgid int, deadline time.Time) {
	if waitGroupGone(pgid, deadline) {
		return
	}
	s.log.Warn("killing what is left of the harness's process group", "pgid", pgid)
	s.forward(pgid, unix.SIGKILL)
	if !waitGroupGone(pgid, time.Now().Add(killWait)) {
		s.log.Error("process group still not empty after SIGKILL", "pgid", pgid)
	}
}

func (s *supervisor) forward(pgid int, sig unix.Signal) {
	if err := signalGroup(pgid, sig); err != nil {
		s.log.Warn("cannot signal the harness's process group", "pgid", pgid, "signal", sig, "err", err)
	}
}

func (s *supervisor) manual() {
	if s.w == nil {
		s.log.Info("SIGUSR1 ignored: checkpoint policy is none")
		return
	}
	s.w.manual()
}

// finish waits for an in-flight checkpoint, takes the final one (unless the
// policy is none) and settles the exit status.
func (s *supervisor) finish(code int, err error) (int, error) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func(sigs <-chan os.Signal) { // from here on signals change nothing: say so
		defer close(done)
		for {
			select {
			case sig, ok := <-sigs:
				if !ok {
					sigs = nil
					continue
				}
				s.log.Warn("signal ignored: the final checkpoint is in progress", "signal", sig)
			case <-quit:
				return
			}
		}
	}(s.sigs)
	defer func() { close(quit); <-done }()

	if s.w != nil {
		s.w.stop() // waits for the in-flight checkpoint
	}
	if s.o.Policy == PolicyNone {
		return code, err
	}
	if cerr := s.checkpoint(TriggerFinal); cerr != nil {
		err = errors.Join(err, fmt.Errorf("%w: %w", ErrFinalCheckpoint, cerr))
		if code == 0 {
			code = 1
		}
	}
	return code, err
}

func (s *supervisor) checkpoint(t Trigger) error {
	s.ckMu.Lock()
	defer s.ckMu.Unlock()
	ctx := context.WithValue(s.bg, triggerKey{}, t)
	timeout := s.o.CheckpointTimeout
	if t == TriggerFinal {
		timeout = s.o.FinalTimeout
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	start := time.Now()
	err := s.cp.Checkpoint(ctx)
	d := time.Since(start)
	var res []AdapterResult
	if r, ok := s.cp.(Reporter); ok {
		res = r.LastResults()
	}
	s.m.observeCheckpoint(d, err, res, time.Now())
	switch {
	case err != nil && t == TriggerFinal:
		s.log.Error("final checkpoint failed", "duration", d, "err", err)
	case err != nil:
		s.log.Error("checkpoint failed: the harness keeps running, retrying at the next tick", "trigger", t, "duration", d, "err", err)
	case t == TriggerInterval:
		s.log.Debug("checkpoint", "trigger", t, "duration", d)
	default:
		s.log.Info("checkpoint", "trigger", t, "duration", d)
	}
	return err
}

// worker runs timer and SIGUSR1 checkpoints one at a time.
type worker struct {
	s    *supervisor
	req  chan Trigger // capacity 1: at most one queued checkpoint
	quit chan struct{}
	done chan struct{}
	busy atomic.Bool
}

func startWorker(s *supervisor) *worker {
	w := &worker{s: s, req: make(chan Trigger, 1), quit: make(chan struct{}), done: make(chan struct{})}
	go w.loop()
	return w
}

func (w *worker) loop() {
	defer close(w.done)
	for {
		select {
		case <-w.quit:
			return
		case t := <-w.req:
			select {
			case <-w.quit:
				return // the final checkpoint supersedes a queued one
			default:
			}
			w.busy.Store(true)
			_ = w.s.checkpoint(t)
			w.busy.Store(false)
		}
	}
}

// tick asks for a timer checkpoint; skipped while one runs or is queued.
func (w *worker) tick() {
	if w.busy.Load() {
		w.s.log.Debug("timer checkpoint skipped: one is still running")
		return
	}
	select {
	case w.req <- TriggerInterval:
	default:
	}
}

// manual asks for a checkpoint now, or right after the running one.
func (w *worker) manual() {
	select {
	case w.req <- TriggerSignal:
		w.s.log.Info("SIGUSR1: checkpoint requested")
	default:
		w.s.log.Info("SIGUSR1: a checkpoint is already queued")
	}
}

func (w *worker) stop() {
	close(w.quit)
	<-w.done
}

func isStop(sig os.Signal) bool {
	return sig == unix.SIGTERM || sig == unix.SIGINT || sig == unix.SIGHUP
}

func sysSig(sig os.Signal) unix.Signal {
	if s, ok := sig.(syscall.Signal); ok {
		return s
	}
	return unix.SIGTERM
}
