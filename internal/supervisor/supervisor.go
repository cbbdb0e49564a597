// Package supervisor supervises a harness child process for `agentstate run`.
//
// Run restores state, starts the harness command as a child in its own process
// group, checkpoints it on a timer and on SIGUSR1, restarts it when it crashes
// (with backoff and a cap), reaps every zombie re-parented to it (it is PID 1 in
// a container), and on SIGTERM, SIGINT or SIGHUP forwards the signal to the
// child's process group, waits for it to exit, takes a final checkpoint and
// returns the child's exit status.
//
// The package knows nothing about storage: it drives a [Checkpointer].
//
// # Decisions
//
//   - Restore errors: the child is never started; Run returns 1 and an error
//     wrapping both [ErrRestore] and the checkpointer's error (so
//     errors.Is(err, engine.ErrIncomplete) still works for exit-code mapping).
//     A stop signal during restore cancels it; the child is not started.
//   - Timer ticks that fall while a checkpoint runs are skipped (the running
//     checkpoint already captures almost the same state, and a slow store must
//     not build a queue). A SIGUSR1 during a running checkpoint is queued (at
//     most one): the operator asked for the state as of the signal, which the
//     running checkpoint may have scanned past. Checkpoints never overlap: one
//     worker goroutine runs them, and the final one runs only after it stopped.
//   - Checkpoints are not cancelled by ctx or by a stop signal: a stop waits for
//     the in-flight one, then takes the final one. [Options.CheckpointTimeout]
//     and [Options.FinalTimeout] bound them if set.
//   - Stop: the signal is forwarded to the child's process group and the whole
//     group gets [Options.Grace] to exit. Whatever is still alive after Grace is
//     SIGKILLed, and only then is the final checkpoint taken: a quiescent tree
//     gives a consistent checkpoint of everything the harness wrote, and the
//     container is stopping anyway (the orchestrator would SIGKILL it next).
//     Checkpointing a still-running child instead would race its writes and
//     lose whatever it wrote after the scan. The exit status is then 137.
//   - Signals during the final checkpoint are logged and ignored: the final
//     checkpoint always completes (only SIGKILL stops it).
//   - Exit status: the child's exit code, or 128+n if signal n killed it. If the
//     final checkpoint fails and that status is 0, Run returns 1 instead: 0
//     means "the harness finished and its state is saved".
//   - Restart (RestartOnFailure, the default) follows systemd's
//     Restart=on-failure: restart after a non-zero exit or death by a signal,
//     except the "clean" stop signals SIGHUP, SIGINT, SIGTERM and SIGPIPE (a
//     child stopped by an operator or by Ctrl-C at its terminal is not revived).
//     Exit 0 means the harness finished: final checkpoint, return 0.
//   - Before every restart and before the final checkpoint, what is left of the
//     child's process group gets SIGTERM, then SIGKILL after Grace, so a
//     restarted harness never runs beside leftovers of the previous one.
//   - The supervisor makes itself non-dumpable (PR_SET_DUMPABLE=0), so a child
//     running as the same user cannot read its environment or memory through
//     /proc/<pid> (a root child still can: run the harness as another user
//     for that).
//   - The child gets PR_SET_PDEATHSIG=SIGKILL: if the supervisor dies (SIGKILL,
//     crash) outside a container, the harness dies too rather than running on
//     unsupervised beside a future second instance.
//   - Zombies are reaped by one SIGCHLD-driven wait4(-1) loop that routes the
//     main child's status to the supervisor; the process is made a child
//     subreaper so orphans come to it even when it is not PID 1. Consequence:
//     nothing else in the process may start and wait for child processes while
//     Run runs (os/exec's Wait would lose the race), and only one Run may run
//     per process.
//   - If stdin is a terminal and the supervisor is in its foreground process
//     group, the child's process group is made the terminal's foreground group
//     (as tini does), so an interactive harness can read the terminal.
package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"
)

// Checkpointer restores and checkpoints every adapter. Run never calls two of
// its methods concurrently.
type Checkpointer interface {
	// Restore restores every adapter. An error means the restore is
	// incomplete: the child is never started. It should name the adapter
	// and what failed.
	Restore(ctx context.Context) error
	// Checkpoint takes one checkpoint of every adapter.
	Checkpoint(ctx context.Context) error
}

// AdapterResult is what one adapter's part of the last checkpoint did.
type AdapterResult struct {
	Adapter  string
	Bytes    int64 // bytes uploaded
	Requests int64 // store requests made
	Err      error // nil if this adapter's checkpoint committed (or had nothing to commit)
}

// Reporter may be implemented by a Checkpointer to feed per-adapter metrics:
// Run calls LastResults right after each Checkpoint returns (successful or
// not), from the same goroutine, so it needs no locking against Checkpoint.
type Reporter interface {
	LastResults() []AdapterResult
}

// Policy says when Run checkpoints.
type Policy int

const (
	// PolicyInterval checkpoints every Interval, on SIGUSR1 and on stop.
	PolicyInterval Policy = iota
	// PolicyManual checkpoints only on SIGUSR1 and on stop (and whenever
	// `agentstate checkpoint` is run from outside).
	PolicyManual
	// PolicyNone never checkpoints, not even on stop; SIGUSR1 is ignored.
	PolicyNone
)

var policyNames = []string{"interval", "manual", "none"}

func (p Policy) String() string {
	if p >= 0 && int(p) < len(policyNames) {
		return policyNames[p]
	}
	return fmt.Sprintf("Policy(%d)", int(p))
}

// ParsePolicy parses "interval", "manual" or "none".
func ParsePolicy(s string) (Policy, error) {
	for i, n := range policyNames {
		if strings.EqualFold(s, n) {
			return Policy(i), nil
		}
	}
	return 0, fmt.Errorf("unknown checkpoint policy %q (want %s)", s, strings.Join(policyNames, ", "))
}

// RestartPolicy says whether a child that exited on its own is restarted.
type RestartPolicy int

const (
	// RestartOnFailure restarts after a non-zero exit or death by a signal
	// other than SIGHUP, SIGINT, SIGTERM or SIGPIPE (systemd's on-failure).
	RestartOnFailure RestartPolicy = iota
	// RestartAlways restarts after any exit, including 0.
	RestartAlways
	// RestartNever exits with the child (after the final checkpoint).
	RestartNever
)

var restartNames = []string{"on-failure", "always", "never"}

func (r RestartPolicy) String() string {
	if r >= 0 && int(r) < len(restartNames) {
		return restartNames[r]
	}
	return fmt.Sprintf("RestartPolicy(%d)", int(r))
}

// ParseRestartPolicy parses "on-failure", "always" or "never".
func ParseRestartPolicy(s string) (RestartPolicy, error) {
	for i, n := range restartNames {
		if strings.EqualFold(s, n) {
			return RestartPolicy(i), nil
		}
	}
	return 0, fmt.Errorf("unknown restart policy %q (want %s)", s, strings.Join(restartNames, ", "))
}

// Backoff is the delay before the n-th restart of a streak:
// Initial·2ⁿ⁻¹, capped at Max.
type Backoff struct {
	Initial time.Duration // default 1s
	Max     time.Duration // default 30s
}

// Delay returns the delay before restart n (n ≥ 1) of a streak.
func (b Backoff) Delay(n int) time.Duration {
	d := b.Initial
	for i := 1; i < n && d < b.Max; i++ {
		d *= 2
	}
	return min(d, b.Max)
}

// Defaults for zero Options fields.
const (
	DefaultInterval     = 15 * time.Second
	DefaultGrace        = time.Second
	DefaultMaxRestarts  = 5
	DefaultHealthyAfter = 60 * time.Second
	DefaultBackoff      = time.Second
	DefaultBackoffMax   = 30 * time.Second
)

// Options configure Run. Zero fields take the defaults above.
type Options struct {
	Command []string // the harness: Command[0] is looked up in $PATH like os/exec does
	Dir     string   // working directory; "" is the current one
	Env     []string // nil means os.Environ()
	// Stdin, Stdout, Stderr: nil means /dev/null; an *os.File is passed
	// to the child as is (the CLI passes os.Stdin, os.Stdout, os.Stderr).
	// Anything else is copied through a pipe by a goroutine; a Reader's
	// goroutine lives until its Read returns, possibly after Run.
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer

	Policy   Policy
	Interval time.Duration // between timer checkpoints (PolicyInterval); default 15s
	// CheckpointTimeout bounds each timer or SIGUSR1 checkpoint; 0 = unbounded.
	CheckpointTimeout time.Duration
	// FinalTimeout bounds the final checkpoint; 0 = unbounded.
	FinalTimeout time.Duration

	// Grace is how long the child's process group gets to exit after a
	// stop signal was forwarded (or leftovers after a SIGTERM) before it is
	// SIGKILLed; default 1s.
	Grace time.Duration

	Restart RestartPolicy
	// MaxRestarts caps the restarts of one streak; ≤ 0 means 5. When the
	// cap is hit Run takes the final checkpoint and returns non-zero with
	// ErrRestartLimit.
	MaxRestarts int
	// HealthyAfter: a child that stayed up this long ends the streak
	// (the restart counter and backoff reset); default 60s.
	HealthyAfter time.Duration
	Backoff      Backoff

	Logger  *slog.Logger // nil discards
	Metrics *Metrics     // nil: no metrics

	// Signals, if non-nil, replaces the process's SIGTERM, SIGINT, SIGHUP
	// and SIGUSR1: Run reads them from this channel and installs no
	// handler for them (for embedding and tests). Other signals sent on it
	// are forwarded to the child's process group. SIGCHLD is always
	// handled by Run.
	Signals <-chan os.Signal
}

func (o Options) withDefaults() Options {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Grace <= 0 {
		o.Grace = DefaultGrace
	}
	if o.MaxRestarts <= 0 {
		o.MaxRestarts = DefaultMaxRestarts
	}
	if o.HealthyAfter <= 0 {
		o.HealthyAfter = DefaultHealthyAfter
	}
	if o.Backoff.Initial <= 0 {
		o.Backoff.Initial = DefaultBackoff
	}
	if o.Backoff.Max <= 0 {
		o.Backoff.Max = max(DefaultBackoffMax, o.Backoff.Initial)
	}
	if o.Backoff.Max < o.Backoff.Initial {
		o.Backoff.Max = o.Backoff.Initial
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Env == nil {
		o.Env = os.Environ()
	}
	return o
}

// Errors Run wraps; test them with errors.Is.
var (
	// ErrRestore: the restore failed or was incomplete; the child was never started.
	ErrRestore = errors.New("restore incomplete")
	// ErrStart: the command could not be started.
	ErrStart = errors.New("cannot start command")
	// ErrRestartLimit: the child kept crashing; the restart cap was hit.
	ErrRestartLimit = errors.New("restart limit reached")
	// ErrFinalCheckpoint: the final checkpoint failed.
	ErrFinalCheckpoint = errors.New("final checkpoint failed")
	// ErrStopped: a stop signal arrived before the child was started.
	ErrStopped = errors.New("stopped before the command was started")
)

// Trigger says why a checkpoint runs; [TriggerOf] reads it from the context
// Run passes to Checkpoint.
type Trigger string

const (
	TriggerInterval Trigger = "interval"
	TriggerSignal   Trigger = "signal" // SIGUSR1
	TriggerFinal    Trigger = "final"  // on stop, child exit or restart cap
)

type triggerKey struct{}

// TriggerOf returns the trigger of the checkpoint ctx belongs to, or "".
func TriggerOf(ctx context.Context) Trigger {
	t, _ := ctx.Value(triggerKey{}).(Trigger)
	return t
}
