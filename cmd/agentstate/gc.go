package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentstate/agentstate/internal/engine"
	"github.com/agentstate/agentstate/internal/gc"
	"github.com/agentstate/agentstate/store"
)

// policyFlags are the retention flags gc and forget share.
type policyFlags struct {
	keepLast, keepHourly, keepDaily int
}

func (p *policyFlags) register(cmd *cobra.Command) {
	d := gc.DefaultPolicy()
	cmd.Flags().IntVar(&p.keepLast, "keep-last", d.KeepLast, "keep the newest N manifests of each lineage (0 disables)")
	cmd.Flags().IntVar(&p.keepHourly, "keep-hourly", d.KeepHourly, "keep the newest manifest of each hour, for N hours (0 disables)")
	cmd.Flags().IntVar(&p.keepDaily, "keep-daily", d.KeepDaily, "keep the newest manifest of each day, for N days (0 disables)")
}

func (p *policyFlags) policy() (gc.Policy, error) {
	pol := gc.Policy{KeepLast: p.keepLast, KeepHourly: p.keepHourly, KeepDaily: p.keepDaily}
	if err := pol.Validate(); err != nil {
		return pol, usageError{err}
	}
	return pol, nil
}

// gcExitError maps gc's errors onto the CLI's exit codes: a damaged
// retained manifest is damage found (5); anything else is 1.
func gcExitError(err error) error {
	if errors.Is(err, gc.ErrDamaged) && !errors.Is(err, engine.ErrVerify) {
		return fmt.Errorf("%w: %w", engine.ErrVerify, err)
	}
	return err
}

const gcHelp = `gc deletes what no checkpoint needs any more, safely while containers keep
checkpointing. It is the only command that deletes anything.

Each run holds the repository's GC lease (locks/gc; one GC at a time) and:

  1. applies the retention policy to every lineage: the newest manifest of a
     lineage is always kept, plus the last --keep-last, the newest of each
     hour for --keep-hourly hours and of each day for --keep-daily days;
  2. sweeps the tombstones an earlier run wrote that are older than --grace:
     it deletes each listed manifest or segment only if it is still retired
     or unreferenced now (manifests committed since are taken into account)
     and was last modified more than --grace ago;
  3. marks: writes what is retired or unreferenced now into new tombstones,
     which a later run sweeps.

So nothing is deleted before it has been marked for at least --grace, and a
segment a checkpoint has uploaded but not committed yet survives. --grace
must be longer than any checkpoint takes. Ages are measured on the store's
clock, never the local one.

With --every D it loops (for a docker-compose or sidecar GC service) until
SIGTERM or SIGINT; a failed run is logged and retried at the next tick.
Without it, it runs once (for cron or a Kubernetes CronJob).

--dry-run writes and deletes nothing, not even the lease, and reports what a
run would sweep and mark (ages then use the local clock).

Compaction: each lineage's writer compacts at checkpoint time (small or
mostly dead segments are merged into fresh ones), because only the writer may
commit to its lineage. gc compacts only a lineage whose newest checkpoint is
older than --compact-idle (24 h): its writer is gone. It commits the same tree,
re-packed, as the next checkpoint; a writer that comes back commits after it.
Retired segments become garbage here once no retained checkpoint lists them.
Deleted paths are kept in checkpoints for the writer's --keep-deleted window,
and their bytes are reclaimed here after that.

Exit codes: 0 done; 1 error, or another GC holds the lease; 2 usage;
5 a retained manifest is damaged (GC deletes nothing until it is dealt with).`

func newGCCmd(g *globalFlags) *cobra.Command {
	var pf policyFlags
	var dryRun bool
	var grace, every, leaseTTL, compactIdle time.Duration
	cmd := &cobra.Command{
		Use:   "gc [--dry-run] [--grace D] [--every D] [--keep-last N] [--keep-hourly N] [--keep-daily N]",
		Short: "Delete retired checkpoints and unreferenced segments (mark, then sweep after a grace period)",
		Long:  gcHelp,
		Example: `  # what would go, changing nothing
  agentstate gc --dry-run --store s3://agents/prod

  # hourly from cron: keep the last 3, hourly for a day, daily for a week
  agentstate gc --store s3://agents/prod

  # a GC service: every 10 minutes, keeping two weeks of dailies
  agentstate gc --every 10m --keep-daily 14 --json`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			pol, err := pf.policy()
			if err != nil {
				return err
			}
			switch {
			case grace <= 0:
				return usageError{fmt.Errorf("--grace %s: must be positive (and longer than any checkpoint takes)", grace)}
			case every < 0:
				return usageError{fmt.Errorf("--every %s: must not be negative", every)}
			case leaseTTL < gc.MinLeaseTTL:
				return usageError{fmt.Errorf("--lease-ttl %s: must be at least %s", leaseTTL, gc.MinLeaseTTL)}
			}
			st, log, err := g.openStore(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			if grace < 10*time.Minute {
				log.Warn("a grace period this short can delete segments of a checkpoint that is still uploading; use it only for tests", "grace", grace)
			}
			opts := gc.Options{Policy: pol, Grace: grace, DryRun: dryRun, LeaseTTL: leaseTTL,
				Parallel: g.parallel, Logger: log, CompactIdle: compactIdle}
			if compactIdle <= 0 {
				opts.CompactIdle = -1 // the flag's 0 means never
			} else {
				// GC compacts from the store alone: of the state directory
				// the engine only uses the cached repository config. (Not a
				// temporary directory: a FROM scratch image has no /tmp.)
				e, err := engine.New(st, engine.Options{StateDir: g.stateDirPath(), Parallel: g.parallel, Logger: log})
				if err != nil {
					return err
				}
				opts.Compactor = engineCompactor{e}
			}
			out := cmd.OutOrStdout()
			if every == 0 {
				rep, err := gc.Run(cmd.Context(), st, opts)
				if rep != nil && (err == nil || rep.KeysSwept > 0 || rep.TombstonesWritten > 0) {
					if perr := printGC(out, rep, g.jsonOut, false); perr != nil && err == nil {
						err = perr
					}
				}
				return gcExitError(err)
			}
			return gcLoop(cmd.Context(), st, opts, every, out, g.jsonOut, log)
		},
	}
	pf.register(cmd)
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "change nothing; report what would be swept and marked")
	cmd.Flags().DurationVar(&grace, "grace", gc.DefaultGrace, "minimum age of a mark, and of everything it deletes, on the store's clock")
	cmd.Flags().DurationVar(&every, "every", 0, "run every D until SIGTERM (0: run once)")
	cmd.Flags().DurationVar(&leaseTTL, "lease-ttl", gc.DefaultLeaseTTL, "how long the GC lease lasts unrenewed: a crashed GC blocks the next one at most this long")
	cmd.Flags().DurationVar(&compactIdle, "compact-idle", gc.DefaultCompactIdle, "compact a lineage whose newest checkpoint is older than this (its writer is gone); 0: never")
	return cmd
}

// engineCompactor lets GC compact through the engine.
type engineCompactor struct{ e *engine.Engine }

func (c engineCompactor) Compact(ctx context.Context, lineage string, seq uint64) (gc.Compaction, error) {
	res, err := c.e.CompactStored(ctx, lineage, seq)
	if res == nil || err != nil {
		return gc.Compaction{}, err
	}
	return gc.Compaction{Committed: res.Committed, Segments: res.SegmentsCompacted, Bytes: res.BytesCompacted}, nil
}

// gcLoop runs GC every interval until ctx is done. A failed run is logged
// and the loop goes on: the next tick retries, and the lease of a crashed
// run expires by itself.
func gcLoop(ctx context.Context, st store.Store, opts gc.Options, every time.Duration, out io.Writer, jsonOut bool, log *slog.Logger) error {
	log.Info("gc service started", "every", every, "grace", opts.Grace, "policy", opts.Policy.String(), "dry_run", opts.DryRun)
	for {
		rep, err := gc.Run(ctx, st, opts)
		if ctx.Err() != nil {
			log.Info("gc service stopping")
			return nil
		}
		switch {
		case errors.Is(err, gc.ErrLeaseHeld):
			log.Info("another GC holds the lease; trying again at the next tick", "err", err)
		case err != nil:
			log.Error("gc run failed; retrying at the next tick", "err", gcExitError(err))
		default:
			if perr := printGC(out, rep, jsonOut, true); perr != nil {
				return perr
			}
		}
		t := time.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			log.Info("gc service stopping")
			return nil
		case <-t.C:
		}
	}
}

func printGC(w io.Writer, rep *gc.Report, jsonOut, oneLine bool) error {
	if jsonOut {
		if oneLine {
			return json.NewEncoder(w).Encode(rep) // one object per line, for a log
		}
		return printJSON(w, rep)
	}
	_, err := fmt.Fprintln(w, describeGC(rep))
	return err
}

func describeGC(r *gc.Report) string {
	var b strings.Builder
	would := func(done, hypothetical string) string {
		if r.DryRun {
			return hypothetical
		}
		return done
	}
	fmt.Fprintf(&b, "gc of %s (store clock %s)", r.Store, r.StoreTime.UTC().Format(time.RFC3339))
	if r.DryRun {
		fmt.Fprintf(&b, " -- DRY RUN: nothing was changed; ages on the local clock")
	}
	fmt.Fprintf(&b, "\n  manifests: %d in %s; %d retained, %d retired (%s)",
		r.Manifests, plural(r.Lineages, "lineage"), r.ManifestsRetained, r.ManifestsRetired, r.Policy)
	if r.TombstonesDue == 0 {
		fmt.Fprintf(&b, "\n  sweep: no tombstone is due yet")
	} else {
		fmt.Fprintf(&b, "\n  sweep: %d of %s due; %s %d manifests and %d segments, %s %s",
			r.TombstonesSwept, plural(r.TombstonesDue, "tombstone"), would("deleted", "would delete"), r.ManifestsSwept, r.SegmentsSwept,
			would("reclaimed", "would reclaim"), humanBytes(r.BytesReclaimed))
	}
	if r.KeptReferenced+r.KeptYoung+r.AlreadyGone > 0 {
		fmt.Fprintf(&b, "\n         kept %d referenced again, %d modified within the grace period; %d already gone",
			r.KeptReferenced, r.KeptYoung, r.AlreadyGone)
	}
	fmt.Fprintf(&b, "\n  mark: %s %d manifests and %d segments (%s) in %s, for a gc after %s",
		would("marked", "would mark"), r.ManifestsMarked, r.SegmentsMarked, humanBytes(r.BytesMarked), plural(r.TombstonesWritten, "tombstone"), r.Grace)
	if r.MarkSkipped != "" {
		fmt.Fprintf(&b, "\n        segments not marked: %s", r.MarkSkipped)
	}
	if r.TombstonesPending > 0 {
		fmt.Fprintf(&b, "\n  %s still in the grace period", plural(r.TombstonesPending, "tombstone"))
	}
	switch {
	case r.LineagesCompacted > 0:
		fmt.Fprintf(&b, "\n  compacted %s idle longer than the window: %d segments retired, %s of live blobs copied",
			plural(r.LineagesCompacted, "lineage"), r.SegmentsCompacted, humanBytes(r.BytesCompacted))
	case r.CompactFailed > 0:
		fmt.Fprintf(&b, "\n  compaction of idle lineages: %s could not be compacted (see the log)", plural(r.CompactFailed, "lineage"))
	case r.CompactSkipped != "":
		fmt.Fprintf(&b, "\n  compaction of idle lineages: skipped (%s)", r.CompactSkipped)
	}
	if r.Unknown > 0 {
		fmt.Fprintf(&b, "\n  %d objects not in agentstate's format were left alone", r.Unknown)
	}
	q := r.Requests
	d := r.Durations
	fmt.Fprintf(&b, "\n  requests %d (put %d, get %d, head %d, list %d, delete %d), took %s (scan %s, sweep %s, mark %s)",
		q.Total, q.Puts, q.Gets, q.Heads, q.Lists, q.Deletes, d.Total.Round(time.Millisecond),
		d.Scan.Round(time.Millisecond), d.Sweep.Round(time.Millisecond), d.Mark.Round(time.Millisecond))
	return b.String()
}

func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}

const forgetHelp = `forget applies a retention policy to one lineage. By default it only shows
which checkpoints the policy keeps and which it retires, and writes nothing.

With --apply it writes the retired checkpoints into a tombstone. It deletes
nothing itself: the next 'agentstate gc' after the grace period deletes those
manifests (even if gc's own policy would keep them), and a gc after that
deletes the segments only they needed. The newest checkpoint of a lineage is
never retired.

Times are the manifests' LastModified on the store's clock (a preview
compares them with the local clock, since it writes nothing).`

func newForgetCmd(g *globalFlags) *cobra.Command {
	var pf policyFlags
	var lineage string
	var apply bool
	cmd := &cobra.Command{
		Use:   "forget --lineage NAME [--apply] [--keep-last N] [--keep-hourly N] [--keep-daily N]",
		Short: "Preview or apply a retention policy for one lineage",
		Long:  forgetHelp,
		Example: `  # what would a stricter policy retire?
  agentstate forget --lineage claude --keep-last 1 --keep-hourly 0 --keep-daily 3

  # do it; gc deletes them after its grace period
  agentstate forget --lineage claude --keep-last 1 --keep-hourly 0 --keep-daily 3 --apply`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireFlags(cmd, "lineage"); err != nil {
				return err
			}
			pol, err := pf.policy()
			if err != nil {
				return err
			}
			st, log, err := g.openStore(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			rep, err := gc.Forget(cmd.Context(), st, gc.ForgetOptions{Lineage: lineage, Policy: pol, Apply: apply, Logger: log})
			if err != nil {
				return err
			}
			if g.jsonOut {
				return printJSON(cmd.OutOrStdout(), rep)
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), describeForget(rep))
			return err
		},
	}
	pf.register(cmd)
	cmd.Flags().StringVar(&lineage, "lineage", "", "lineage name")
	cmd.Flags().BoolVar(&apply, "apply", false, "write the retired checkpoints into a tombstone (default: preview only)")
	return cmd
}

func describeForget(r *gc.ForgetReport) string {
	var b strings.Builder
	fmt.Fprintf(&b, "lineage %s: %s; times on the %s clock\n", r.Lineage, r.Policy, r.Clock)
	fmt.Fprintf(&b, "%-8s %-20s %-7s %s\n", "SEQ", "COMMITTED", "ACTION", "WHY")
	for _, d := range r.Decisions {
		action, why := "keep", strings.Join(d.Reasons, ", ")
		if !d.Keep {
			action, why = "retire", ""
			if d.Marked {
				why = "already marked"
			}
		}
		fmt.Fprintf(&b, "%-8d %-20s %-7s %s\n", d.Seq, d.Time.UTC().Format(time.RFC3339), action, why)
	}
	fmt.Fprintf(&b, "%d kept, %d retired", r.Retained, r.Retired)
	switch {
	case r.Applied && r.Marked > 0:
		fmt.Fprintf(&b, "; marked %d in %s: a gc after its grace period deletes them", r.Marked, strings.Join(r.Tombstones, ", "))
	case r.Applied:
		fmt.Fprintf(&b, "; nothing new to mark")
	case r.Marked > 0:
		fmt.Fprintf(&b, "; preview only, nothing written: add --apply to mark the %d retired", r.Marked)
	default:
		fmt.Fprintf(&b, "; nothing to mark")
	}
	return b.String()
}
