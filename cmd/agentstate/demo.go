package main

import (
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentstate/agentstate/internal/engine"
)

const demoTranscript = "sessions/2026/12/01/rollout-2026-12-01T07-00-00-5f1c2a9e.jsonl"

func newDemoCmd(g *globalFlags) *cobra.Command {
	var keep bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Show a checkpoint, a crash and a verified restore on a sample agent home",
		Long: `Demo builds a sample agent home (config, a credential file, a live JSONL
transcript, a binary attachment, a symlink), starts a separate writer process
that keeps appending to the transcript, checkpoints twice while it writes,
then simulates a crash: SIGKILL to the writer and the local tree wiped.
It restores from the store, verifies every file byte for byte against what
was on disk, and prints each step with what it cost.

Without --store it uses a fresh local folder store in a temporary directory
(the embedded default backend), so it needs nothing but this binary.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			work, err := os.MkdirTemp("", "agentstate-demo-")
			if err != nil {
				return err
			}
			if !keep {
				defer os.RemoveAll(work)
			}
			dg := *g
			if dg.store == "" {
				dg.store = "file://" + filepath.Join(work, "store")
			}
			if dg.stateDir == "" {
				dg.stateDir = filepath.Join(work, "state")
			}
			return runDemo(cmd, &dg, work)
		},
	}
	cmd.Flags().BoolVar(&keep, "keep", false, "keep the demo's temporary folder (home, store, state) for inspection")
	return cmd
}

func runDemo(cmd *cobra.Command, g *globalFlags, work string) error {
	ctx := cmd.Context()
	out := cmd.OutOrStdout()
	step := 0
	say := func(format string, a ...any) {
		step++
		fmt.Fprintf(out, "%2d. %s\n", step, fmt.Sprintf(format, a...))
	}
	e, st, err := g.openEngine(ctx, cmd)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "agentstate demo: store %s\n", st)
	home := filepath.Join(work, "home")
	n, size, err := buildSampleHome(home)
	if err != nil {
		return fmt.Errorf("build sample home: %w", err)
	}
	say("built a sample agent home: %d files, %s in %s", n, humanBytes(size), home)

	self, err := os.Executable()
	if err != nil {
		return err
	}
	writer := exec.Command(self, "demo-writer", filepath.Join(home, demoTranscript))
	writer.Stderr = cmd.ErrOrStderr()
	if err := writer.Start(); err != nil {
		return fmt.Errorf("start writer process: %w", err)
	}
	defer func() { _ = writer.Process.Kill(); _, _ = writer.Process.Wait() }()
	say("started writer process %d, appending a line every 2 ms to %s", writer.Process.Pid, demoTranscript)

	opts := engine.CheckpointOptions{Lineage: "demo", Dir: home}
	for i := range 2 {
		// Past one second, a file's stat alone proves it unchanged (files
		// changed within the last second are read again, as git does).
		time.Sleep(1100 * time.Millisecond)
		res, err := e.Checkpoint(ctx, opts)
		if err != nil {
			return err
		}
		what := "first checkpoint"
		if i == 1 {
			what = "second checkpoint, while the writer appends"
		}
		say("%s: seq %d, %d of %d files read, %s uploaded in %d requests (%s)", what, res.Seq,
			res.FilesRead, res.Files, humanBytes(res.BytesUploaded), res.Requests, res.Duration.Round(time.Millisecond))
	}

	time.Sleep(100 * time.Millisecond)
	if err := writer.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	_, _ = writer.Process.Wait()
	before, err := readTree(home)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(home); err != nil {
		return err
	}
	say("crash: SIGKILL to the writer (%d lines written), local tree wiped", bytes.Count(before[demoTranscript], []byte("\n")))

	rres, err := e.Restore(ctx, engine.RestoreOptions{Lineage: "demo", Dir: home})
	if err != nil {
		return err
	}
	say("restore: seq %d, %d files written, %s downloaded in %d requests (%s)", rres.Seq, rres.Written,
		humanBytes(rres.Bytes), rres.Requests, rres.Duration.Round(time.Millisecond))

	after, err := readTree(home)
	if err != nil {
		return err
	}
	equal := 0
	for name, want := range before {
		got, ok := after[name]
		if name == demoTranscript {
			if !ok || !bytes.HasPrefix(want, got) {
				return fmt.Errorf("demo: restored transcript is not a prefix of what the writer wrote")
			}
			continue
		}
		if !ok || !bytes.Equal(got, want) {
			return fmt.Errorf("demo: %s differs after restore", name)
		}
		equal++
	}
	if len(after) != len(before) {
		return fmt.Errorf("demo: restored %d files, had %d", len(after), len(before))
	}
	kept := bytes.Count(after[demoTranscript], []byte("\n"))
	total := bytes.Count(before[demoTranscript], []byte("\n"))
	say("verify: %d files byte-for-byte equal; the transcript is an exact prefix: %d of %d lines — the %d lost were written after the last checkpoint",
		equal, kept, total, total-kept)

	res, err := e.Checkpoint(ctx, opts)
	if err != nil {
		return err
	}
	state := "no change"
	if res.Committed {
		state = fmt.Sprintf("committed seq %d", res.Seq)
	}
	say("checkpoint of the restored tree: %s, %d requests (%s)", state, res.Requests, res.Duration.Round(time.Millisecond))
	fmt.Fprintln(out, "demo OK")
	return nil
}

// buildSampleHome lays out a Codex-like agent home.
func buildSampleHome(home string) (files int, size int64, err error) {
	rng := rand.New(rand.NewPCG(1, 2))
	attachment := make([]byte, 3<<20)
	for i := range attachment {
		attachment[i] = byte(rng.Uint32())
	}
	var lines strings.Builder
	for i := range 200 {
		fmt.Fprintf(&lines, `{"type":"message","seq":%d,"role":"assistant","text":"step %d of the plan"}`+"\n", i, i)
	}
	content := map[string][]byte{
		"config.toml":            []byte("model = \"gpt-5\"\napproval_policy = \"on-request\"\n"),
		"auth.json":              []byte(`{"OPENAI_API_KEY":"sk-demo-not-a-real-key"}` + "\n"),
		"history.jsonl":          []byte(`{"session_id":"5f1c2a9e","text":"fix the flaky test"}` + "\n"),
		demoTranscript:           []byte(lines.String()),
		"memories/notes.md":      []byte("# Notes\n\n- the build needs CGO_ENABLED=0\n"),
		"attachments/screen.bin": attachment,
		"empty.txt":              nil,
	}
	for name, b := range content {
		p := filepath.Join(home, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			return 0, 0, err
		}
		mode := os.FileMode(0o644)
		if name == "auth.json" {
			mode = 0o600
		}
		if err := os.WriteFile(p, b, mode); err != nil {
			return 0, 0, err
		}
		files++
		size += int64(len(b))
	}
	if err := os.Symlink(demoTranscript, filepath.Join(home, "latest.jsonl")); err != nil {
		return 0, 0, err
	}
	return files, size, nil
}

// readTree maps every regular file and symlink (as "->target") to its bytes.
func readTree(root string) (map[string][]byte, error) {
	out := map[string][]byte{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.Type()&fs.ModeSymlink != 0 {
			t, err := os.Readlink(p)
			out[rel] = []byte("->" + t)
			return err
		}
		b, err := os.ReadFile(p)
		out[rel] = b
		return err
	})
	return out, err
}

// newDemoWriterCmd is the demo's separate writer process: it appends one
// JSON line at a time, like a harness holding its transcript open.
//
// With --torn each line is written in two write calls with a pause between,
// so a reader often sees a torn last line, as with harnesses that flush
// per item.
func newDemoWriterCmd() *cobra.Command {
	var torn bool
	var start int
	cmd := &cobra.Command{
		Use:    "demo-writer FILE",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			f, err := os.OpenFile(args[0], os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
			if err != nil {
				return err
			}
			defer f.Close()
			for i := start; ; i++ {
				line := fmt.Sprintf(`{"type":"event","n":%d,"ts":%q}`+"\n", i, time.Now().UTC().Format(time.RFC3339Nano))
				if torn {
					if _, err := io.WriteString(f, line[:len(line)/2]); err != nil {
						return err
					}
					time.Sleep(time.Millisecond)
					line = line[len(line)/2:]
				}
				if _, err := io.WriteString(f, line); err != nil {
					return err
				}
				time.Sleep(2 * time.Millisecond)
			}
		},
	}
	cmd.Flags().BoolVar(&torn, "torn", false, "write each line in two halves")
	cmd.Flags().IntVar(&start, "start", 0, "first line number")
	return cmd
}
