package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentstate/agentstate/internal/engine"
)

func newCheckpointCmd(g *globalFlags) *cobra.Command {
	var t targetFlags
	var authoritative bool
	cmd := &cobra.Command{
		Use:   "checkpoint (--adapter NAME... | --all | --lineage NAME --dir PATH)",
		Short: "Upload what changed and commit a new checkpoint",
		Long: `Checkpoint scans each directory, reads only files whose size, mtime, ctime or
inode changed since the last checkpoint (the local index in --state-dir
remembers), uploads the content the repository does not have yet, and commits
a manifest last. A tree with no change costs no request to the store.

With adapters, append-only transcripts ship only the complete lines appended
since the last checkpoint, and SQLite databases are captured with the online
backup API and checked with quick_check; a database that fails keeps its
previous good copy and the command exits non-zero after committing the rest.

A lineage that already has checkpoints is only checkpointed on a machine that
restored it (or created it), so a partial restore never becomes the new truth;
--authoritative overrides that. If another writer committed to the lineage
first, nothing is committed and the exit code is 3: one writer per lineage.`,
		Example: `  agentstate checkpoint --adapter claude --adapter codex
  agentstate checkpoint --all --json
  agentstate checkpoint --lineage notes --dir ~/notes`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			targets, err := t.resolve(cmd, g)
			if err != nil {
				return err
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			var errs []error
			var results []*engine.CheckpointResult
			for _, tg := range targets {
				res, err := e.Checkpoint(cmd.Context(), tg.checkpointOptions(authoritative, g.keepDeleted))
				if err != nil {
					errs = append(errs, err)
				}
				if res != nil && (err == nil || res.Committed) {
					results = append(results, res)
					if !g.jsonOut {
						fmt.Fprintln(cmd.OutOrStdout(), describeCheckpoint(res))
					}
				}
			}
			if g.jsonOut {
				if err := printJSON(cmd.OutOrStdout(), oneOrMany(results, t.lineage != "")); err != nil {
					errs = append(errs, err)
				}
			}
			return errors.Join(errs...)
		},
	}
	t.register(cmd, true)
	cmd.Flags().BoolVar(&authoritative, "authoritative", false, "commit the local tree even if this machine never restored the lineage")
	g.registerKeepDeleted(cmd)
	cmd.Flags().BoolVar(&g.rawSQLite, "legacy-raw-sqlite", false, "one-time migration: the databases were copied raw (db, -wal, -shm) by the old sync script and nothing writes them; recover a private copy of each before capturing it")
	return cmd
}

// oneOrMany keeps the plain --lineage form's JSON a single object.
func oneOrMany[T any](list []T, single bool) any {
	if single && len(list) == 1 {
		return list[0]
	}
	return list
}

func describeCheckpoint(r *engine.CheckpointResult) string {
	head := fmt.Sprintf("lineage %s: committed seq %d", r.Lineage, r.Seq)
	if !r.Committed {
		head = fmt.Sprintf("lineage %s: no change since seq %d, nothing committed", r.Lineage, r.Seq)
	}
	extra := ""
	if r.SegmentsCompacted > 0 {
		extra = fmt.Sprintf("\n  compacted %d small or mostly dead segments (%s of live blobs copied)",
			r.SegmentsCompacted, humanBytes(r.BytesCompacted))
	}
	if r.Tombstones > 0 {
		extra += fmt.Sprintf("\n  keeps %d deleted paths restorable (agentstate ls --deleted)", r.Tombstones)
	}
	return fmt.Sprintf("%s\n  files %d, read %d, changed %d\n  uploaded %d blobs in %d segments, %s%s\n  requests %d, took %s",
		head, r.Files, r.FilesRead, r.FilesChanged, r.BlobsUploaded, r.SegmentsUploaded,
		humanBytes(r.BytesUploaded), extra, r.Requests, r.Duration.Round(time.Millisecond))
}

func newRestoreCmd(g *globalFlags) *cobra.Command {
	var t targetFlags
	var seq uint64
	var includeDeleted bool
	var onePath string
	cmd := &cobra.Command{
		Use:   "restore (--adapter NAME... | --all | --lineage NAME --dir PATH) [--seq N] [--include-deleted | --path P]",
		Short: "Restore from the newest checkpoint that verifies",
		Long: `Restore downloads the newest checkpoint of each lineage whose manifest and
objects verify (every byte is checked by SHA-256), stages it inside the
directory and only then moves each file into place atomically, with its mode
and mtime. A checkpoint that fails to verify is reported and the one before it
is used.

A local file newer than the checkpointed one is kept, and so is a local SQLite
database that passes quick_check (hot restart); a restored database never has
stale -wal/-shm files beside it. Nothing is ever written outside the directory
or through a symlink. An empty lineage is not an error: it is a first start.

Paths deleted from the tree stay in the checkpoints for --keep-deleted (7 days
by default) and are not restored unless asked: --include-deleted brings them
all back with the tree, --path brings back one path (a file, or a directory
with everything below it), deleted or not, and changes nothing else (missing
parent directories are created; existing ones keep their mode and mtime, but
for the entry added to them). See them with 'agentstate ls --deleted'.

Exit code 4 names every path that could not be written; 5 means manifests
exist but none verifies.`,
		Example: `  agentstate restore --all
  agentstate restore --adapter claude
  agentstate restore --lineage notes --dir /tmp/inspect --seq 41
  agentstate restore --adapter claude --path projects/-work/5f1c.jsonl`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			targets, err := t.resolve(cmd, g)
			if err != nil {
				return err
			}
			if seq != 0 && len(targets) != 1 {
				return usageError{errors.New("--seq names a sequence of one lineage: select exactly one")}
			}
			if onePath != "" && includeDeleted {
				return usageError{errors.New("--path already brings back a deleted path: drop --include-deleted")}
			}
			if onePath != "" && len(targets) != 1 {
				return usageError{errors.New("--path names a path of one lineage: select exactly one")}
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			var errs []error
			var results []*engine.RestoreResult
			for _, tg := range targets {
				res, err := e.Restore(cmd.Context(), engine.RestoreOptions{Lineage: tg.Lineage, Dir: tg.Dir, Seq: seq,
					IncludeDeleted: includeDeleted, Path: onePath})
				if err != nil {
					errs = append(errs, err)
				}
				if res != nil {
					results = append(results, res)
					// A restore that chose no checkpoint has nothing to describe.
					if !g.jsonOut && (err == nil || res.Seq != 0) {
						fmt.Fprintln(cmd.OutOrStdout(), describeRestore(res))
					}
				}
			}
			if g.jsonOut {
				if err := printJSON(cmd.OutOrStdout(), oneOrMany(results, t.lineage != "")); err != nil {
					errs = append(errs, err)
				}
			}
			return errors.Join(errs...)
		},
	}
	t.register(cmd, true)
	cmd.Flags().Uint64Var(&seq, "seq", 0, "restore exactly this sequence number (default: newest that verifies)")
	cmd.Flags().BoolVar(&includeDeleted, "include-deleted", false, "also bring back the paths deleted within the --keep-deleted window")
	cmd.Flags().StringVar(&onePath, "path", "", "restore only this path (relative to the directory), deleted or not, and leave the rest alone")
	return cmd
}

func describeRestore(r *engine.RestoreResult) string {
	if r.Empty {
		return fmt.Sprintf("lineage %s: no checkpoint yet (first start); nothing restored", r.Lineage)
	}
	s := fmt.Sprintf("lineage %s: restored seq %d\n  files %d (written %d, already equal %d, kept newer local %d), dirs %d, symlinks %d\n  downloaded %s in %d requests, took %s",
		r.Lineage, r.Seq, r.Files, r.Written, r.Unchanged, len(r.KeptNewer), r.Dirs, r.Symlinks,
		humanBytes(r.Bytes), r.Requests, r.Duration.Round(time.Millisecond))
	for _, rej := range r.Rejected {
		s += "\n  rejected newer checkpoint " + rej
	}
	for _, p := range r.Failed {
		s += "\n  FAILED " + p.Path + ": " + p.Err
	}
	return s
}

func newLsCmd(g *globalFlags) *cobra.Command {
	var t targetFlags
	var deleted bool
	var seq uint64
	cmd := &cobra.Command{
		Use:   "ls (--adapter NAME... | --all | --lineage NAME) [--deleted [--seq N]]",
		Short: "List the checkpoints of lineages, newest first, or the deleted paths they keep",
		Long: `Ls lists each lineage's checkpoints, newest first: sequence, time, live files
and bytes, the segments it needs, and the writer that committed it.

With --deleted it lists instead the paths deleted from the tree that the newest
checkpoint (or --seq) still keeps, with when each was deleted: they stay for
--keep-deleted (7 days by default) and come back with
'agentstate restore --path P' or 'agentstate restore --include-deleted'.`,
		Example: `  agentstate ls --all
  agentstate ls --adapter claude --deleted`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			targets, err := t.resolve(cmd, g)
			if err != nil {
				return err
			}
			if seq != 0 && (!deleted || len(targets) != 1) {
				return usageError{errors.New("--seq goes with --deleted and exactly one lineage")}
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			if deleted {
				return listDeleted(cmd, g, e, targets, seq, t.lineage != "")
			}
			all := map[string][]engine.Summary{}
			w := cmd.OutOrStdout()
			for _, tg := range targets {
				list, err := e.List(cmd.Context(), tg.Lineage)
				if err != nil {
					return err
				}
				all[tg.Lineage] = list
				if g.jsonOut {
					continue
				}
				if len(list) == 0 {
					fmt.Fprintf(w, "lineage %s has no checkpoint\n", tg.Lineage)
					continue
				}
				if len(targets) > 1 {
					fmt.Fprintf(w, "lineage %s\n", tg.Lineage)
				}
				fmt.Fprintf(w, "%-8s %-25s %8s %10s %8s  %s\n", "SEQ", "TIME", "FILES", "BYTES", "SEGMENTS", "WRITER")
				for _, s := range list {
					if s.Error != "" {
						fmt.Fprintf(w, "%-8d INVALID: %s\n", s.Seq, s.Error)
						continue
					}
					fmt.Fprintf(w, "%-8d %-25s %8d %10s %8d  %s\n", s.Seq, s.Time.Format(time.RFC3339),
						s.Totals.Files, humanBytes(s.Totals.Bytes), s.Segments, s.Writer)
				}
			}
			if g.jsonOut {
				if t.lineage != "" {
					return printJSON(w, all[t.lineage])
				}
				return printJSON(w, all)
			}
			return nil
		},
	}
	t.register(cmd, false)
	cmd.Flags().BoolVar(&deleted, "deleted", false, "list the deleted paths the checkpoint keeps restorable")
	cmd.Flags().Uint64Var(&seq, "seq", 0, "with --deleted: read this sequence (default: the newest)")
	return cmd
}

// listDeleted prints the deletion tombstones of each target's checkpoint.
func listDeleted(cmd *cobra.Command, g *globalFlags, e *engine.Engine, targets []target, seq uint64, single bool) error {
	type out struct {
		Lineage string               `json:"lineage"`
		Seq     uint64               `json:"seq"`
		Deleted []engine.DeletedPath `json:"deleted"`
	}
	var all []out
	w := cmd.OutOrStdout()
	for _, tg := range targets {
		s, list, err := e.Deleted(cmd.Context(), tg.Lineage, seq)
		if err != nil {
			return err
		}
		all = append(all, out{Lineage: tg.Lineage, Seq: s, Deleted: list})
		if g.jsonOut {
			continue
		}
		switch {
		case s == 0:
			fmt.Fprintf(w, "lineage %s has no checkpoint\n", tg.Lineage)
			continue
		case len(list) == 0:
			fmt.Fprintf(w, "lineage %s seq %d keeps no deleted path\n", tg.Lineage, s)
			continue
		}
		fmt.Fprintf(w, "lineage %s seq %d keeps %d deleted paths:\n", tg.Lineage, s, len(list))
		fmt.Fprintf(w, "%-25s %10s  %s\n", "DELETED", "BYTES", "PATH")
		for _, d := range list {
			fmt.Fprintf(w, "%-25s %10s  %s\n", d.Deleted.Format(time.RFC3339), humanBytes(d.Size), d.Path)
		}
	}
	if g.jsonOut {
		return printJSON(w, oneOrMany(all, single))
	}
	return nil
}

func newVerifyCmd(g *globalFlags) *cobra.Command {
	var t targetFlags
	var seq uint64
	cmd := &cobra.Command{
		Use:   "verify (--adapter NAME... | --all | --lineage NAME) [--seq N]",
		Short: "Download and check every object a checkpoint needs, writing nothing",
		Long: `Verify checks one checkpoint of each lineage (default: the newest) completely:
the manifest checksum, that every listed segment exists and matches its name
(SHA-256), every tree, and every content blob (length, xxhash64, SHA-256).
Exit code 5 if anything is wrong.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			targets, err := t.resolve(cmd, g)
			if err != nil {
				return err
			}
			if seq != 0 && len(targets) != 1 {
				return usageError{errors.New("--seq names a sequence of one lineage: select exactly one")}
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			var errs []error
			var results []*engine.VerifyResult
			for _, tg := range targets {
				res, err := e.Verify(cmd.Context(), tg.Lineage, seq)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				results = append(results, res)
				if !g.jsonOut {
					fmt.Fprintf(cmd.OutOrStdout(), "lineage %s seq %d: OK: %d files, %d dirs, %s in %d blobs, %d segments (%d requests, %s)\n",
						res.Lineage, res.Seq, res.Files, res.Dirs, humanBytes(res.Bytes), res.Blobs, res.Segments,
						res.Requests, res.Duration.Round(time.Millisecond))
				}
			}
			if g.jsonOut {
				if err := printJSON(cmd.OutOrStdout(), oneOrMany(results, t.lineage != "")); err != nil {
					errs = append(errs, err)
				}
			}
			return errors.Join(errs...)
		},
	}
	t.register(cmd, false)
	cmd.Flags().Uint64Var(&seq, "seq", 0, "sequence to verify (default: newest)")
	return cmd
}
