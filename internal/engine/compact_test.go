package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

// A lineage that changes a little at every checkpoint keeps a bounded
// segment list and a transcript with few chunks, and every compacted
// manifest restores exactly.
func TestCompactionBoundsSegmentList(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 40, SmallFiles: 50, LargeFile: 6 << 20})
	transcript := filepath.Join(src, "sessions", "rollout.jsonl")
	os.MkdirAll(filepath.Dir(transcript), 0o700)
	opts := CheckpointOptions{Dir: src, AppendOnly: func(rel string) bool { return strings.HasSuffix(rel, ".jsonl") }}

	const rounds = 160 // past manifest.PageChunks pieces: a paged chunk list
	compactions, maxSegs := 0, 0
	var copied, uploaded, first int64
	for i := range rounds {
		appendLines(t, transcript, i*10, i*10+10, "")
		note := filepath.Join(src, "notes", fmt.Sprintf("n%d.txt", i%7))
		os.MkdirAll(filepath.Dir(note), 0o700)
		os.WriteFile(note, []byte(fmt.Sprintf("round %d\n", i)), 0o600)
		res := f.checkpointOpts(f.e, opts)
		if i == 0 {
			first = res.BytesUploaded
		}
		if !res.Committed {
			t.Fatalf("round %d: nothing committed: %+v", i, res)
		}
		if res.SegmentsCompacted > 0 {
			compactions++
		}
		copied += res.BytesCompacted
		uploaded += res.BytesUploaded
		m, err := manifest.Load(context.Background(), f.st, "test", res.Seq)
		if err != nil {
			t.Fatal(err)
		}
		maxSegs = max(maxSegs, len(m.Segments))
		if i%40 == 39 {
			dst := filepath.Join(f.root, fmt.Sprintf("dst%d", i))
			other := f.engine(filepath.Join(f.root, fmt.Sprintf("state%d", i)))
			rres, err := other.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst})
			if err != nil {
				t.Fatalf("round %d: restore: %v", i, err)
			}
			// A LIST and the manifest, then per segment a HEAD and a GET
			// (a data segment may take two): not a GET per directory.
			if bound := 2 + 3*int64(len(m.Segments)); rres.Requests > bound {
				t.Fatalf("round %d: restore made %d requests for %d segments, want at most %d", i, rres.Requests, len(m.Segments), bound)
			}
			testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
			if _, err := f.e.Verify(context.Background(), "test", 0); err != nil {
				t.Fatalf("round %d: verify: %v", i, err)
			}
		}
	}
	// Without compaction: about 3 new segments per round (data, lines, trees).
	if bound := compactMinSegments + 6; maxSegs > bound {
		t.Fatalf("newest manifest listed up to %d segments after %d rounds, want at most %d", maxSegs, rounds, bound)
	}
	if compactions < rounds/compactMinSegments {
		t.Fatalf("%d compactions in %d rounds", compactions, rounds)
	}
	// Tiers: the big, stable segment of the first checkpoint is not copied
	// again and again; copying stays within what the changes uploaded.
	if later := uploaded - first; copied > 2*later {
		t.Fatalf("compaction copied %d bytes while the changes uploaded %d", copied, later)
	}
	// Appended pieces are merged: the chunk count follows the size, not
	// the number of checkpoints.
	ix, err := f.e.state.loadIndex("test", f.e.st.String())
	if err != nil {
		t.Fatal(err)
	}
	// 72 KB: one or two CDC chunks, and fewer than 32 (mergeTail) pieces.
	if n := len(ix.Files["sessions/rollout.jsonl"].Content); n > 34 {
		t.Fatalf("transcript appended %d times holds %d chunks, want at most 34", rounds, n)
	}
	// Idle after compaction: no request.
	f.checkpointOpts(f.e, opts) // settles racy files
	if res := f.checkpointOpts(f.e, opts); res.Committed || res.Requests != 0 {
		t.Fatalf("idle checkpoint after compaction: %+v", res)
	}
}

// A candidate segment that is gone is not copied: the files it held are
// read and uploaded again from the local tree, so the next manifest is
// whole again.
func TestCompactionHealsAMissingSegment(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	os.MkdirAll(src, 0o700)
	for i := range compactMinSegments - 1 { // one data segment each, and the tree segment
		os.WriteFile(filepath.Join(src, fmt.Sprintf("f%02d", i)), []byte(strings.Repeat(fmt.Sprint(i), 100)), 0o600)
		f.checkpoint(f.e, src)
	}
	// Lose the data segment of f00.
	ix, err := f.e.state.loadIndex("test", f.e.st.String())
	if err != nil {
		t.Fatal(err)
	}
	lost := ix.Files["f00"].Content[0].Segment
	if err := f.st.Delete(context.Background(), []string{segments.Key(lost)}); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(src, "trigger"), []byte("x"), 0o600)
	res := f.checkpoint(f.e, src)
	if res.SegmentsCompacted == 0 {
		t.Fatalf("no compaction: %+v", res)
	}
	m, err := manifest.Load(context.Background(), f.st, "test", res.Seq)
	if err != nil {
		t.Fatal(err)
	}
	if m.HasSegment(lost) {
		t.Fatalf("manifest %d still lists the lost segment", m.Seq)
	}
	dst := filepath.Join(f.root, "dst")
	if _, err := f.engine(filepath.Join(f.root, "state2")).Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst}); err != nil {
		t.Fatal(err)
	}
	testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
}

// GC compacts an idle lineage from the store alone, keeping the tree and
// its tombstones exactly, and the writer that comes back commits after the
// compaction instead of failing as a concurrent writer.
func TestCompactStoredAndWriterRebase(t *testing.T) {
	f := newFixture(t)
	writer, err := New(f.st, Options{StateDir: f.state, CompactAt: -1})
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(f.root, "src")
	os.MkdirAll(filepath.Join(src, "d"), 0o700)
	for i := range 24 {
		os.WriteFile(filepath.Join(src, "d", fmt.Sprintf("f%02d", i)), []byte(strings.Repeat(fmt.Sprint(i), 50)), 0o600)
		if i == 10 {
			os.Symlink("f01", filepath.Join(src, "d", "link"))
		}
		if i == 20 {
			os.Remove(filepath.Join(src, "d", "f03"))
		}
		f.checkpoint(writer, src)
	}
	seqs, _ := manifest.Sequences(context.Background(), f.st, "test")
	old, _ := manifest.Load(context.Background(), f.st, "test", seqs[0])
	wantDeleted := deletedPaths(t, writer)

	gcEngine := f.engine(filepath.Join(f.root, "gc-state"))
	res, err := gcEngine.CompactStored(context.Background(), "test", old.Seq)
	if err != nil || !res.Committed || res.Seq != old.Seq+1 {
		t.Fatalf("compact stored: %+v, %v", res, err)
	}
	m, _ := manifest.Load(context.Background(), f.st, "test", res.Seq)
	if m.Compacts != old.Seq || m.Writer != CompactorWriter || len(m.Segments) >= len(old.Segments)/2 || m.Totals != old.Totals {
		t.Fatalf("compacted manifest: %d segments (was %d), totals %+v (was %+v), compacts %d",
			len(m.Segments), len(old.Segments), m.Totals, old.Totals, m.Compacts)
	}
	if _, err := gcEngine.Verify(context.Background(), "test", m.Seq); err != nil {
		t.Fatal(err)
	}
	dst, _ := restoreTo(t, f, "after-gc", RestoreOptions{})
	testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
	if got := deletedPaths(t, writer); !slices.Equal(got, wantDeleted) || len(got) != 1 {
		t.Fatalf("tombstones after compaction %v, want %v", got, wantDeleted)
	}
	// Compacting an older sequence is refused by the commit, quietly.
	if res, err := gcEngine.CompactStored(context.Background(), "test", old.Seq-1); err != nil || res.Committed {
		t.Fatalf("compact of an old sequence: %+v, %v", res, err)
	}

	// The writer comes back: its commit on old.Seq meets the compaction.
	os.WriteFile(filepath.Join(src, "d", "f00"), []byte("changed"), 0o600)
	wres := f.checkpoint(writer, src)
	if !wres.Committed || wres.Seq != m.Seq+1 {
		t.Fatalf("writer after a compaction: %+v", wres)
	}
	dst, _ = restoreTo(t, f, "after-writer", RestoreOptions{})
	testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
}
