package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
)

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func deletedPaths(t *testing.T, e *Engine) []string {
	t.Helper()
	_, del, err := e.Deleted(context.Background(), "test", 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range del {
		out = append(out, d.Path)
	}
	return out
}

func restoreTo(t *testing.T, f *fixture, state string, opts RestoreOptions) (string, *RestoreResult) {
	t.Helper()
	if opts.Dir == "" {
		opts.Dir = filepath.Join(f.root, "dst-"+filepath.Base(state))
	}
	opts.Lineage = "test"
	res, err := f.engine(filepath.Join(f.root, "state-"+state)).Restore(context.Background(), opts)
	if err != nil {
		t.Fatalf("restore %+v: %v", opts, err)
	}
	return opts.Dir, res
}

// A deleted file or directory stays restorable for the window, survives
// a restore on another machine and a lost index, and is gone after it.
func TestDeletedPathsRecoverableDuringWindow(t *testing.T) {
	f := newFixture(t)
	clock := &fakeClock{t: time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)}
	e, err := New(f.st, Options{StateDir: f.state, Now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(f.root, "src")
	for p, body := range map[string]string{
		"keep.txt": "keep", "gone.txt": "deleted file", "sessions/a/one.jsonl": "{}\n",
		"sessions/a/two.jsonl": "{}\n{}\n", "sessions/b.jsonl": "b\n",
	} {
		os.MkdirAll(filepath.Dir(filepath.Join(src, p)), 0o700)
		os.WriteFile(filepath.Join(src, p), []byte(body), 0o600)
	}
	os.Symlink("keep.txt", filepath.Join(src, "link"))
	full := testutil.Snapshot(t, src)
	f.checkpoint(e, src)

	os.Remove(filepath.Join(src, "gone.txt"))
	os.Remove(filepath.Join(src, "link"))
	os.RemoveAll(filepath.Join(src, "sessions/a"))
	live := testutil.Snapshot(t, src)
	res := f.checkpoint(e, src)
	if !res.Committed || res.Tombstones != 4 || res.FilesChanged != 4 {
		t.Fatalf("checkpoint after deleting 4 paths: %+v", res)
	}
	want := []string{"gone.txt", "link", "sessions/a/one.jsonl", "sessions/a/two.jsonl"}
	if got := deletedPaths(t, e); !slices.Equal(got, want) {
		t.Fatalf("ls --deleted: %v, want %v", got, want)
	}
	m, _ := manifest.Load(context.Background(), f.st, "test", res.Seq)
	if m.Totals.Files != 2 {
		t.Fatalf("totals count tombstones: %+v", m.Totals)
	}

	// A plain restore does not bring them back; --include-deleted does; a
	// single path brings back only that path.
	dst, _ := restoreTo(t, f, "plain", RestoreOptions{})
	testutil.CompareTrees(t, live, testutil.Snapshot(t, dst))
	dst, _ = restoreTo(t, f, "all", RestoreOptions{IncludeDeleted: true})
	// Files come back exactly; a deleted directory comes back as their
	// parent (owner-only, its old mode and mtime are not kept).
	testutil.CompareTrees(t, filesOnly(full), filesOnly(testutil.Snapshot(t, dst)))
	one := filepath.Join(f.root, "one")
	os.MkdirAll(one, 0o700)
	restoreTo(t, f, "one", RestoreOptions{Dir: one, Path: "sessions/a/two.jsonl"})
	got := testutil.Snapshot(t, one)
	if b, _ := os.ReadFile(filepath.Join(one, "sessions/a/two.jsonl")); string(b) != "{}\n{}\n" || len(got) != 3 {
		t.Fatalf("single-path restore: %q, tree %v", b, got)
	}
	if _, err := f.engine(filepath.Join(f.root, "x")).Restore(context.Background(),
		RestoreOptions{Lineage: "test", Dir: one, Path: "no/such"}); !errors.Is(err, ErrPathNotFound) {
		t.Fatalf("restore of a missing path: %v", err)
	}

	// Another machine restores the live tree; its next checkpoints keep
	// the tombstones (and so does a writer whose index is lost).
	clock.advance(3 * 24 * time.Hour)
	other, err := New(f.st, Options{StateDir: filepath.Join(f.root, "other-state"), Now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	odst := filepath.Join(f.root, "other")
	if _, err := other.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: odst}); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(odst, "new.txt"), []byte("new"), 0o600)
	if res := f.checkpoint(other, odst); !res.Committed || res.Tombstones != 4 {
		t.Fatalf("checkpoint after restore elsewhere: %+v", res)
	}
	lost, _ := filepath.Glob(filepath.Join(f.root, "other-state", "stores", "*", "test", "index.json"))
	if len(lost) != 1 || os.Remove(lost[0]) != nil {
		t.Fatalf("index files: %v", lost)
	}
	os.WriteFile(filepath.Join(odst, "new.txt"), []byte("newer"), 0o600)
	if res := f.checkpoint(other, odst); !res.Committed || res.Tombstones != 4 {
		t.Fatalf("checkpoint after a lost index: %+v", res)
	}
	if got := deletedPaths(t, e); !slices.Equal(got, want) {
		t.Fatalf("after a restore elsewhere: %v, want %v", got, want)
	}

	// A path that comes back is live again, not a tombstone.
	os.WriteFile(filepath.Join(odst, "gone.txt"), []byte("back"), 0o600)
	clock.advance(5 * 24 * time.Hour) // 8 days after the deletion
	res = f.checkpoint(other, odst)
	if !res.Committed || res.Tombstones != 0 {
		t.Fatalf("checkpoint past the window: %+v", res)
	}
	if got := deletedPaths(t, e); len(got) != 0 {
		t.Fatalf("tombstones past the window: %v", got)
	}
	dst, _ = restoreTo(t, f, "late", RestoreOptions{IncludeDeleted: true})
	if _, err := os.Stat(filepath.Join(dst, "sessions/a")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("expired directory restored: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "gone.txt")); string(b) != "back" {
		t.Fatalf("gone.txt: %q", b)
	}
}

// Negative KeepDeleted keeps no tombstones, and a kept tombstone keeps
// its segment in the manifest (GC keeps exactly what manifests list).
func TestTombstoneKeepsItsSegment(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	os.MkdirAll(src, 0o700)
	os.WriteFile(filepath.Join(src, "a"), []byte("only copy"), 0o600)
	f.checkpoint(f.e, src)
	ix, _ := f.e.state.loadIndex("test", f.e.st.String())
	seg := ix.Files["a"].Content[0].Segment
	os.Remove(filepath.Join(src, "a"))
	os.WriteFile(filepath.Join(src, "b"), []byte("other"), 0o600)
	res := f.checkpoint(f.e, src)
	m, _ := manifest.Load(context.Background(), f.st, "test", res.Seq)
	if !m.HasSegment(seg) {
		t.Fatal("the tombstone's segment is not listed: GC would delete it")
	}
	// Kept tombstones cost an idle checkpoint nothing.
	os.MkdirAll(filepath.Join(src, "d"), 0o700)
	os.WriteFile(filepath.Join(src, "d", "x"), []byte("in a directory"), 0o600)
	f.checkpoint(f.e, src)
	os.RemoveAll(filepath.Join(src, "d"))
	f.checkpoint(f.e, src)
	f.checkpoint(f.e, src) // settles racy stat data
	if res := f.checkpoint(f.e, src); res.Committed || res.Requests != 0 || res.Tombstones != 2 {
		t.Fatalf("idle checkpoint with tombstones: %+v", res)
	}
	res = f.checkpointOpts(f.e, CheckpointOptions{Dir: src, KeepDeleted: -1})
	m, _ = manifest.Load(context.Background(), f.st, "test", res.Seq)
	if m.HasSegment(seg) || res.Tombstones != 0 {
		t.Fatalf("KeepDeleted -1 kept the tombstone: %+v", res)
	}
}

func filesOnly(tree map[string]testutil.Node) map[string]testutil.Node {
	out := map[string]testutil.Node{}
	for p, n := range tree {
		if !n.Mode.IsDir() {
			out[p] = n
		}
	}
	return out
}

func writeFile(t *testing.T, root, p, body string) {
	t.Helper()
	os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o700)
	if err := os.WriteFile(filepath.Join(root, p), []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
}

// A directory excluded under a deleted one takes its tombstones along and
// leaves no empty ghost: the tree stays valid (no live entry inside a
// deleted directory) and no directory appears that never held a tombstone.
func TestTombstonesUnderExcludedDirectory(t *testing.T) {
	for _, tt := range []struct {
		name, excluded string
		files          []string
		wantDeleted    []string
	}{
		{"excluded below a kept tombstone", "a/b/c", []string{"a/f", "a/b/c/d"}, []string{"a/f"}},
		{"every tombstone excluded", "x/y", []string{"x/y/z"}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			src := filepath.Join(f.root, "src")
			writeFile(t, src, "keep", "k")
			for _, p := range tt.files {
				writeFile(t, src, p, p)
			}
			f.checkpoint(f.e, src)
			top := strings.Split(tt.files[0], "/")[0]
			os.RemoveAll(filepath.Join(src, top))
			res := f.checkpointOpts(f.e, CheckpointOptions{Dir: src,
				Exclude: func(rel string, isDir bool) bool { return isDir && rel == tt.excluded }})
			if _, err := f.e.Verify(context.Background(), "test", 0); err != nil {
				t.Fatalf("verify: %v", err)
			}
			m, _ := manifest.Load(context.Background(), f.st, "test", res.Seq)
			if m.Totals.Dirs != 0 {
				t.Fatalf("totals count a directory: %+v", m.Totals)
			}
			if got := deletedPaths(t, f.e); !slices.Equal(got, tt.wantDeleted) {
				t.Fatalf("deleted paths %v, want %v", got, tt.wantDeleted)
			}
			dst, rres := restoreTo(t, f, "r", RestoreOptions{})
			if rres.Seq != res.Seq || len(rres.Rejected) != 0 {
				t.Fatalf("restore fell back: %+v", rres)
			}
			if _, err := os.Stat(filepath.Join(dst, top)); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("%s restored as a live directory: %v", top, err)
			}
		})
	}
}

// After the local index is lost, an idle checkpoint commits nothing: a
// tombstone keeps its mtime, and a transcript whose prefix hashes to the
// stored pieces is not shipped whole again.
func TestLostIndexKeepsTombstonesAndTranscripts(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	writeFile(t, src, "keep", "k")
	writeFile(t, src, "gone", "g")
	old := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	os.Chtimes(filepath.Join(src, "gone"), old, old)
	tr := filepath.Join(src, "t.jsonl")
	opts := CheckpointOptions{Dir: src, AppendOnly: func(rel string) bool { return strings.HasSuffix(rel, ".jsonl") }}
	for i := range 3 {
		appendLines(t, tr, i*10, i*10+10, "")
		f.checkpointOpts(f.e, opts)
	}
	os.Remove(filepath.Join(src, "gone"))
	f.checkpointOpts(f.e, opts)
	time.Sleep(1100 * time.Millisecond) // out of the racy window
	f.checkpointOpts(f.e, opts)
	lost, _ := filepath.Glob(filepath.Join(f.state, "stores", "*", "test", "index.json"))
	if len(lost) != 1 || os.Remove(lost[0]) != nil {
		t.Fatalf("index files: %v", lost)
	}
	if res := f.checkpointOpts(f.e, opts); res.Committed || res.BytesUploaded != 0 {
		t.Fatalf("idle checkpoint after a lost index: %+v", res)
	}
	dst, _ := restoreTo(t, f, "r", RestoreOptions{IncludeDeleted: true})
	if fi, err := os.Stat(filepath.Join(dst, "gone")); err != nil || !fi.ModTime().Equal(old) {
		t.Fatalf("restored tombstone: %v, mtime %v, want %v", err, fi.ModTime(), old)
	}
}

// Restoring one path creates missing parents but leaves existing ones as
// they are: the rest of the directory is not touched.
func TestRestorePathLeavesAncestorsAlone(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	writeFile(t, src, "a/b/f", "f")
	f.checkpoint(f.e, src)
	dst := filepath.Join(f.root, "dst")
	os.MkdirAll(filepath.Join(dst, "a"), 0o755)
	os.Chmod(filepath.Join(dst, "a"), 0o755)
	later := time.Now().Add(time.Hour).Truncate(time.Second)
	os.Chtimes(filepath.Join(dst, "a"), later, later)
	restoreTo(t, f, "r", RestoreOptions{Dir: dst, Path: "a/b/f"})
	fi, err := os.Stat(filepath.Join(dst, "a"))
	if err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("ancestor a: %v %v, want 0755 kept", fi.Mode(), err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "a/b/f")); string(b) != "f" {
		t.Fatalf("a/b/f: %q", b)
	}
}
