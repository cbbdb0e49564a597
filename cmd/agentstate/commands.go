package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentstate/agentstate/internal/engine"
)

type lineageFlags struct {
	lineage string
	dir     string
	seq     uint64
}

func newCheckpointCmd(g *globalFlags) *cobra.Command {
	var f lineageFlags
	cmd := &cobra.Command{
		Use:   "checkpoint --lineage NAME --dir PATH",
		Short: "Upload what changed in a directory and commit a new checkpoint",
		Long: `Checkpoint scans --dir, reads only files whose size, mtime, ctime or inode
changed since the last checkpoint (the local index in --state-dir remembers),
uploads the content the repository does not have yet, and commits a manifest
last. A tree with no change costs no request to the store.

If another writer committed to the same lineage first, nothing is committed
and the exit code is 3: one writer per lineage.`,
		Example: `  agentstate checkpoint --lineage claude --dir ~/.claude
  AGENTSTATE_STORE=s3://agents/prod agentstate checkpoint --lineage codex --dir $CODEX_HOME --json`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireFlags(cmd, "lineage", "dir"); err != nil {
				return err
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			res, err := e.Checkpoint(cmd.Context(), engine.CheckpointOptions{Lineage: f.lineage, Dir: f.dir})
			if err != nil {
				return err
			}
			if g.jsonOut {
				return printJSON(cmd.OutOrStdout(), res)
			}
			fmt.Fprintln(cmd.OutOrStdout(), describeCheckpoint(res))
			return nil
		},
	}
	cmd.Flags().StringVar(&f.lineage, "lineage", "", "lineage name: one harness of one deployment (letters, digits, . _ -)")
	cmd.Flags().StringVar(&f.dir, "dir", "", "directory to checkpoint")
	return cmd
}

func describeCheckpoint(r *engine.CheckpointResult) string {
	head := fmt.Sprintf("lineage %s: committed seq %d", r.Lineage, r.Seq)
	if !r.Committed {
		head = fmt.Sprintf("lineage %s: no change since seq %d, nothing committed", r.Lineage, r.Seq)
	}
	return fmt.Sprintf("%s\n  files %d, read %d, changed %d\n  uploaded %d blobs in %d segments, %s\n  requests %d, took %s",
		head, r.Files, r.FilesRead, r.FilesChanged, r.BlobsUploaded, r.SegmentsUploaded,
		humanBytes(r.BytesUploaded), r.Requests, r.Duration.Round(time.Millisecond))
}

func newRestoreCmd(g *globalFlags) *cobra.Command {
	var f lineageFlags
	cmd := &cobra.Command{
		Use:   "restore --lineage NAME --dir PATH [--seq N]",
		Short: "Restore a directory from the newest checkpoint that verifies",
		Long: `Restore downloads the newest checkpoint of the lineage whose manifest and
objects verify (every byte is checked by SHA-256), stages it inside --dir and
only then moves each file into place atomically, with its mode and mtime.
A checkpoint that fails to verify is reported and the one before it is used.

A local file newer than the checkpointed one is kept (hot restart). Nothing
is ever written outside --dir or through a symlink. An empty lineage is not
an error: it is a first start.

Exit code 4 names every path that could not be written; 5 means manifests
exist but none verifies.`,
		Example: `  agentstate restore --lineage claude --dir ~/.claude
  agentstate restore --lineage claude --dir /tmp/inspect --seq 41`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireFlags(cmd, "lineage", "dir"); err != nil {
				return err
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			res, err := e.Restore(cmd.Context(), engine.RestoreOptions{Lineage: f.lineage, Dir: f.dir, Seq: f.seq})
			if g.jsonOut && res != nil {
				if perr := printJSON(cmd.OutOrStdout(), res); perr != nil && err == nil {
					err = perr
				}
			} else if res != nil {
				fmt.Fprintln(cmd.OutOrStdout(), describeRestore(res))
			}
			return err
		},
	}
	cmd.Flags().StringVar(&f.lineage, "lineage", "", "lineage name")
	cmd.Flags().StringVar(&f.dir, "dir", "", "directory to restore into (created if missing)")
	cmd.Flags().Uint64Var(&f.seq, "seq", 0, "restore exactly this sequence number (default: newest that verifies)")
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
	var f lineageFlags
	cmd := &cobra.Command{
		Use:   "ls --lineage NAME",
		Short: "List the checkpoints of a lineage, newest first",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireFlags(cmd, "lineage"); err != nil {
				return err
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			list, err := e.List(cmd.Context(), f.lineage)
			if err != nil {
				return err
			}
			if g.jsonOut {
				return printJSON(cmd.OutOrStdout(), list)
			}
			w := cmd.OutOrStdout()
			if len(list) == 0 {
				fmt.Fprintf(w, "lineage %s has no checkpoint\n", f.lineage)
				return nil
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
			return nil
		},
	}
	cmd.Flags().StringVar(&f.lineage, "lineage", "", "lineage name")
	return cmd
}

func newVerifyCmd(g *globalFlags) *cobra.Command {
	var f lineageFlags
	cmd := &cobra.Command{
		Use:   "verify --lineage NAME [--seq N]",
		Short: "Download and check every object a checkpoint needs, writing nothing",
		Long: `Verify checks one checkpoint (default: the newest) completely: the manifest
checksum, that every listed segment exists, every tree, and every content
blob (length, xxhash64 and SHA-256). Exit code 5 if anything is wrong.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := requireFlags(cmd, "lineage"); err != nil {
				return err
			}
			e, _, err := g.openEngine(cmd.Context(), cmd)
			if err != nil {
				return err
			}
			res, err := e.Verify(cmd.Context(), f.lineage, f.seq)
			if err != nil {
				return err
			}
			if g.jsonOut {
				return printJSON(cmd.OutOrStdout(), res)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "lineage %s seq %d: OK: %d files, %d dirs, %s in %d blobs, %d segments (%d requests, %s)\n",
				res.Lineage, res.Seq, res.Files, res.Dirs, humanBytes(res.Bytes), res.Blobs, res.Segments,
				res.Requests, res.Duration.Round(time.Millisecond))
			return nil
		},
	}
	cmd.Flags().StringVar(&f.lineage, "lineage", "", "lineage name")
	cmd.Flags().Uint64Var(&f.seq, "seq", 0, "sequence to verify (default: newest)")
	return cmd
}
