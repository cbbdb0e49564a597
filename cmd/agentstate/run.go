package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentstate/agentstate/internal/engine"
	"github.com/agentstate/agentstate/internal/supervisor"
	"github.com/agentstate/agentstate/store"
)

func newRunCmd(g *globalFlags) *cobra.Command {
	var t targetFlags
	var policy, restart, metricsAddr string
	var interval, grace, healthy, backoff, backoffMax, ckptTimeout time.Duration
	var maxRestarts int
	var freshOnInvalid bool
	cmd := &cobra.Command{
		Use:   "run [flags] -- CMD [ARGS...]",
		Short: "Container entrypoint: restore, run the harness, checkpoint on a timer and on shutdown",
		Long: `Run is the container's entrypoint (it can be PID 1):

  1. It restores every selected adapter (default: all configured). If any
     restore is incomplete (the store cannot be reached, a path could not be
     written, or checkpoints exist but none verifies), CMD is never started:
     run exits non-zero naming the adapter.
  2. It starts CMD as a child in its own process group, with stdin, stdout and
     stderr passed through, and reaps orphaned processes.
  3. It checkpoints every --checkpoint-interval ($AGENT_STATE_CHECKPOINT_SECONDS,
     default 15 s), and at once on SIGUSR1. A failed checkpoint is logged and
     retried on the next tick; the harness keeps running. The lineage lock makes
     a checkpoint started by hand (agentstate checkpoint) wait rather than overlap.
  4. On SIGTERM, SIGINT or SIGHUP it forwards the signal to the child, waits up
     to --grace for it to exit and flush, takes the final checkpoint, and exits
     with the child's status. A second signal does not lose the final checkpoint.
  5. A child that crashes is restarted with backoff (restore is not re-run), up
     to --max-restarts in a row; the count resets once it stays up for
     --healthy-after. Past the cap: final checkpoint, exit non-zero.

An ungraceful stop (SIGKILL, power loss) loses at most one interval.

The harness gets run's environment, except agentstate's private store
credentials: give the bucket's keys as AGENTSTATE_S3_ACCESS_KEY_ID and
AGENTSTATE_S3_SECRET_ACCESS_KEY (and AGENTSTATE_S3_SESSION_TOKEN) and they are
neither in the harness's environment nor readable from run's (run is not
dumpable, so /proc/<run's pid> is closed to a harness of the same non-root
user; a harness running as root can read any process). AWS_* variables are
passed on, for a harness that needs AWS itself (e.g. Bedrock).`,
		Example: `  AM_LOCAL=/am AGENTSTATE_STORE=s3://agents/prod agentstate run -- claude-server --port 8080
  agentstate run --adapter opencode --metrics-addr :9090 -- opencode serve
  agentstate run --lineage notes --dir /data/notes --checkpoint-policy manual -- ./app`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{fmt.Errorf("run needs the harness command after -- (see '%s --help')", cmd.CommandPath())}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(t.adapters) == 0 && !t.all && t.lineage == "" {
				t.all = true
			}
			targets, err := t.resolve(cmd, g)
			if err != nil {
				return err
			}
			opts := supervisor.Options{Command: args, Env: childEnv(os.Environ()), Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr,
				Grace: grace, MaxRestarts: maxRestarts, HealthyAfter: healthy, CheckpointTimeout: ckptTimeout,
				Backoff: supervisor.Backoff{Initial: backoff, Max: backoffMax}}
			if opts.Policy, err = supervisor.ParsePolicy(envOr(cmd, "checkpoint-policy", policy, "AGENT_STATE_CHECKPOINT_POLICY")); err != nil {
				return usageError{err}
			}
			if opts.Restart, err = supervisor.ParseRestartPolicy(restart); err != nil {
				return usageError{err}
			}
			if opts.Interval, err = checkpointInterval(cmd, interval); err != nil {
				return err
			}
			log, err := g.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			opts.Logger = log
			if os.Getenv("AWS_SECRET_ACCESS_KEY") != "" && os.Getenv("AGENTSTATE_S3_SECRET_ACCESS_KEY") == "" {
				log.Warn("the harness inherits AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY: if these are the bucket's credentials, " +
					"give them as AGENTSTATE_S3_ACCESS_KEY_ID/AGENTSTATE_S3_SECRET_ACCESS_KEY instead, which run never passes on")
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			if metricsAddr != "" {
				opts.Metrics = supervisor.NewMetrics()
				ln, err := net.Listen("tcp", metricsAddr)
				if err != nil {
					return fmt.Errorf("--metrics-addr %s: %w", metricsAddr, err)
				}
				mux := http.NewServeMux()
				mux.Handle("/metrics", opts.Metrics.Handler())
				srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
				go srv.Serve(ln)
				defer srv.Close()
			}
			cp := &runCheckpointer{e: e, targets: targets, log: log, freshOnInvalid: freshOnInvalid,
				keepDeleted: g.keepDeleted}
			// Run handles the stop signals itself (forwarding the real one to
			// the child), so main's signal context must not cancel it.
			code, err := supervisor.Run(context.WithoutCancel(cmd.Context()), cp, opts)
			if err != nil {
				fmt.Fprintln(cmd.ErrOrStderr(), "agentstate run:", err)
			}
			if errors.Is(err, supervisor.ErrRestore) {
				code = exitCode(err)
			}
			return exitWith{code}
		},
	}
	t.register(cmd, true)
	f := cmd.Flags()
	f.SetInterspersed(false) // the harness's own flags are not ours
	f.DurationVar(&interval, "checkpoint-interval", supervisor.DefaultInterval, "time between checkpoints (default $AGENT_STATE_CHECKPOINT_SECONDS, else 15s)")
	f.StringVar(&policy, "checkpoint-policy", "interval", "interval, manual (only SIGUSR1 or agentstate checkpoint) or none (default $AGENT_STATE_CHECKPOINT_POLICY)")
	f.DurationVar(&grace, "grace", supervisor.DefaultGrace, "how long a stopping child may take to exit and flush before the final checkpoint")
	f.StringVar(&restart, "restart", "on-failure", "restart a child that exits: on-failure, always or never")
	f.IntVar(&maxRestarts, "max-restarts", supervisor.DefaultMaxRestarts, "restarts in a row before run gives up (after a final checkpoint)")
	f.DurationVar(&healthy, "healthy-after", supervisor.DefaultHealthyAfter, "uptime after which the restart count resets")
	f.DurationVar(&backoff, "restart-backoff", supervisor.DefaultBackoff, "first restart delay, doubling up to --restart-backoff-max")
	f.DurationVar(&backoffMax, "restart-backoff-max", supervisor.DefaultBackoffMax, "longest restart delay")
	f.DurationVar(&ckptTimeout, "checkpoint-timeout", 5*time.Minute, "give up on one timer checkpoint after this long (0: never)")
	f.StringVar(&metricsAddr, "metrics-addr", "", "serve Prometheus metrics on this address (e.g. :9090), at /metrics")
	f.BoolVar(&freshOnInvalid, "start-fresh-on-invalid", false, "if checkpoints exist but none verifies, start with the local tree anyway (the bad manifests stay untouched for forensics) instead of refusing")
	g.registerKeepDeleted(cmd)
	return cmd
}

// childEnv is the harness's environment: run's own, without agentstate's
// private store credentials (store.PrivateCredentialVars).
func childEnv(environ []string) []string {
	out := make([]string, 0, len(environ))
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(store.PrivateCredentialVars, name) {
			out = append(out, kv)
		}
	}
	return out
}

// exitWith carries run's exit code (the child's) through cobra to main.
type exitWith struct{ code int }

func (e exitWith) Error() string { return "exit status " + strconv.Itoa(e.code) }

func envOr(cmd *cobra.Command, flag, val, env string) string {
	if !cmd.Flags().Changed(flag) && os.Getenv(env) != "" {
		return os.Getenv(env)
	}
	return val
}

func checkpointInterval(cmd *cobra.Command, flag time.Duration) (time.Duration, error) {
	if cmd.Flags().Changed("checkpoint-interval") {
		return flag, nil
	}
	if s := os.Getenv("AGENT_STATE_CHECKPOINT_SECONDS"); s != "" {
		n, err := strconv.ParseFloat(s, 64)
		if err != nil || n <= 0 {
			return 0, usageError{fmt.Errorf("AGENT_STATE_CHECKPOINT_SECONDS=%q: want a positive number of seconds", s)}
		}
		return time.Duration(n * float64(time.Second)), nil
	}
	return flag, nil
}

// runCheckpointer restores and checkpoints the selected adapters for the
// supervisor; each lineage's file lock serialises it with any checkpoint
// started by hand in the same container.
type runCheckpointer struct {
	e              *engine.Engine
	targets        []target
	log            *slog.Logger
	freshOnInvalid bool
	authoritative  map[string]bool
	keepDeleted    time.Duration
	last           []supervisor.AdapterResult
}

func (c *runCheckpointer) Restore(ctx context.Context) error {
	c.authoritative = map[string]bool{}
	for _, tg := range c.targets {
		res, err := c.e.Restore(ctx, engine.RestoreOptions{Lineage: tg.Lineage, Dir: tg.Dir})
		if errors.Is(err, engine.ErrNoValidManifest) && c.freshOnInvalid {
			c.log.Error("no checkpoint verifies; starting from the local tree as asked (--start-fresh-on-invalid), the bad manifests are kept",
				"adapter", tg.Lineage, "err", err)
			c.authoritative[tg.Lineage] = true
			continue
		}
		if err != nil {
			return fmt.Errorf("adapter %q: %w", tg.Lineage, err)
		}
		switch {
		case res.Empty:
			c.log.Info("no checkpoint yet: first start", "adapter", tg.Lineage)
		default:
			c.log.Info("restored", "adapter", tg.Lineage, "seq", res.Seq, "written", res.Written,
				"kept_newer", len(res.KeptNewer), "bytes", res.Bytes, "rejected", len(res.Rejected))
		}
	}
	return nil
}

func (c *runCheckpointer) Checkpoint(ctx context.Context) error {
	var errs []error
	c.last = c.last[:0]
	for _, tg := range c.targets {
		res, err := c.e.Checkpoint(ctx, tg.checkpointOptions(c.authoritative[tg.Lineage], c.keepDeleted))
		r := supervisor.AdapterResult{Adapter: tg.Lineage, Err: err}
		if res != nil {
			r.Bytes, r.Requests = res.BytesUploaded, res.Requests
			if res.Committed {
				c.log.Info("checkpoint", "adapter", tg.Lineage, "seq", res.Seq, "trigger", string(supervisor.TriggerOf(ctx)),
					"files_changed", res.FilesChanged, "bytes", res.BytesUploaded, "requests", res.Requests, "took", res.Duration.Round(time.Millisecond))
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("adapter %q: %w", tg.Lineage, err))
		}
		c.last = append(c.last, r)
	}
	return errors.Join(errs...)
}

func (c *runCheckpointer) LastResults() []supervisor.AdapterResult { return c.last }

func newStatusCmd(g *globalFlags) *cobra.Command {
	var t targetFlags
	cmd := &cobra.Command{
		Use:   "status [--adapter NAME... | --all | --lineage NAME]",
		Short: "Last checkpoint of each lineage on this machine: sequence, age, bytes, last error",
		Long: `Status reads this machine's state directory (no request to the store) and shows,
per lineage, the last committed sequence, how long ago, the bytes it uploaded,
and the last error. Default: all configured adapters.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(t.adapters) == 0 && !t.all && t.lineage == "" {
				t.all = true
			}
			targets, err := t.resolve(cmd, g)
			if err != nil {
				return err
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			var list []engine.Status
			for _, tg := range targets {
				st, err := e.Status(tg.Lineage)
				if err != nil {
					return err
				}
				list = append(list, st)
			}
			if g.jsonOut {
				return printJSON(cmd.OutOrStdout(), list)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "%-16s %8s %12s %10s  %s\n", "LINEAGE", "SEQ", "AGE", "BYTES", "LAST ERROR")
			for _, st := range list {
				age := "never"
				if !st.LastCommit.IsZero() {
					age = time.Since(st.LastCommit).Round(time.Second).String()
				}
				fmt.Fprintf(w, "%-16s %8d %12s %10s  %s\n", st.Lineage, st.Seq, age, humanBytes(st.BytesUploaded), st.LastError)
			}
			return nil
		},
	}
	t.register(cmd, false)
	return cmd
}
