package engine

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

type fixture struct {
	t     *testing.T
	st    store.Store
	root  string
	state string
	e     *Engine
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	root := t.TempDir()
	st, err := store.OpenDir(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, st: st, root: root, state: filepath.Join(root, "state")}
	f.e = f.engine(f.state)
	return f
}

func (f *fixture) engine(state string) *Engine {
	e, err := New(f.st, Options{StateDir: state})
	if err != nil {
		f.t.Fatal(err)
	}
	return e
}

func (f *fixture) checkpoint(e *Engine, dir string) *CheckpointResult {
	f.t.Helper()
	res, err := e.Checkpoint(context.Background(), CheckpointOptions{Lineage: "test", Dir: dir})
	if err != nil {
		f.t.Fatalf("checkpoint: %v", err)
	}
	return res
}

func (f *fixture) keys() []string {
	var keys []string
	for o, err := range f.st.List(context.Background(), "") {
		if err != nil {
			f.t.Fatal(err)
		}
		keys = append(keys, o.Key)
	}
	return keys
}

func TestCheckpointRestoreRoundTrip(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 1, SmallFiles: 300, LargeFile: 9 << 20})
	want := testutil.Snapshot(t, src)

	res := f.checkpoint(f.e, src)
	if !res.Committed || res.Seq != 1 {
		t.Fatalf("first checkpoint: %+v", res)
	}
	dst := filepath.Join(f.root, "dst")
	rres, err := f.engine(filepath.Join(f.root, "state2")).Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst})
	if err != nil {
		t.Fatal(err)
	}
	if rres.Seq != 1 || rres.Written != res.Files+3 {
		t.Fatalf("restore: %+v (checkpoint had %d files + 3 symlinks)", rres, res.Files)
	}
	testutil.CompareTrees(t, want, testutil.Snapshot(t, dst))
	// Symlink mtimes are restored too.
	for _, l := range []string{"link-to-leaf", "absolute-link"} {
		a, _ := os.Lstat(filepath.Join(src, l))
		b, _ := os.Lstat(filepath.Join(dst, l))
		if !a.ModTime().Equal(b.ModTime()) {
			t.Errorf("%s mtime %v, want %v", l, b.ModTime(), a.ModTime())
		}
	}
	if _, err := f.e.Verify(context.Background(), "test", 0); err != nil {
		t.Fatalf("verify: %v", err)
	}
}

func TestIdleCheckpointMakesNoRequest(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 2, SmallFiles: 200, LargeFile: 6 << 20})
	f.checkpoint(f.e, src)
	// Files changed within a second of a checkpoint are read again once
	// (their stat cannot prove them unchanged); past that, stat suffices.
	time.Sleep(1100 * time.Millisecond)
	f.checkpoint(f.e, src)
	before := f.keys()
	res := f.checkpoint(f.e, src)
	if res.Committed || res.Requests != 0 || res.FilesRead != 0 {
		t.Fatalf("idle checkpoint: %+v, want no commit, 0 requests, 0 files read", res)
	}
	if after := f.keys(); !slices.Equal(before, after) {
		t.Fatalf("idle checkpoint changed the store: %d -> %d objects", len(before), len(after))
	}
	// Even a fresh engine (new process) on the same state makes none.
	res = f.checkpoint(f.engine(f.state), src)
	if res.Requests != 0 {
		t.Fatalf("idle checkpoint from a new engine made %d requests", res.Requests)
	}
}

func TestAppendCostsFewObjects(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 3, SmallFiles: 500, LargeFile: 40 << 20})
	f.checkpoint(f.e, src)
	f.checkpoint(f.e, src)
	before := f.keys()
	p := filepath.Join(src, "small/d07/e0/f00007.txt")
	fh, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fh.Write(bytes.Repeat([]byte("x"), 1024))
	fh.Close()
	res := f.checkpoint(f.e, src)
	added := len(f.keys()) - len(before)
	if !res.Committed || added > 3 || res.BytesUploaded > 64<<10 || res.FilesChanged != 1 {
		t.Fatalf("append: %+v, %d new objects; want ≤ 3 objects, ≤ 64 KiB, 1 file changed", res, added)
	}
}

func TestHotRestoreKeepsNewerLocalFile(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 4, SmallFiles: 10})
	f.checkpoint(f.e, src)
	p := filepath.Join(src, "secret.json")
	if err := os.WriteFile(p, []byte("newer local work"), 0o600); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(src, "run.sh"))
	res, err := f.e.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: src})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "newer local work" {
		t.Fatalf("restore overwrote a newer local file: %q", b)
	}
	if !slices.Contains(res.KeptNewer, "secret.json") || res.Written != 1 {
		t.Fatalf("restore result %+v: want secret.json kept and only run.sh written", res)
	}
	if _, err := os.Stat(filepath.Join(src, "run.sh")); err != nil {
		t.Fatalf("missing file not restored: %v", err)
	}
}

func TestCorruptSegmentFallsBackToOlderManifest(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 5, SmallFiles: 20})
	f.checkpoint(f.e, src)
	old := testutil.Snapshot(t, src)
	os.WriteFile(filepath.Join(src, "new.txt"), []byte("only in seq 2"), 0o644)
	res := f.checkpoint(f.e, src)
	if res.Seq != 2 {
		t.Fatal(res)
	}
	m, err := manifest.Load(context.Background(), f.st, "test", 2)
	if err != nil {
		t.Fatal(err)
	}
	// Flip one byte in every segment that seq 2 has and seq 1 does not.
	m1, _ := manifest.Load(context.Background(), f.st, "test", 1)
	flipped := 0
	for _, s := range m.Segments {
		if m1.HasSegment(s) {
			continue
		}
		p := filepath.Join(f.root, "store", filepath.FromSlash(segments.Key(s)))
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		b[len(b)/2] ^= 1
		os.Chmod(p, 0o600)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		flipped++
	}
	if flipped == 0 {
		t.Fatal("no segment to corrupt")
	}
	dst := filepath.Join(f.root, "dst")
	rres, err := f.engine(filepath.Join(f.root, "s2")).Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst})
	if err != nil {
		t.Fatal(err)
	}
	if rres.Seq != 1 || len(rres.Rejected) != 1 {
		t.Fatalf("restore %+v: want seq 1 after rejecting seq 2", rres)
	}
	testutil.CompareTrees(t, old, testutil.Snapshot(t, dst))
	if _, err := f.e.Verify(context.Background(), "test", 2); !errors.Is(err, ErrVerify) {
		t.Fatalf("verify of corrupt seq 2: %v", err)
	}
}

func TestConcurrentWriterIsRefused(t *testing.T) {
	f := newFixture(t)
	a, b := filepath.Join(f.root, "a"), filepath.Join(f.root, "b")
	testutil.GenTree(t, a, testutil.TreeSpec{Seed: 6})
	testutil.GenTree(t, b, testutil.TreeSpec{Seed: 7, SmallFiles: 3})
	f.checkpoint(f.e, a)
	other := f.engine(filepath.Join(f.root, "other-state"))
	if _, err := other.Checkpoint(context.Background(), CheckpointOptions{Lineage: "test", Dir: b, Authoritative: true}); err != nil {
		t.Fatal(err) // its index is rebuilt from seq 1: it commits seq 2
	}
	os.WriteFile(filepath.Join(a, "more"), []byte("x"), 0o644)
	_, err := f.e.Checkpoint(context.Background(), CheckpointOptions{Lineage: "test", Dir: a})
	if !errors.Is(err, manifest.ErrConflict) {
		t.Fatalf("second writer: err = %v, want ErrConflict", err)
	}
	seqs, _ := manifest.Sequences(context.Background(), f.st, "test")
	if !slices.Equal(seqs, []uint64{2, 1}) {
		t.Fatalf("sequences %v: the refused writer must commit nothing", seqs)
	}
}

func TestCrashAfterCommitBeforeIndexSave(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 8, SmallFiles: 5})
	f.checkpoint(f.e, src)
	ixPath := filepath.Join(f.e.state.storeDir, "test", "index.json")
	saved, err := os.ReadFile(ixPath)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(src, "x"), []byte("1"), 0o644)
	f.checkpoint(f.e, src)
	// Pretend the process died right after committing seq 2.
	os.WriteFile(ixPath, saved, 0o600)
	os.WriteFile(filepath.Join(src, "y"), []byte("2"), 0o644)
	res := f.checkpoint(f.engine(f.state), src)
	if res.Seq != 3 {
		t.Fatalf("after a lost index save: %+v, want seq 3", res)
	}
}

func TestLostIndexIsRebuiltWithoutReupload(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 9, SmallFiles: 50, LargeFile: 2 << 20})
	f.checkpoint(f.e, src)
	for _, corrupt := range []bool{false, true} {
		ixPath := filepath.Join(f.e.state.storeDir, "test", "index.json")
		if corrupt {
			os.WriteFile(ixPath, []byte("{not json"), 0o600)
		} else {
			os.Remove(ixPath)
		}
		res := f.checkpoint(f.engine(f.state), src)
		if res.Committed || res.BytesUploaded != 0 {
			t.Fatalf("corrupt=%v: rebuilt index re-uploaded: %+v", corrupt, res)
		}
	}
}

func TestStateIsOwnerOnly(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 10})
	f.checkpoint(f.e, src)
	filepath.Walk(f.state, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s has mode %v: state must be owner-only", p, fi.Mode().Perm())
		}
		return nil
	})
}

// failingStore fails every segment upload, as a store that dies mid-way.
type failingStore struct {
	store.Store
}

func (f failingStore) Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts store.PutOptions) (store.ObjectInfo, error) {
	if strings.HasPrefix(key, "segments/") {
		return store.ObjectInfo{}, errors.New("injected: connection reset")
	}
	return f.Store.Put(ctx, key, body, size, opts)
}

func TestFailedUploadLeavesNoManifest(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 11, SmallFiles: 20})
	bad, err := New(failingStore{f.st}, Options{StateDir: f.state})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bad.Checkpoint(context.Background(), CheckpointOptions{Lineage: "test", Dir: src}); err == nil {
		t.Fatal("checkpoint with failing uploads succeeded")
	}
	if seqs, _ := manifest.Sequences(context.Background(), f.st, "test"); len(seqs) != 0 {
		t.Fatalf("a failed upload left manifests %v", seqs)
	}
	if res := f.checkpoint(f.engine(f.state), src); res.Seq != 1 || !res.Committed {
		t.Fatalf("checkpoint after the store recovered: %+v", res)
	}
}

func TestSpecialFilesAreSkipped(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	os.MkdirAll(src, 0o700)
	os.WriteFile(filepath.Join(src, "keep.txt"), []byte("x"), 0o600)
	if err := syscall.Mkfifo(filepath.Join(src, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", filepath.Join(src, "agent.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	res := f.checkpoint(f.e, src)
	slices.Sort(res.Skipped)
	if !slices.Equal(res.Skipped, []string{"agent.sock", "fifo"}) || res.Files != 1 {
		t.Fatalf("checkpoint %+v: want fifo and socket skipped, keep.txt stored", res)
	}
}

// TestRacyRereadUploadsNothing: a file read again because it changed too
// recently for its stat to prove anything must not re-encode its stored
// chunk list (a paged one included) into new blobs when its content is the
// same: an unchanged tree writes no object.
func TestRacyRereadUploadsNothing(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 21, SmallFiles: 30, LargeFile: 48 << 20})
	f.checkpoint(f.e, src)
	before := f.keys()
	res := f.checkpoint(f.e, src) // within the racy window: files are read again
	if res.FilesRead == 0 {
		t.Fatal("the files were not re-read: the test proves nothing")
	}
	if res.Committed || res.BytesUploaded != 0 || len(f.keys()) != len(before) {
		t.Fatalf("re-reading unchanged files uploaded: %+v", res)
	}
}
