package gc

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/agentstate/agentstate/internal/engine"
	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// liveUnion is the union of the segment lists of every manifest in st.
func liveUnion(t testing.TB, st store.Store) map[string]bool {
	t.Helper()
	live := map[string]bool{}
	for _, k := range keys(t, st, "manifests/") {
		lineage, seq, ok := parseManifestKey(k)
		if !ok {
			continue
		}
		m, err := manifest.Load(context.Background(), st, lineage, seq)
		if err != nil {
			t.Fatalf("load %s: %v", k, err)
		}
		for _, s := range m.Segments {
			live[segments.Key(s)] = true
		}
	}
	return live
}

// requireNoDeadSegments: every segment in st is listed by a manifest, and
// every listed segment exists.
func requireNoDeadSegments(t testing.TB, st store.Store) {
	t.Helper()
	live := liveUnion(t, st)
	have := map[string]bool{}
	for _, k := range keys(t, st, "segments/") {
		have[k] = true
		if !live[k] {
			t.Errorf("dead segment %s was not collected", k)
		}
	}
	for k := range live {
		if !have[k] {
			t.Errorf("segment %s is listed by a manifest but missing", k)
		}
	}
}

// requireComplete: every manifest in st lists only segments that exist.
// GC keeps this true at every moment, for retired manifests too, until
// they are deleted themselves.
func requireComplete(t testing.TB, st store.Store) {
	t.Helper()
	ctx := context.Background()
	for _, k := range keys(t, st, "manifests/") {
		lineage, seq, ok := parseManifestKey(k)
		if !ok {
			continue
		}
		m, err := manifest.Load(ctx, st, lineage, seq)
		if err != nil {
			t.Fatalf("load %s: %v", k, err)
		}
		for _, s := range m.Segments {
			if !exists(t, st, segments.Key(s)) {
				t.Fatalf("manifest %s lists %s, which is gone", k, segments.Key(s))
			}
		}
	}
}

// writer changes a tree and checkpoints it, remembering what each
// committed sequence held.
type writer struct {
	t       testing.TB
	e       *engine.Engine
	lineage string
	dir     string
	rng     *mrand.Rand
	mu      sync.Mutex
	snaps   map[uint64]map[string]testutil.Node
}

func newWriter(t testing.TB, st store.Store, lineage string, seed uint64) *writer {
	root := t.TempDir()
	e, err := engine.New(st, engine.Options{StateDir: filepath.Join(root, "state")})
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{t: t, e: e, lineage: lineage, dir: filepath.Join(root, "tree"),
		rng: mrand.New(mrand.NewPCG(seed, 1)), snaps: map[uint64]map[string]testutil.Node{}}
	if err := os.MkdirAll(filepath.Join(w.dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	return w
}

// change rewrites one file with fresh random content (so old chunks die),
// appends to a log and sometimes deletes a file.
func (w *writer) change() error {
	name := filepath.Join(w.dir, fmt.Sprintf("f%d", w.rng.IntN(4)))
	if w.rng.IntN(2) == 0 {
		name = filepath.Join(w.dir, "sub", fmt.Sprintf("g%d", w.rng.IntN(3)))
	}
	b := make([]byte, 1+w.rng.IntN(64<<10))
	_, _ = rand.Read(b)
	if err := os.WriteFile(name, b, 0o644); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(w.dir, "log.jsonl"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(f, "{\"n\":%d}\n", w.rng.Int())
	f.Close()
	if w.rng.IntN(4) == 0 {
		_ = os.Remove(filepath.Join(w.dir, fmt.Sprintf("f%d", w.rng.IntN(4))))
	}
	return nil
}

func (w *writer) checkpoint(ctx context.Context) error {
	if err := w.change(); err != nil {
		return err
	}
	res, err := w.e.Checkpoint(ctx, engine.CheckpointOptions{Lineage: w.lineage, Dir: w.dir})
	if err != nil {
		return err
	}
	if res.Committed {
		w.mu.Lock()
		w.snaps[res.Seq] = testutil.Snapshot(w.t, w.dir)
		w.mu.Unlock()
	}
	return nil
}

// verifyRetained restores and verifies every manifest of the writer's
// lineage still in the store, and compares it to what was checkpointed.
func (w *writer) verifyRetained(t testing.TB, st store.Store) int {
	t.Helper()
	ctx := context.Background()
	seqs, err := manifest.Sequences(ctx, st, w.lineage)
	if err != nil {
		t.Fatal(err)
	}
	if len(seqs) == 0 {
		t.Fatalf("lineage %s has no manifest left", w.lineage)
	}
	e, err := engine.New(st, engine.Options{StateDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	for _, seq := range seqs {
		if _, err := e.Verify(ctx, w.lineage, seq); err != nil {
			t.Fatalf("verify %s seq %d: %v", w.lineage, seq, err)
		}
		dst := filepath.Join(t.TempDir(), "restore")
		res, err := e.Restore(ctx, engine.RestoreOptions{Lineage: w.lineage, Dir: dst, Seq: seq})
		if err != nil || len(res.Failed) > 0 {
			t.Fatalf("restore %s seq %d: %v %+v", w.lineage, seq, err, res)
		}
		w.mu.Lock()
		want, ok := w.snaps[seq]
		w.mu.Unlock()
		if ok {
			testutil.CompareTrees(t, want, testutil.Snapshot(t, dst))
		}
	}
	return len(seqs)
}

// TestCollectWithEngine: real checkpoints of two lineages, then mark, then
// (a grace period later on the store's clock) sweep. What is retained
// restores; nothing dead is left.
func TestCollectWithEngine(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	ws := []*writer{newWriter(t, st, "claude", 1), newWriter(t, st, "codex", 2)}
	for range 6 {
		for _, w := range ws {
			if err := w.checkpoint(ctx); err != nil {
				t.Fatal(err)
			}
		}
		st.Advance(time.Minute)
	}
	segsBefore := len(keys(t, st, "segments/"))

	opts := testOptions()
	rep := mustRun(t, st, opts)
	if rep.Lineages != 2 || rep.Manifests != 12 || rep.ManifestsRetained != 4 || rep.ManifestsRetired != 8 {
		t.Fatalf("scan: %+v", rep)
	}
	if rep.ManifestsMarked != 8 || rep.SegmentsMarked == 0 || rep.KeysSwept != 0 || rep.TombstonesWritten < 2 {
		t.Fatalf("first run should only mark: %+v", rep)
	}
	if n := len(keys(t, st, "segments/")); n != segsBefore {
		t.Fatalf("the mark deleted segments: %d -> %d", segsBefore, n)
	}

	// Within the grace period nothing is swept.
	st.Advance(30 * time.Minute)
	rep = mustRun(t, st, opts)
	if rep.KeysSwept != 0 || rep.TombstonesPending == 0 || rep.MarkSkipped == "" || rep.ManifestsMarked != 0 {
		t.Fatalf("run within the grace period: %+v", rep)
	}

	st.Advance(time.Hour)
	rep = mustRun(t, st, opts)
	if rep.ManifestsSwept != 8 || rep.SegmentsSwept == 0 || rep.BytesReclaimed == 0 || rep.TombstonesSwept < 2 {
		t.Fatalf("sweep: %+v", rep)
	}
	if rep.SegmentsMarked != 0 || rep.ManifestsMarked != 0 {
		t.Fatalf("nothing should be left to mark: %+v", rep)
	}
	if got := keys(t, st, TombstonePrefix); len(got) != 0 {
		t.Fatalf("tombstones left: %v", got)
	}
	requireNoDeadSegments(t, st)
	for _, w := range ws {
		if n := w.verifyRetained(t, st); n != 2 {
			t.Fatalf("%s: %d manifests retained, want 2", w.lineage, n)
		}
	}
	// The newest is still the newest: the writers carry on.
	for _, w := range ws {
		if err := w.checkpoint(ctx); err != nil {
			t.Fatalf("checkpoint after gc: %v", err)
		}
		w.verifyRetained(t, st)
	}
}

// TestSweepKeepsSegmentListedByLaterManifest: a segment marked dead and
// then listed again by a manifest committed after the tombstone survives
// the sweep, while what stayed dead goes.
func TestSweepKeepsSegmentListedByLaterManifest(t *testing.T) {
	st := newClockStore(t)
	s1, s2, s3, s4 := putSegment(t, st, 100), putSegment(t, st, 200), putSegment(t, st, 300), putSegment(t, st, 400)
	commit(t, st, "a", 1, s1)
	commit(t, st, "a", 2, s2)
	commit(t, st, "a", 3, s3)
	opts := testOptions()
	opts.Policy = Policy{KeepLast: 1}
	rep := mustRun(t, st, opts)
	if rep.SegmentsMarked != 3 || rep.ManifestsMarked != 2 { // s1, s2, s4; manifests 1, 2
		t.Fatalf("mark: %+v", rep)
	}
	// A writer references s1 again (say, a restored old checkpoint) and
	// commits after the mark.
	commit(t, st, "a", 4, s3, s1)
	st.Advance(2 * time.Hour)
	rep = mustRun(t, st, opts)
	if !exists(t, st, segments.Key(s1)) {
		t.Fatal("the sweep deleted a segment a manifest committed after the tombstone lists")
	}
	if exists(t, st, segments.Key(s2)) || exists(t, st, segments.Key(s4)) {
		t.Fatal("dead segments survived the sweep")
	}
	if rep.KeptReferenced != 1 || rep.SegmentsSwept != 2 || rep.ManifestsSwept != 2 {
		t.Fatalf("sweep: %+v", rep)
	}
	if exists(t, st, manifest.Key("a", 1)) || exists(t, st, manifest.Key("a", 2)) || !exists(t, st, manifest.Key("a", 3)) {
		t.Fatal("wrong manifests deleted")
	}
}

// TestSweepKeepsSegmentListedDuringRun: a manifest committed while the
// sweep runs (after its live set was computed, before the delete) still
// protects what it lists: the live set is refreshed before every delete.
func TestSweepKeepsSegmentListedDuringRun(t *testing.T) {
	st := newClockStore(t)
	s1, s2 := putSegment(t, st, 100), putSegment(t, st, 200)
	commit(t, st, "a", 1, s1)
	commit(t, st, "a", 2, s2)
	opts := testOptions()
	opts.Policy = Policy{KeepLast: 1}
	mustRun(t, st, opts) // marks manifest 1 and s1
	st.Advance(2 * time.Hour)
	var once sync.Once
	st.beforeStat = func(key string) {
		if key == segments.Key(s1) { // the sweep is checking s1's age right now
			once.Do(func() { commit(t, st, "a", 3, s1, s2) })
		}
	}
	rep := mustRun(t, st, opts)
	if !exists(t, st, segments.Key(s1)) {
		t.Fatal("the sweep deleted a segment listed by a manifest committed during the run")
	}
	if rep.ManifestsDuringRun != 1 || rep.KeptReferenced != 1 {
		t.Fatalf("sweep: %+v", rep)
	}
}

// TestRetiredManifestStaysComplete: a segment marked while its checkpoint
// was in flight, then listed by a manifest that is retired by the time the
// tombstone is due, is kept while that manifest exists, and goes with it.
func TestRetiredManifestStaysComplete(t *testing.T) {
	st := newClockStore(t)
	base := putSegment(t, st, 10)
	commit(t, st, "a", 1, base)
	opts := testOptions() // keep the last 2
	inflight := putSegment(t, st, 20)
	if rep := mustRun(t, st, opts); rep.SegmentsMarked != 1 {
		t.Fatalf("mark: %+v", rep)
	}
	st.Advance(time.Minute)
	commit(t, st, "a", 2, base, inflight) // the checkpoint commits
	commit(t, st, "a", 3, base)
	commit(t, st, "a", 4, base) // now 2 is retired, but not marked yet
	st.Advance(2 * time.Hour)
	rep := mustRun(t, st, opts)
	if !exists(t, st, segments.Key(inflight)) || rep.KeptReferenced != 1 || rep.ManifestsMarked != 2 || rep.SegmentsMarked != 1 {
		t.Fatalf("sweep deleted a segment of an existing retired manifest, or did not mark: exists %v %+v", exists(t, st, segments.Key(inflight)), rep)
	}
	requireComplete(t, st)
	st.Advance(2 * time.Hour)
	rep = mustRun(t, st, opts)
	if exists(t, st, segments.Key(inflight)) || exists(t, st, manifest.Key("a", 2)) || rep.ManifestsSwept != 2 || rep.SegmentsSwept != 1 {
		t.Fatalf("manifest and segment should go together: %+v", rep)
	}
	requireComplete(t, st)
	requireNoDeadSegments(t, st)
}

// TestFreshSegmentSurvives: a segment of a checkpoint that has not
// committed yet is never deleted: it is young when first marked, and a
// segment uploaded again after a delete is young again.
func TestFreshSegmentSurvives(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	base := putSegment(t, st, 50)
	commit(t, st, "a", 1, base)
	opts := testOptions()

	// An in-flight checkpoint has uploaded a segment but not committed.
	inflight := putSegment(t, st, 100)
	rep := mustRun(t, st, opts)
	if rep.SegmentsMarked != 1 {
		t.Fatalf("mark: %+v", rep)
	}
	st.Advance(50 * time.Minute)
	mustRun(t, st, opts)
	if !exists(t, st, segments.Key(inflight)) {
		t.Fatal("an uncommitted segment was deleted within the grace period")
	}
	// It commits; the sweep due now keeps it.
	commit(t, st, "a", 2, base, inflight)
	st.Advance(time.Hour)
	rep = mustRun(t, st, opts)
	if !exists(t, st, segments.Key(inflight)) || rep.KeptReferenced != 1 {
		t.Fatalf("committed segment: exists %v, %+v", exists(t, st, segments.Key(inflight)), rep)
	}

	// A dead segment is marked; a sweep deletes it but is killed before it
	// deletes the tombstone; a checkpoint uploads the same content again
	// (a fresh object under the same content-addressed key).
	commit(t, st, "a", 3, base)
	opts.Policy = Policy{KeepLast: 1}
	st.Advance(time.Minute)
	rep = mustRun(t, st, opts) // marks manifests 1, 2 and the segment inflight
	if rep.SegmentsMarked != 1 {
		t.Fatalf("mark: %+v", rep)
	}
	st.Advance(2 * time.Hour)
	// Simulate: the killed sweep deleted it ...
	if err := st.Delete(ctx, []string{segments.Key(inflight)}); err != nil {
		t.Fatal(err)
	}
	// ... and a checkpoint in flight uploaded it again just now.
	if _, err := st.Put(ctx, segments.Key(inflight), bytes.NewReader([]byte("x")), 1, store.PutOptions{CreateOnly: true}); err != nil {
		t.Fatal(err)
	}
	rep = mustRun(t, st, opts)
	if !exists(t, st, segments.Key(inflight)) {
		t.Fatal("a segment uploaded again within the grace period was deleted")
	}
	if rep.KeptYoung != 1 || rep.SegmentsSwept != 0 || rep.ManifestsSwept != 2 {
		t.Fatalf("sweep: %+v", rep)
	}
	// The checkpoint never commits: after another grace period it goes.
	st.Advance(2 * time.Hour)
	mustRun(t, st, opts)
	if exists(t, st, segments.Key(inflight)) {
		t.Fatal("a segment dead for longer than the grace period survived")
	}
	requireNoDeadSegments(t, st)
}

// TestDryRun: a dry run leaves the store byte for byte as it was (same
// keys, same ETags, same times) and predicts exactly what the real run
// then does.
func TestDryRun(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	w := newWriter(t, st, "a", 3)
	for range 5 {
		if err := w.checkpoint(ctx); err != nil {
			t.Fatal(err)
		}
	}
	opts := testOptions()
	opts.Policy = Policy{KeepLast: 1}
	mustRun(t, st, opts) // tombstones to sweep
	for range 3 {
		if err := w.checkpoint(ctx); err != nil { // more to mark
			t.Fatal(err)
		}
	}
	st.Advance(2 * time.Hour)

	dry := opts
	dry.DryRun = true
	dry.Now = st.Now
	before := etags(t, st)
	drep := mustRun(t, st, dry)
	if after := etags(t, st); !maps_equal(before, after) {
		t.Fatalf("dry run changed the store:\nbefore %v\nafter  %v", before, after)
	}
	if drep.Requests.Puts != 0 || drep.Requests.Deletes != 0 || drep.Clock != "local" {
		t.Fatalf("dry run wrote: %+v", drep.Requests)
	}
	rep := mustRun(t, st, opts)
	type summary struct{ ms, ss, bytes, mm, sm, tw, ts int64 }
	sum := func(r *Report) summary {
		return summary{int64(r.ManifestsSwept), int64(r.SegmentsSwept), r.BytesReclaimed, int64(r.ManifestsMarked),
			int64(r.SegmentsMarked), int64(r.TombstonesWritten), int64(r.TombstonesSwept)}
	}
	if sum(drep) != sum(rep) || rep.SegmentsSwept == 0 || rep.SegmentsMarked == 0 {
		t.Fatalf("dry run predicted %+v, the run did %+v", sum(drep), sum(rep))
	}
}

func maps_equal(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestManyDeadSegments: dead segments are streamed into tombstones of at
// most Batch keys and swept in bulk deletes, a tombstone at a time.
func TestManyDeadSegments(t *testing.T) {
	st := newClockStore(t)
	live := putSegment(t, st, 10)
	commit(t, st, "a", 1, live)
	const dead = 2500
	for range dead {
		putSegment(t, st, 10)
	}
	opts := testOptions()
	opts.Batch = 1000
	rep := mustRun(t, st, opts)
	if rep.SegmentsMarked != dead || rep.TombstonesWritten != 3 || rep.BytesMarked != dead*10 {
		t.Fatalf("mark: %+v", rep)
	}
	// Each tombstone records how much listing its span costs (the dead
	// keys and the one live key that may sit among them).
	r := &run{st: store.NewCounting(st)}
	for _, k := range keys(t, st, TombstonePrefix) {
		tk, _ := parseTombstoneKey(k)
		if tk.Kind != KindSegments {
			continue
		}
		tb, err := r.getTombstone(context.Background(), tk)
		if err != nil {
			t.Fatal(err)
		}
		if n := tb.header.Listed - int64(tb.header.Count); n < 0 || n > 1 {
			t.Fatalf("%s: %d entries over %d listed keys", k, tb.header.Count, tb.header.Listed)
		}
	}
	st.Advance(2 * time.Hour)
	rep = mustRun(t, st, opts)
	if rep.SegmentsSwept != dead || rep.BytesReclaimed != dead*10 || rep.TombstonesSwept != 3 {
		t.Fatalf("sweep: %+v", rep)
	}
	// One delete request per tombstone's batch of <= 1000 keys, one per
	// tombstone; HEADs for the few candidates per prefix, no more.
	if rep.Requests.Deletes != 6 || rep.Requests.Heads > dead+2 {
		t.Fatalf("requests: %+v", rep.Requests)
	}
	requireNoDeadSegments(t, st)
}

// TestSweepListsCrowdedPrefix: many candidates under one segments/<xx>/
// prefix are checked with one listing, not one HEAD each.
func TestSweepListsCrowdedPrefix(t *testing.T) {
	st := newClockStore(t)
	live := putSegment(t, st, 10)
	commit(t, st, "a", 1, live)
	ctx := context.Background()
	n := 0
	for n < 20 {
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		id := segments.Sum(b)
		if id[0] != 0x42 {
			continue
		}
		if _, err := st.Put(ctx, segments.Key(id), bytes.NewReader(b), 16, store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		n++
	}
	opts := testOptions()
	mustRun(t, st, opts)
	st.Advance(2 * time.Hour)
	rep := mustRun(t, st, opts)
	if rep.SegmentsSwept != 20 {
		t.Fatalf("sweep: %+v", rep)
	}
	if rep.Requests.Heads > 2 { // the lease: its look before the takeover of the released one, and the read-back
		t.Fatalf("crowded prefix checked with HEADs: %+v", rep.Requests)
	}
}

// TestDamagedManifestStopsDeletes: GC cannot know what a damaged retained
// manifest needs, so it deletes nothing and says so.
func TestDamagedManifestStopsDeletes(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	s1, s2 := putSegment(t, st, 10), putSegment(t, st, 10)
	putSegment(t, st, 10) // dead
	commit(t, st, "a", 1, s1)
	commit(t, st, "a", 2, s2)
	opts := testOptions()
	opts.Policy = Policy{KeepLast: 1}
	mustRun(t, st, opts)
	st.Advance(2 * time.Hour)
	junk := []byte("garbage")
	if _, err := st.Put(ctx, manifest.Key("a", 2), bytes.NewReader(junk), int64(len(junk)), store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	before := keys(t, st, "")
	_, err := Run(ctx, st, opts)
	if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), manifest.Key("a", 2)) {
		t.Fatalf("gc with a damaged manifest: %v", err)
	}
	if after := keys(t, st, ""); !slices.Equal(before, after) {
		t.Fatalf("gc changed the store despite a damaged manifest:\n%v\n%v", before, after)
	}
}

// TestForget: preview writes nothing; apply writes a manifest tombstone;
// the next sweep after the grace period deletes those manifests even
// though the GC policy alone would keep them, and the newest never.
func TestForget(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	var segs []segments.ID
	for i := range 6 {
		s := putSegment(t, st, 10)
		segs = append(segs, s)
		commit(t, st, "a", uint64(i+1), s)
		st.Advance(time.Minute)
	}
	commit(t, st, "b", 1, segs[0])
	p := Policy{KeepLast: 2}
	before := etags(t, st)
	prev, err := Forget(ctx, st, ForgetOptions{Lineage: "a", Policy: p, Now: st.Now})
	if err != nil {
		t.Fatal(err)
	}
	if prev.Applied || prev.Retained != 2 || prev.Retired != 4 || prev.Marked != 4 || len(prev.Decisions) != 6 || prev.Decisions[0].Seq != 6 {
		t.Fatalf("preview: %+v", prev)
	}
	if !maps_equal(before, etags(t, st)) || prev.Requests.Puts != 0 {
		t.Fatal("forget without --apply changed the store")
	}
	app, err := Forget(ctx, st, ForgetOptions{Lineage: "a", Policy: p, Apply: true})
	if err != nil {
		t.Fatal(err)
	}
	if !app.Applied || app.Marked != 4 || len(app.Tombstones) != 1 || !strings.HasSuffix(app.Tombstones[0], ".forget-manifests") {
		t.Fatalf("apply: %+v", app)
	}
	again, err := Forget(ctx, st, ForgetOptions{Lineage: "a", Policy: p, Apply: true})
	if err != nil || again.Marked != 0 || len(again.Tombstones) != 0 || !again.Decisions[5].Marked {
		t.Fatalf("forget again marks nothing new: %+v %v", again, err)
	}
	// The default GC policy keeps all six (they are minutes old), but the
	// forgotten four are retired: their segments are marked now ...
	opts := testOptions()
	opts.Policy = DefaultPolicy()
	rep := mustRun(t, st, opts)
	if rep.ManifestsRetired != 4 || rep.ManifestsMarked != 0 || rep.SegmentsMarked != 3 { // segs[0] is b's
		t.Fatalf("gc after forget: %+v", rep)
	}
	// ... and everything goes after the grace period.
	st.Advance(2 * time.Hour)
	rep = mustRun(t, st, opts)
	if rep.ManifestsSwept != 4 || rep.SegmentsSwept != 3 {
		t.Fatalf("sweep after forget: %+v", rep)
	}
	if got := keys(t, st, "manifests/a/"); !slices.Equal(got, []string{manifest.Key("a", 5), manifest.Key("a", 6)}) {
		t.Fatalf("lineage a holds %v", got)
	}
	requireNoDeadSegments(t, st)

	// forget with every rule off still keeps the newest.
	last, err := Forget(ctx, st, ForgetOptions{Lineage: "a", Apply: true})
	if err != nil || last.Retained != 1 || last.Marked != 1 {
		t.Fatalf("forget all: %+v %v", last, err)
	}
	if _, err := Forget(ctx, st, ForgetOptions{Lineage: "nope"}); err == nil {
		t.Fatal("forget of an empty lineage: no error")
	}
}

// TestUnknownObjectsUntouched: GC deletes only keys in its own formats.
func TestUnknownObjectsUntouched(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	s := putSegment(t, st, 10)
	commit(t, st, "a", 1, s)
	foreign := []string{"config", "segments/zz/not-a-segment", "segments/" + s.String(), "manifests/a/42",
		"manifests/a/00000000000000000000", "tombstones/not-ours", "other/thing", "locks/clock-nothex"}
	for _, k := range foreign {
		if _, err := st.Put(ctx, k, bytes.NewReader([]byte("x")), 1, store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	opts := testOptions()
	opts.Policy = Policy{}
	for range 3 {
		st.Advance(3 * time.Hour)
		rep := mustRun(t, st, opts)
		if rep.Unknown < 5 {
			t.Fatalf("unknown objects not counted: %+v", rep)
		}
	}
	for _, k := range foreign {
		if !exists(t, st, k) {
			t.Fatalf("gc deleted %s", k)
		}
	}
	if !exists(t, st, segments.Key(s)) || !exists(t, st, manifest.Key("a", 1)) {
		t.Fatal("gc deleted live data")
	}
}

// TestStaleClockProbeRemoved: a probe left by a killed process goes.
func TestStaleClockProbeRemoved(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	probe := clockProbePrefix + "0123456789abcdef"
	if _, err := st.Put(ctx, probe, bytes.NewReader([]byte("x")), 1, store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	mustRun(t, st, testOptions())
	if !exists(t, st, probe) {
		t.Fatal("fresh probe removed")
	}
	st.Advance(2 * time.Hour)
	mustRun(t, st, testOptions())
	if exists(t, st, probe) {
		t.Fatal("stale probe kept")
	}
}

// TestConcurrentWritersAndGC: checkpoint loops of three lineages run while
// GC runs over and over, the store's clock moving 10 minutes per GC (less
// than the grace period, as a checkpoint takes less than the grace
// period). Every retained manifest restores and verifies, and space is
// reclaimed.
func TestConcurrentWritersAndGC(t *testing.T) {
	st := newClockStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ws := []*writer{newWriter(t, st, "w1", 11), newWriter(t, st, "w2", 12), newWriter(t, st, "w3", 13)}
	var wg sync.WaitGroup
	var commits atomic.Int64
	errc := make(chan error, len(ws))
	for _, w := range ws {
		wg.Go(func() {
			for ctx.Err() == nil {
				if err := w.checkpoint(ctx); err != nil {
					if ctx.Err() == nil {
						errc <- fmt.Errorf("%s: %w", w.lineage, err)
					}
					return
				}
				commits.Add(1)
			}
		})
	}
	opts := testOptions()
	opts.Policy = Policy{KeepLast: 2, KeepHourly: 2}
	var swept int
	var reclaimed int64
	for range 40 {
		rep := mustRun(t, st, opts)
		swept += rep.SegmentsSwept
		reclaimed += rep.BytesReclaimed
		// Writers only add manifests and segments, so this holds even
		// while they run.
		requireComplete(t, st)
		st.Advance(10 * time.Minute)
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if swept == 0 || reclaimed == 0 {
		t.Fatalf("no space reclaimed in 40 runs (%d commits)", commits.Load())
	}
	for _, w := range ws {
		w.verifyRetained(t, st)
	}
	// Two more runs a grace period apart finish the job.
	opts.Policy = Policy{KeepLast: 2}
	st.Advance(2 * time.Hour)
	mustRun(t, st, opts)
	st.Advance(2 * time.Hour)
	mustRun(t, st, opts)
	requireNoDeadSegments(t, st)
	for _, w := range ws {
		if n := w.verifyRetained(t, st); n != 2 {
			t.Fatalf("%s: %d manifests left, want 2", w.lineage, n)
		}
	}
	t.Logf("%d commits, %d segments swept, %d bytes reclaimed during the loop", commits.Load(), swept, reclaimed)
}

// TestSweepFollowsCurrentPolicy: GC's own marks are re-checked against the
// policy when swept: after a change to keep more, what the new policy
// keeps stays, with its segments.
func TestSweepFollowsCurrentPolicy(t *testing.T) {
	st := newClockStore(t)
	s1, s2, s3 := putSegment(t, st, 10), putSegment(t, st, 10), putSegment(t, st, 10)
	commit(t, st, "a", 1, s1)
	commit(t, st, "a", 2, s2)
	commit(t, st, "a", 3, s3)
	opts := testOptions()
	opts.Policy = Policy{KeepLast: 1}
	if rep := mustRun(t, st, opts); rep.ManifestsMarked != 2 || rep.SegmentsMarked != 2 {
		t.Fatalf("mark: %+v", rep)
	}
	st.Advance(2 * time.Hour)
	opts.Policy = Policy{KeepLast: 2}
	rep := mustRun(t, st, opts)
	if rep.ManifestsSwept != 1 || rep.SegmentsSwept != 1 || !exists(t, st, manifest.Key("a", 2)) || !exists(t, st, segments.Key(s2)) {
		t.Fatalf("sweep after keeping more: %+v", rep)
	}
	requireComplete(t, st)
	requireNoDeadSegments(t, st)
}
