package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// The GC tests run every agentstate command as its own process, against
// MinIO, with a 2 s grace period (MinIO's LastModified has one-second
// resolution, and GC adds a second of slack to every age).
const gcGrace = 2 * time.Second

// gcDue is how long to wait for what GC marked to be due.
const gcDue = gcGrace + 2500*time.Millisecond

// gcReport is the part of `agentstate gc --json` the tests read.
type gcReport struct {
	DryRun            bool   `json:"dry_run"`
	Clock             string `json:"clock"`
	Manifests         int    `json:"manifests"`
	ManifestsRetained int    `json:"manifests_retained"`
	ManifestsRetired  int    `json:"manifests_retired"`
	TombstonesDue     int    `json:"tombstones_due"`
	TombstonesPending int    `json:"tombstones_pending"`
	TombstonesSwept   int    `json:"tombstones_swept"`
	ManifestsSwept    int    `json:"manifests_swept"`
	SegmentsSwept     int    `json:"segments_swept"`
	BytesReclaimed    int64  `json:"bytes_reclaimed"`
	KeptReferenced    int    `json:"kept_referenced"`
	KeptYoung         int    `json:"kept_young"`
	MarkSkipped       string `json:"mark_skipped"`
	ManifestsMarked   int    `json:"manifests_marked"`
	SegmentsMarked    int    `json:"segments_marked"`
	TombstonesWritten int    `json:"tombstones_written"`
	LineagesCompacted int    `json:"lineages_compacted"`
	SegmentsCompacted int    `json:"segments_compacted"`
	Requests          struct {
		Total   int64 `json:"total"`
		Puts    int64 `json:"puts"`
		Deletes int64 `json:"deletes"`
	} `json:"requests"`
}

// gcPolicy: keep the last 2 manifests of each lineage, no time rules.
var gcPolicy = []string{"--keep-last", "2", "--keep-hourly", "0", "--keep-daily", "0"}

func (c *cli) gc(extra ...string) gcReport {
	c.t.Helper()
	var r gcReport
	args := append(append([]string{"gc", "--grace", gcGrace.String(), "--lease-ttl", "3s"}, gcPolicy...), extra...)
	c.mustJSON(&r, args...)
	return r
}

// gcTree is one lineage's working tree, changed before every checkpoint,
// with what each committed sequence held.
type gcTree struct {
	t       testing.TB
	c       *cli
	lineage string
	dir     string
	rng     *mrand.Rand
	mu      sync.Mutex
	snaps   map[uint64]map[string]testutil.Node
	last    uint64
	// compacted counts the segments the writer's compactions retired.
	compacted int
}

func newGCTree(t testing.TB, storeURL string, env []string, lineage string, seed uint64) *gcTree {
	dir := filepath.Join(t.TempDir(), lineage)
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	return &gcTree{t: t, c: newCLI(t, storeURL, env), lineage: lineage, dir: dir,
		rng: mrand.New(mrand.NewPCG(seed, 7)), snaps: map[uint64]map[string]testutil.Node{}}
}

// change rewrites a file with fresh random content (its old chunks die),
// appends to a transcript and sometimes deletes a file.
func (g *gcTree) change() {
	name := filepath.Join(g.dir, fmt.Sprintf("f%d.bin", g.rng.IntN(3)))
	if g.rng.IntN(2) == 0 {
		name = filepath.Join(g.dir, "sub", fmt.Sprintf("g%d.bin", g.rng.IntN(3)))
	}
	b := make([]byte, 1+g.rng.IntN(96<<10))
	_, _ = rand.Read(b)
	if err := os.WriteFile(name, b, 0o644); err != nil {
		g.t.Error(err)
	}
	f, err := os.OpenFile(filepath.Join(g.dir, "transcript.jsonl"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err == nil {
		fmt.Fprintf(f, "{\"turn\":%d}\n", g.rng.Int())
		f.Close()
	}
	if g.rng.IntN(4) == 0 {
		_ = os.Remove(filepath.Join(g.dir, fmt.Sprintf("f%d.bin", g.rng.IntN(3))))
	}
}

// checkpoint changes the tree and checkpoints it in a separate process.
func (g *gcTree) checkpoint() {
	g.t.Helper()
	g.change()
	out := g.c.checkpoint(g.lineage, g.dir)
	if out.Committed {
		snap := testutil.Snapshot(g.t, g.dir)
		g.mu.Lock()
		g.snaps[out.Seq], g.last = snap, out.Seq
		g.compacted += out.SegmentsCompacted
		g.mu.Unlock()
	}
}

// verifyAll restores and verifies every manifest of the lineage that is in
// the store (from another machine: a fresh state directory), and compares
// each with what was checkpointed. It returns how many there were.
func (g *gcTree) verifyAll(t testing.TB, st store.Store, storeURL string, env []string) int {
	t.Helper()
	seqs, err := manifest.Sequences(context.Background(), st, g.lineage)
	if err != nil {
		t.Fatal(err)
	}
	rc := newCLI(t, storeURL, env)
	for _, seq := range seqs {
		s := fmt.Sprint(seq)
		if _, errOut, code := rc.run("verify", "--lineage", g.lineage, "--seq", s); code != 0 {
			t.Fatalf("verify %s seq %d: exit %d\n%s", g.lineage, seq, code, errOut)
		}
		dst := filepath.Join(t.TempDir(), "restore")
		var res restoreOut
		rc.mustJSON(&res, "restore", "--lineage", g.lineage, "--dir", dst, "--seq", s)
		if res.Seq != seq || len(res.Failed) > 0 {
			t.Fatalf("restore %s seq %d: %+v", g.lineage, seq, res)
		}
		g.mu.Lock()
		want, ok := g.snaps[seq]
		g.mu.Unlock()
		if !ok {
			t.Fatalf("%s: seq %d is in the store but was never committed by the test", g.lineage, seq)
		}
		testutil.CompareTrees(t, want, testutil.Snapshot(t, dst))
	}
	return len(seqs)
}

// gcCheckComplete fails if a manifest that exists lists a segment that does
// not: GC keeps every existing manifest complete until it deletes the
// manifest itself (manifests go before their segments). It is safe to run
// while GC and checkpoints run: a missing segment counts only if its
// manifest still exists after the segment was found missing.
func gcCheckComplete(t testing.TB, st store.Store) {
	t.Helper()
	ctx := context.Background()
	for obj, err := range st.List(ctx, "manifests/") {
		if err != nil {
			t.Fatal(err)
		}
		lineage, rest, _ := strings.Cut(strings.TrimPrefix(obj.Key, "manifests/"), "/")
		seq, ok := manifest.ParseKey(lineage, obj.Key)
		if !ok || rest == "" {
			continue
		}
		m, err := manifest.Load(ctx, st, lineage, seq)
		if errors.Is(err, store.ErrNotFound) {
			continue // swept since the listing
		}
		if err != nil {
			t.Fatalf("load %s: %v", obj.Key, err)
		}
		for _, s := range m.Segments {
			if _, err := st.Stat(ctx, segments.Key(s)); errors.Is(err, store.ErrNotFound) {
				if _, err := st.Stat(ctx, obj.Key); err == nil {
					t.Fatalf("manifest %s exists but its segment %s is gone", obj.Key, segments.Key(s))
				}
			} else if err != nil {
				t.Fatal(err)
			}
		}
	}
}

// gcRequireClean: no tombstone left, and the segments in the bucket are
// exactly those the remaining manifests list.
func gcRequireClean(t testing.TB, st store.Store) {
	t.Helper()
	ctx := context.Background()
	live := map[string]bool{}
	for obj, err := range st.List(ctx, "manifests/") {
		if err != nil {
			t.Fatal(err)
		}
		lineage, _, _ := strings.Cut(strings.TrimPrefix(obj.Key, "manifests/"), "/")
		seq, _ := manifest.ParseKey(lineage, obj.Key)
		m, err := manifest.Load(ctx, st, lineage, seq)
		if err != nil {
			t.Fatalf("load %s: %v", obj.Key, err)
		}
		for _, s := range m.Segments {
			live[segments.Key(s)] = true
		}
	}
	var dead []string
	have := map[string]bool{}
	for obj, err := range st.List(ctx, "segments/") {
		if err != nil {
			t.Fatal(err)
		}
		have[obj.Key] = true
		if !live[obj.Key] {
			dead = append(dead, obj.Key)
		}
	}
	if len(dead) > 0 {
		t.Fatalf("%d dead segments left, e.g. %s", len(dead), dead[0])
	}
	for k := range live {
		if !have[k] {
			t.Fatalf("listed segment %s is missing", k)
		}
	}
	for obj, err := range st.List(ctx, "tombstones/") {
		if err != nil {
			t.Fatal(err)
		}
		t.Fatalf("tombstone left: %s", obj.Key)
	}
}

// gcFinish runs GC until a run finds nothing to sweep, mark or wait for,
// waiting for marks to become due in between.
func gcFinish(t testing.TB, c *cli) (swept int, reclaimed int64) {
	t.Helper()
	for range 6 {
		r := c.gc()
		swept += r.SegmentsSwept
		reclaimed += r.BytesReclaimed
		if r.TombstonesWritten == 0 && r.TombstonesPending == 0 && r.TombstonesDue == 0 {
			return swept, reclaimed
		}
		time.Sleep(gcDue)
	}
	t.Fatal("gc did not converge in 6 runs")
	return
}

// gcObjects lists every key with its ETag, size and LastModified.
func gcObjects(t testing.TB, st store.Store) map[string]string {
	t.Helper()
	out := map[string]string{}
	for o, err := range st.List(context.Background(), "") {
		if err != nil {
			t.Fatal(err)
		}
		out[o.Key] = fmt.Sprintf("%s %d %s", o.ETag, o.Size, o.LastModified.Format(time.RFC3339Nano))
	}
	return out
}

// TestGCWithConcurrentCheckpoints: three lineages checkpoint in loops
// (every checkpoint its own process, the tree changing every time) while
// `agentstate gc --every` runs with a 2 s grace period. Every manifest GC
// left restores completely and verifies, every existing manifest stays
// complete throughout, and the space of dead segments is reclaimed.
func TestGCWithConcurrentCheckpoints(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	trees := []*gcTree{
		newGCTree(t, storeURL, env, "claude", 1),
		newGCTree(t, storeURL, env, "codex", 2),
		newGCTree(t, storeURL, env, "gemini", 3),
	}
	for _, g := range trees {
		g.checkpoint()
	}

	gcCLI := newCLI(t, storeURL, env)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	loop := gcCLI.command(ctx, append([]string{"gc", "--every", "500ms", "--grace", gcGrace.String(), "--lease-ttl", "3s", "--json"}, gcPolicy...)...)
	var loopOut, loopErr bytes.Buffer
	loop.Stdout, loop.Stderr = &loopOut, &loopErr
	if err := loop.Start(); err != nil {
		t.Fatal(err)
	}

	duration := 18 * time.Second
	if testing.Short() {
		duration = 10 * time.Second
	}
	deadline := time.Now().Add(duration)
	var wg sync.WaitGroup
	for _, g := range trees {
		wg.Go(func() {
			for time.Now().Before(deadline) && !t.Failed() {
				g.checkpoint()
			}
		})
	}
	checks := 0
	for time.Now().Before(deadline) && !t.Failed() {
		gcCheckComplete(t, st)
		checks++
		time.Sleep(time.Second)
	}
	wg.Wait()

	// SIGTERM ends the service cleanly (exit 0), releasing the lease.
	if err := loop.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := waitTimeout(loop, 20*time.Second); err != nil {
		t.Fatalf("gc --every after SIGTERM: %v\n%s", err, loopErr.String())
	}
	var runs, swept, marked int
	var reclaimed int64
	sc := bufio.NewScanner(&loopOut)
	for sc.Scan() {
		var r gcReport
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("gc --every --json line %q: %v", sc.Text(), err)
		}
		runs++
		swept += r.SegmentsSwept
		marked += r.SegmentsMarked
		reclaimed += r.BytesReclaimed
	}
	commits, compacted := 0, 0
	for _, g := range trees {
		commits += len(g.snaps)
		compacted += g.compacted
	}
	t.Logf("%d checkpoints committed, compacting %d segments; %d gc runs marked %d and swept %d segments (%s) while they ran; %d completeness checks",
		commits, compacted, runs, marked, swept, fmtBytes(reclaimed), checks)
	if compacted == 0 {
		t.Fatal("no checkpoint compacted: the test does not show compaction racing GC")
	}
	if runs < 5 || swept == 0 || reclaimed == 0 {
		t.Fatalf("gc loop: %d runs, %d segments swept, %d bytes reclaimed\n%s", runs, swept, reclaimed, loopErr.String())
	}

	// Everything GC left restores and verifies: retained manifests, and the
	// retired ones not yet deleted.
	for _, g := range trees {
		g.verifyAll(t, st, storeURL, env)
	}
	// The next runs finish the job: nothing dead is left, and each lineage
	// keeps exactly its last two checkpoints, which restore.
	gcFinish(t, gcCLI)
	gcRequireClean(t, st)
	for _, g := range trees {
		if n := g.verifyAll(t, st, storeURL, env); n != 2 {
			t.Fatalf("%s: %d manifests left, want 2", g.lineage, n)
		}
		dst := filepath.Join(t.TempDir(), "newest")
		res := newCLI(t, storeURL, env).restore(g.lineage, dst)
		if res.Seq != g.last {
			t.Fatalf("%s: newest restore is seq %d, last committed %d", g.lineage, res.Seq, g.last)
		}
	}
}

// gcLeaseHeld reports whether the GC lease is held (not released) and
// when it expires by its LastModified and TTL.
func gcLeaseHeld(t testing.TB, st store.Store) (time.Time, bool) {
	t.Helper()
	ctx := context.Background()
	info, err := st.Stat(ctx, "locks/gc")
	if errors.Is(err, store.ErrNotFound) {
		return time.Time{}, false
	}
	if err != nil {
		t.Fatal(err)
	}
	rc, err := st.Get(ctx, "locks/gc", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var body struct {
		TTL      string `json:"ttl"`
		Released bool   `json:"released"`
	}
	if err := json.NewDecoder(rc).Decode(&body); err != nil {
		t.Fatalf("lease body: %v", err)
	}
	ttl, err := time.ParseDuration(body.TTL)
	if err != nil {
		t.Fatalf("lease ttl %q", body.TTL)
	}
	return info.LastModified.Add(ttl), !body.Released
}

func fmtBytes(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// TestGCKilled: GC processes SIGKILLed at random points, again and again,
// with checkpoints in between, leave a repository where every manifest
// that exists is complete and the newest restores; the next GC takes over
// the dead one's lease after it expires and finishes cleaning.
func TestGCKilled(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	trees := []*gcTree{newGCTree(t, storeURL, env, "alpha", 11), newGCTree(t, storeURL, env, "beta", 12)}
	for range 6 {
		for _, g := range trees {
			g.checkpoint()
		}
	}
	gcCLI := newCLI(t, storeURL, env)
	gcCLI.gc() // tombstones to sweep, so kills land in sweeps too
	rng := mrand.New(mrand.NewPCG(5, 5))
	budget := time.Now().Add(45 * time.Second)
	// Kills land anywhere from process start to the end of a run: the
	// bound follows how long the last run that finished took.
	maxDelay := 250 * time.Millisecond
	kills, killedHolding, finished, held := 0, 0, 0, 0
	for killedHolding < 8 && time.Now().Before(budget) {
		for _, g := range trees {
			g.checkpoint()
		}
		cmd := gcCLI.command(context.Background(), append([]string{"gc", "--grace", gcGrace.String(), "--lease-ttl", "2s", "--json"}, gcPolicy...)...)
		var errOut bytes.Buffer
		cmd.Stderr = &errOut
		start := time.Now()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		delay := time.Duration(rng.Int64N(int64(maxDelay)))
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			switch {
			case err == nil:
				finished++
				maxDelay = max(20*time.Millisecond, time.Since(start)*9/10)
			case strings.Contains(errOut.String(), "holds the repository lease"):
				held++ // the killed one's lease: it expires 3-4 s after its last renewal
				time.Sleep(time.Second)
			default:
				t.Fatalf("gc failed: %v\n%s", err, errOut.String())
			}
			continue
		case <-time.After(delay):
		}
		_ = cmd.Process.Kill()
		<-done
		kills++
		gcCheckComplete(t, st)
		// Killed while holding the lease? Then the next GC can only take
		// it over once it has expired (2 s TTL, plus the store clock's
		// one-second resolution and GC's one second of slack).
		if expires, ok := gcLeaseHeld(t, st); ok {
			killedHolding++
			time.Sleep(time.Until(expires.Add(2500 * time.Millisecond)))
		}
	}
	t.Logf("%d gc processes killed (%d while holding the lease), %d finished first, %d found the lease held",
		kills, killedHolding, finished, held)
	if killedHolding < 5 {
		t.Fatalf("only %d kills of a GC holding the lease in the time budget", killedHolding)
	}

	// The repository restores and verifies as it is.
	gcCheckComplete(t, st)
	for _, g := range trees {
		dst := filepath.Join(t.TempDir(), "after-kills")
		res := newCLI(t, storeURL, env).restore(g.lineage, dst)
		if res.Seq != g.last || len(res.Failed) > 0 {
			t.Fatalf("%s: restore after kills: %+v (last committed %d)", g.lineage, res, g.last)
		}
		testutil.CompareTrees(t, g.snaps[g.last], testutil.Snapshot(t, dst))
	}
	// The next GC waits out a dead GC's lease (at most the TTL) and
	// finishes cleaning.
	time.Sleep(4 * time.Second)
	gcFinish(t, gcCLI)
	gcRequireClean(t, st)
	for _, g := range trees {
		if n := g.verifyAll(t, st, storeURL, env); n != 2 {
			t.Fatalf("%s: %d manifests left, want 2", g.lineage, n)
		}
	}
}

// TestGCDryRun: `gc --dry-run` leaves the bucket byte for byte unchanged
// (the same keys with the same ETags, sizes and times; not even the lease
// is written) and predicts what the real run then does.
func TestGCDryRun(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	g := newGCTree(t, storeURL, env, "claude", 21)
	for range 5 {
		g.checkpoint()
	}
	c := newCLI(t, storeURL, env)
	first := c.gc() // marks (and writes the lease)
	if first.ManifestsMarked != 3 || first.SegmentsMarked == 0 {
		t.Fatalf("first gc: %+v", first)
	}
	for range 3 {
		g.checkpoint() // more to mark, not in any tombstone
	}
	time.Sleep(gcDue + time.Second)

	before := gcObjects(t, st)
	dry := c.gc("--dry-run")
	after := gcObjects(t, st)
	if len(before) != len(after) {
		t.Fatalf("dry run changed the object list: %d -> %d objects", len(before), len(after))
	}
	for k, v := range before {
		if after[k] != v {
			t.Fatalf("dry run changed %s: %s -> %s", k, v, after[k])
		}
	}
	if !dry.DryRun || dry.Clock != "local" || dry.Requests.Puts != 0 || dry.Requests.Deletes != 0 {
		t.Fatalf("dry run report: %+v", dry)
	}
	if dry.SegmentsSwept == 0 || dry.ManifestsSwept != 3 || dry.SegmentsMarked == 0 || dry.ManifestsMarked != 3 {
		t.Fatalf("dry run predicts nothing: %+v", dry)
	}
	// The human-readable form says it is a dry run, and still changes nothing.
	out, errOut, code := c.run(append([]string{"gc", "--dry-run", "--grace", gcGrace.String()}, gcPolicy...)...)
	if code != 0 || !strings.Contains(out, "DRY RUN") || !strings.Contains(out, "would delete") {
		t.Fatalf("gc --dry-run: exit %d\n%s\n%s", code, out, errOut)
	}
	if n := len(gcObjects(t, st)); n != len(before) {
		t.Fatalf("text dry run changed the bucket")
	}

	real := c.gc()
	if real.ManifestsSwept != dry.ManifestsSwept || real.SegmentsSwept != dry.SegmentsSwept ||
		real.BytesReclaimed != dry.BytesReclaimed || real.SegmentsMarked != dry.SegmentsMarked ||
		real.ManifestsMarked != dry.ManifestsMarked {
		t.Fatalf("dry run predicted %+v\nthe run did %+v", dry, real)
	}
	gcCheckComplete(t, st)
	g.verifyAll(t, st, storeURL, env)
}

// TestGCForgetCLI: forget previews by default, writes a tombstone with
// --apply, and gc deletes the forgotten checkpoints after its grace
// period, never the newest. Usage errors exit 2.
func TestGCForgetCLI(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	g := newGCTree(t, storeURL, env, "codex", 31)
	for range 4 {
		g.checkpoint()
	}
	c := newCLI(t, storeURL, env)
	before := gcObjects(t, st)
	out, errOut, code := c.run("forget", "--lineage", "codex", "--keep-last", "1", "--keep-hourly", "0", "--keep-daily", "0")
	if code != 0 || !strings.Contains(out, "retire") || !strings.Contains(out, "preview only") {
		t.Fatalf("forget preview: exit %d\n%s\n%s", code, out, errOut)
	}
	if len(gcObjects(t, st)) != len(before) {
		t.Fatal("forget preview wrote to the bucket")
	}
	var applied struct {
		Applied    bool     `json:"applied"`
		Retired    int      `json:"retired"`
		Marked     int      `json:"marked"`
		Tombstones []string `json:"tombstones"`
	}
	c.mustJSON(&applied, "forget", "--lineage", "codex", "--keep-last", "1", "--keep-hourly", "0", "--keep-daily", "0", "--apply")
	if !applied.Applied || applied.Retired != 3 || applied.Marked != 3 || len(applied.Tombstones) != 1 {
		t.Fatalf("forget --apply: %+v", applied)
	}
	// gc's own policy would keep the last 2; the forgotten ones still go.
	c.gc()
	time.Sleep(gcDue)
	r := c.gc()
	if r.ManifestsSwept != 3 {
		t.Fatalf("gc after forget: %+v", r)
	}
	gcFinish(t, c)
	gcRequireClean(t, st)
	if n := g.verifyAll(t, st, storeURL, env); n != 1 {
		t.Fatalf("%d manifests left, want the newest only", n)
	}

	for _, args := range [][]string{
		{"gc", "--grace", "0s"},
		{"gc", "--keep-last", "-1"},
		{"gc", "--lease-ttl", "1s"},
		{"gc", "extra"},
		{"forget"},
		{"forget", "--lineage", "codex", "--keep-daily", "-2"},
	} {
		if _, errOut, code := c.run(args...); code != 2 {
			t.Fatalf("agentstate %v: exit %d, want 2\n%s", args, code, errOut)
		}
	}
	if out, _, code := c.run("gc", "--help"); code != 0 || !strings.Contains(out, "--dry-run") || !strings.Contains(out, "Examples:") {
		t.Fatalf("gc --help: exit %d\n%s", code, out)
	}
}

// TestGCCompactsIdleLineage: a lineage whose writer went away with a
// fragmented newest checkpoint is compacted by GC once it is idle past
// --compact-idle; the tree restores as it was, the writer that comes back
// commits after the compaction (no exit 3), and GC then reclaims the old
// segments.
func TestGCCompactsIdleLineage(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	c := newCLI(t, storeURL, env)
	src := t.TempDir()
	// 15 checkpoints of one new small file each: 15 small data segments
	// and a tree segment, one short of what makes the writer compact.
	for i := range 15 {
		os.WriteFile(filepath.Join(src, fmt.Sprintf("f%02d", i)), []byte(strings.Repeat(fmt.Sprint(i), 64)), 0o600)
		c.checkpoint("idle", src)
	}
	want := testutil.Snapshot(t, src)
	seqs, _ := manifest.Sequences(context.Background(), st, "idle")
	before, _ := manifest.Load(context.Background(), st, "idle", seqs[0])

	if r := c.gc("--compact-idle", "1h"); r.LineagesCompacted != 0 {
		t.Fatalf("gc compacted a lineage that is not idle: %+v", r)
	}
	time.Sleep(2500 * time.Millisecond)
	r := c.gc("--compact-idle", "2s")
	if r.LineagesCompacted != 1 || r.SegmentsCompacted < 15 {
		t.Fatalf("gc of an idle lineage: %+v", r)
	}
	seqs, _ = manifest.Sequences(context.Background(), st, "idle")
	after, _ := manifest.Load(context.Background(), st, "idle", seqs[0])
	if after.Seq != before.Seq+1 || after.Compacts != before.Seq || len(after.Segments) > 3 {
		t.Fatalf("compacted manifest: seq %d compacts %d, %d segments (was %d)", after.Seq, after.Compacts, len(after.Segments), len(before.Segments))
	}
	dst := filepath.Join(t.TempDir(), "dst")
	if res := newCLI(t, storeURL, env).restore("idle", dst); res.Seq != after.Seq {
		t.Fatalf("restore took seq %d, want the compacted %d", res.Seq, after.Seq)
	}
	testutil.CompareTrees(t, want, testutil.Snapshot(t, dst))

	// The writer comes back and commits after the compaction.
	os.WriteFile(filepath.Join(src, "f00"), []byte("changed"), 0o600)
	if out := c.checkpoint("idle", src); !out.Committed || out.Seq != after.Seq+1 {
		t.Fatalf("writer after GC's compaction: %+v", out)
	}
	gcFinish(t, c)
	gcRequireClean(t, st)
	dst = filepath.Join(t.TempDir(), "dst2")
	newCLI(t, storeURL, env).restore("idle", dst)
	testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
}
