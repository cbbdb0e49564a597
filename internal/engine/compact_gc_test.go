package engine

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/internal/gc"
	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
)

// idleLineage commits 24 checkpoints of one new small file each, with a
// writer that does not compact: a fragmented newest checkpoint.
func idleLineage(t *testing.T, f *fixture) (*Engine, string) {
	t.Helper()
	writer, err := New(f.st, Options{StateDir: f.state, CompactAt: -1})
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(f.root, "src")
	os.MkdirAll(filepath.Join(src, "d"), 0o700)
	for i := range 24 {
		os.WriteFile(filepath.Join(src, "d", fmt.Sprintf("f%02d", i)), []byte(strings.Repeat(fmt.Sprint(i), 50)), 0o600)
		f.checkpoint(writer, src)
	}
	return writer, src
}

func compactNewest(t *testing.T, f *fixture) *CheckpointResult {
	t.Helper()
	seqs, _ := manifest.Sequences(context.Background(), f.st, "test")
	res, err := f.engine(filepath.Join(f.root, "gc-state")).CompactStored(context.Background(), "test", seqs[0])
	if err != nil {
		t.Fatalf("compact stored: %v", err)
	}
	return res
}

// GC keeps the checkpoint a compaction re-packed while the compaction is
// the newest, even under a policy that keeps only the newest: the writer
// builds on it when it comes back, and its rebased commit must find every
// segment it reuses (a review found them swept).
func TestRebasedWriterSurvivesGC(t *testing.T) {
	f := newFixture(t)
	_, src := idleLineage(t, f)
	if res := compactNewest(t, f); !res.Committed {
		t.Fatalf("no compaction: %+v", res)
	}
	opts := gc.Options{Policy: gc.Policy{KeepLast: 1}, Grace: time.Millisecond, CompactIdle: -1}
	for range 3 {
		time.Sleep(2100 * time.Millisecond) // past the grace period and the store's 1 s resolution
		if _, err := gc.Run(context.Background(), f.st, opts); err != nil {
			t.Fatal(err)
		}
	}
	back, err := New(f.st, Options{StateDir: f.state}) // the writer, with compaction on
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(src, "d", "f00"), []byte("changed"), 0o600)
	os.Remove(filepath.Join(src, "d", "f05"))
	res := f.checkpoint(back, src)
	if _, err := f.engine(filepath.Join(f.root, "verify")).Verify(context.Background(), "test", res.Seq); err != nil {
		t.Fatalf("the rebased writer's checkpoint: %v", err)
	}
	dst, _ := restoreTo(t, f, "r", RestoreOptions{})
	testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
	if got := deletedPaths(t, back); !slices.Equal(got, []string{"d/f05"}) {
		t.Fatalf("deleted paths %v, want d/f05", got)
	}
}

// A writer rebases along a chain: two compactions while it was away, and
// a crash after a rebased commit (its index still on the old base).
func TestRebaseFollowsTheChain(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	// Small segments: a backlog larger than one compaction's budget.
	cfg, _ := manifest.NewConfig(64<<10, 256<<10, 1<<20, 1<<20, time.Now())
	if _, err := manifest.InitConfig(ctx, f.st, cfg); err != nil {
		t.Fatal(err)
	}
	writer, err := New(f.st, Options{StateDir: f.state, CompactAt: -1})
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(f.root, "src")
	os.MkdirAll(src, 0o700)
	for i := range 24 {
		b := make([]byte, 400<<10)
		rand.Read(b)
		os.WriteFile(filepath.Join(src, fmt.Sprintf("f%02d", i)), b, 0o600)
		f.checkpoint(writer, src)
	}
	compacted := 0
	for range 3 {
		if compactNewest(t, f).Committed {
			compacted++
		}
	}
	if compacted < 2 {
		t.Fatalf("%d compactions, want 2 or more for this test", compacted)
	}
	d, _ := writer.state.lineageDir("test")
	saved, _ := os.ReadFile(filepath.Join(d, "index.json"))
	os.WriteFile(filepath.Join(src, "f00"), []byte("changed"), 0o600)
	f.checkpoint(writer, src)                                  // rebased past both
	os.WriteFile(filepath.Join(d, "index.json"), saved, 0o600) // as if it crashed before saving
	os.WriteFile(filepath.Join(src, "f01"), []byte("changed too"), 0o600)
	res := f.checkpoint(writer, src)
	if _, err := writer.Verify(ctx, "test", res.Seq); err != nil {
		t.Fatal(err)
	}
	dst, _ := restoreTo(t, f, "r", RestoreOptions{})
	testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
}
