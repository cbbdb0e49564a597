package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
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
