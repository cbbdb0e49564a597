package integration

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
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

// objects lists every key in the store with its ETag.
func objects(t testing.TB, st store.Store) map[string]string {
	t.Helper()
	out := map[string]string{}
	for o, err := range st.List(context.Background(), "") {
		if err != nil {
			t.Fatal(err)
		}
		out[o.Key] = o.ETag
	}
	return out
}

func newKeys(before, after map[string]string) []string {
	var keys []string
	for k := range after {
		if _, ok := before[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys
}

// TestLargeTreeRoundTrip: nested dirs, empty files, symlinks, 0600/0755
// modes, a 300 MiB file and 5,000 small files, through MinIO and back;
// then an unchanged checkpoint writes nothing and a 1 KiB append little.
func TestLargeTreeRoundTrip(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	src := filepath.Join(t.TempDir(), "src")
	large := int64(300 << 20)
	if testing.Short() {
		large = 16 << 20
	}
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 42, SmallFiles: 5000, LargeFile: large})
	want := testutil.Snapshot(t, src)

	c := newCLI(t, storeURL, env)
	first := c.checkpoint("big", src)
	if !first.Committed || first.Seq != 1 || first.Files < 5000 {
		t.Fatalf("first checkpoint: %+v", first)
	}

	dst := filepath.Join(t.TempDir(), "dst")
	rc := newCLI(t, storeURL, env) // another machine: no local state
	rres := rc.restore("big", dst)
	if rres.Seq != 1 || len(rres.Failed) != 0 {
		t.Fatalf("restore: %+v", rres)
	}
	diffTrees(t, src, dst)
	testutil.CompareTrees(t, want, testutil.Snapshot(t, dst)) // modes and mtimes too

	before := objects(t, st)
	again := c.checkpoint("big", src)
	if again.Committed {
		t.Fatalf("unchanged tree committed: %+v", again)
	}
	if added := newKeys(before, objects(t, st)); len(added) != 0 {
		t.Fatalf("unchanged checkpoint wrote %v", added)
	}

	f, err := os.OpenFile(filepath.Join(src, "small/d13/e6/f00013.txt"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(bytes.Repeat([]byte("y"), 1024))
	f.Close()
	app := c.checkpoint("big", src)
	after := objects(t, st)
	added := newKeys(before, after)
	var addedBytes int64
	for _, k := range added {
		info, err := st.Stat(context.Background(), k)
		if err != nil {
			t.Fatal(err)
		}
		addedBytes += info.Size
	}
	t.Logf("1 KiB append: %d new objects, %d bytes, %d requests", len(added), addedBytes, app.Requests)
	if !app.Committed || len(added) > 3 || addedBytes > 64<<10 {
		t.Fatalf("1 KiB append: %+v wrote %d objects (%v), %d bytes; want ≤ 3 objects, ≤ 64 KiB", app, len(added), added, addedBytes)
	}
}

// TestSIGKILLDuringCheckpoint kills `agentstate checkpoint` at random
// moments of its upload, many times: restore must always give exactly the
// previous or the new tree, never a mix.
func TestSIGKILLDuringCheckpoint(t *testing.T) {
	storeURL, env := newBucket(t)
	src := filepath.Join(t.TempDir(), "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 1, SmallFiles: 200})
	c := newCLI(t, storeURL, env)
	c.checkpoint("kill", src)
	committed := testutil.Snapshot(t, src)
	rng := rand.New(rand.NewPCG(7, 7))
	iterations := 16
	if testing.Short() {
		iterations = 4
	}
	kills, completions := 0, 0
	for i := range iterations {
		// A new version: one large file rewritten, one small file edited,
		// one added, one removed, so a mix would be visible.
		writeRandom(t, filepath.Join(src, "blob.bin"), uint64(100+i), 24<<20)
		os.WriteFile(filepath.Join(src, "small/d01/e1/f00001.txt"), []byte(strings.Repeat("v", i+1)), 0o644)
		os.WriteFile(filepath.Join(src, "added-"+string(rune('a'+i))), []byte{byte(i)}, 0o600)
		os.Remove(filepath.Join(src, "added-"+string(rune('a'+i-1))))
		next := testutil.Snapshot(t, src)

		cmd := c.command(context.Background(), "checkpoint", "--lineage", "kill", "--dir", src)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(rng.IntN(400)) * time.Millisecond)
		_ = cmd.Process.Signal(syscall.SIGKILL)
		if err := waitTimeout(cmd, time.Minute); err != nil && !strings.Contains(err.Error(), "killed") {
			completions++
		} else if err == nil {
			completions++
		} else {
			kills++
		}

		dst := filepath.Join(t.TempDir(), "dst")
		newCLI(t, storeURL, env).restore("kill", dst)
		got := testutil.Snapshot(t, dst)
		switch {
		case equalTrees(got, next):
			committed = next
		case equalTrees(got, committed):
		default:
			t.Fatalf("iteration %d: restored tree is neither the previous nor the new one", i)
		}
	}
	t.Logf("%d checkpoints killed mid-way, %d finished before the kill", kills, completions)
	// The killed writer's state is still usable: the next checkpoint works.
	res := c.checkpoint("kill", src)
	dst := filepath.Join(t.TempDir(), "final")
	newCLI(t, storeURL, env).restore("kill", dst)
	testutil.CompareTrees(t, testutil.Snapshot(t, src), testutil.Snapshot(t, dst))
	if kills == 0 {
		t.Fatalf("no checkpoint was killed mid-way (last %+v): the test proved nothing", res)
	}
}

func equalTrees(a, b map[string]testutil.Node) bool {
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

func writeRandom(t testing.TB, p string, seed uint64, n int64) {
	t.Helper()
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(f, testutil.RandReader(seed), n); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestHostileManifestIsRefused: names like ../x or /etc/x, and paths
// through a symlink, never write outside the target, whatever the bucket says.
func TestHostileManifestIsRefused(t *testing.T) {
	for _, tc := range []struct{ outer, inner string }{{"sub", "../x"}, {"sub", "/etc/x"}, {"..", "x"}} {
		t.Run(tc.inner, func(t *testing.T) {
			storeURL, env := newBucket(t)
			testutil.CommitHostile(t, openS3(t, storeURL), 1, tc.outer, tc.inner)
			root := t.TempDir()
			target := filepath.Join(root, "a", "target")
			_, errOut, code := newCLI(t, storeURL, env).run("restore", "--lineage", "test", "--dir", target)
			if code != 5 || !strings.Contains(errOut, "no manifest of the lineage verifies") {
				t.Fatalf("restore of a hostile manifest: exit %d, %s; want 5", code, errOut)
			}
			assertNoHostileFile(t, root)
		})
	}
	t.Run("through a symlink", func(t *testing.T) {
		storeURL, env := newBucket(t)
		testutil.CommitHostile(t, openS3(t, storeURL), 1, "sub", "x")
		root := t.TempDir()
		target, outside := filepath.Join(root, "target"), filepath.Join(root, "outside")
		os.MkdirAll(target, 0o700)
		os.MkdirAll(outside, 0o700)
		os.Symlink(outside, filepath.Join(target, "sub"))
		_, errOut, code := newCLI(t, storeURL, env).run("restore", "--lineage", "test", "--dir", target)
		if code != 4 || !strings.Contains(errOut, "sub/x") {
			t.Fatalf("restore through a symlink: exit %d, %s; want 4 naming sub/x", code, errOut)
		}
		assertNoHostileFile(t, root)
	})
}

func assertNoHostileFile(t testing.TB, root string) {
	t.Helper()
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if b, _ := os.ReadFile(p); string(b) == testutil.HostileContent {
				t.Errorf("hostile content written at %s", p)
			}
		}
		return nil
	})
	for _, p := range []string{"/x", "/etc/x"} {
		if b, err := os.ReadFile(p); err == nil && string(b) == testutil.HostileContent {
			t.Errorf("hostile content written at %s", p)
		}
	}
}

// TestFlippedSegmentByteFallsBack: one flipped byte anywhere in a segment
// the newest manifest needs is detected at restore, and the older manifest
// is restored instead.
func TestFlippedSegmentByteFallsBack(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	src := filepath.Join(t.TempDir(), "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 3, SmallFiles: 100, LargeFile: 3 << 20})
	c := newCLI(t, storeURL, env)
	c.checkpoint("flip", src)
	old := testutil.Snapshot(t, src)
	writeRandom(t, filepath.Join(src, "large.bin"), 77, 3<<20)
	os.WriteFile(filepath.Join(src, "small/d02/e2/new.txt"), []byte("seq 2 only"), 0o644)
	if res := c.checkpoint("flip", src); res.Seq != 2 {
		t.Fatal(res)
	}
	ctx := context.Background()
	m1, err := manifest.Load(ctx, st, "flip", 1)
	if err != nil {
		t.Fatal(err)
	}
	m2, err := manifest.Load(ctx, st, "flip", 2)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(5, 5))
	for _, seg := range m2.Segments {
		if m1.HasSegment(seg) {
			continue
		}
		key := segments.Key(seg)
		orig := getAll(t, st, key)
		for _, pos := range []int{0, rng.IntN(len(orig)), len(orig) - 30, len(orig) - 1} {
			bad := bytes.Clone(orig)
			bad[pos] ^= 0x04
			putRaw(t, st, key, bad)
			dst := filepath.Join(t.TempDir(), "dst")
			res := newCLI(t, storeURL, env).restore("flip", dst)
			if res.Seq != 1 || len(res.Rejected) != 1 {
				t.Fatalf("segment %s byte %d flipped: restored %+v, want seq 1 after rejecting seq 2", seg, pos, res)
			}
			testutil.CompareTrees(t, old, testutil.Snapshot(t, dst))
		}
		putRaw(t, st, key, orig)
	}
	_, _, code := c.run("verify", "--lineage", "flip")
	if code != 0 {
		t.Fatalf("verify after repairing: exit %d", code)
	}
}

func getAll(t testing.TB, st store.Store, key string) []byte {
	t.Helper()
	rc, err := st.Get(context.Background(), key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// putRaw overwrites an object, as bit rot or an attacker would.
func putRaw(t testing.TB, st store.Store, key string, b []byte) {
	t.Helper()
	if _, err := st.Put(context.Background(), key, bytes.NewReader(b), int64(len(b)), store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentCheckpointsOneWins: two writers (two containers' state
// directories) checkpoint one lineage at the same moment from the same
// base: exactly one commits, the other exits 3 and commits nothing.
func TestConcurrentCheckpointsOneWins(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	src := filepath.Join(t.TempDir(), "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 9, SmallFiles: 50})
	a := newCLI(t, storeURL, env)
	a.checkpoint("race", src)
	for round := range 3 {
		b := newCLI(t, storeURL, env)
		cloneState(t, a.state, b.state) // same base, another writer id
		os.WriteFile(filepath.Join(src, "round"), []byte{byte(round)}, 0o644)
		type result struct {
			code   int
			stderr string
		}
		results := make(chan result, 2)
		for _, w := range []*cli{a, b} {
			go func() {
				_, e, code := w.run("checkpoint", "--lineage", "race", "--dir", src)
				results <- result{code, e}
			}()
		}
		r1, r2 := <-results, <-results
		codes := []int{r1.code, r2.code}
		slices.Sort(codes)
		if !slices.Equal(codes, []int{0, 3}) {
			t.Fatalf("round %d: exit codes %v, want one 0 and one 3\n%s\n%s", round, codes, r1.stderr, r2.stderr)
		}
		loser := r1
		if r1.code == 0 {
			loser = r2
		}
		if !strings.Contains(loser.stderr, "concurrent writer") {
			t.Fatalf("round %d: loser said %q", round, loser.stderr)
		}
		seqs, err := manifest.Sequences(context.Background(), st, "race")
		if err != nil || seqs[0] != uint64(round+2) || len(seqs) != round+2 {
			t.Fatalf("round %d: sequences %v, %v: exactly one commit per round", round, seqs, err)
		}
		// Whoever won, carry on from the newest state for the next round
		// (a new state directory: the tree is declared the truth).
		a = newCLI(t, storeURL, env)
		var out checkpointOut
		a.mustJSON(&out, "checkpoint", "--lineage", "race", "--dir", src, "--authoritative")
	}
}

// cloneState copies a state directory and gives the copy its own writer id.
func cloneState(t testing.TB, from, to string) {
	t.Helper()
	err := filepath.WalkDir(from, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(from, p)
		dst := filepath.Join(to, rel)
		if d.IsDir() {
			return os.MkdirAll(dst, 0o700)
		}
		if d.Name() == "lock" {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(dst, b, 0o600)
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(to, "writer-id"), []byte("clone/"+filepath.Base(to)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}
