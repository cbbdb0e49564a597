// Package testutil builds and compares directory trees for agentstate's
// tests: the engine's unit tests and the integration tests share it.
package testutil

import (
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"
)

// TreeSpec describes a generated tree.
type TreeSpec struct {
	Seed       uint64
	SmallFiles int   // spread over nested directories, 0-4 KiB each
	LargeFile  int64 // one pseudo-random (incompressible) file of this size, 0 for none
}

// GenTree writes a tree with nested dirs, empty files, symlinks, 0600/0755
// modes and nanosecond mtimes under dir.
func GenTree(t testing.TB, dir string, spec TreeSpec) {
	t.Helper()
	rng := rand.New(rand.NewPCG(spec.Seed, 99))
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(dir, "empty-dir"), 0o755))
	must(os.MkdirAll(filepath.Join(dir, "deep/a/b/c/d"), 0o750))
	must(os.WriteFile(filepath.Join(dir, "empty-file"), nil, 0o644))
	must(os.WriteFile(filepath.Join(dir, "secret.json"), []byte(`{"token":"x"}`), 0o600))
	must(os.WriteFile(filepath.Join(dir, "run.sh"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "deep/a/b/c/d/leaf.txt"), []byte("leaf\n"), 0o640))
	must(os.Symlink("deep/a/b/c/d/leaf.txt", filepath.Join(dir, "link-to-leaf")))
	must(os.Symlink("/etc/passwd", filepath.Join(dir, "absolute-link")))
	must(os.Symlink("missing-target", filepath.Join(dir, "dangling-link")))
	for i := range spec.SmallFiles {
		sub := filepath.Join(dir, "small", fmt.Sprintf("d%02d", i%50), fmt.Sprintf("e%d", i%7))
		must(os.MkdirAll(sub, 0o755))
		b := make([]byte, rng.IntN(4096))
		for j := range b {
			b[j] = byte('a' + rng.IntN(26))
		}
		must(os.WriteFile(filepath.Join(sub, fmt.Sprintf("f%05d.txt", i)), b, 0o644))
	}
	if spec.LargeFile > 0 {
		f, err := os.Create(filepath.Join(dir, "large.bin"))
		must(err)
		_, err = io.CopyN(f, RandReader(spec.Seed), spec.LargeFile)
		must(err)
		must(f.Close())
	}
	// Give every path a distinct nanosecond mtime, deepest first so that
	// setting a file's time does not disturb its directory's afterwards.
	var paths []string
	must(filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if p != dir && d.Type()&fs.ModeSymlink == 0 {
			paths = append(paths, p)
		}
		return err
	}))
	sort.Sort(sort.Reverse(sort.StringSlice(paths)))
	for i, p := range paths {
		mt := time.Unix(1_700_000_000+int64(i), int64(rng.IntN(1e9)))
		must(os.Chtimes(p, mt, mt))
	}
}

// RandReader is a fast deterministic stream of incompressible bytes.
func RandReader(seed uint64) io.Reader {
	return &randReader{rng: rand.New(rand.NewPCG(seed, 7))}
}

type randReader struct{ rng *rand.Rand }

func (r *randReader) Read(p []byte) (int, error) {
	for i := 0; i < len(p); i += 8 {
		v := r.rng.Uint64()
		for j := 0; j < 8 && i+j < len(p); j++ {
			p[i+j] = byte(v >> (8 * j))
		}
	}
	return len(p), nil
}

// Node is what CompareTrees checks of one path.
type Node struct {
	Mode   fs.FileMode
	MTime  int64
	Size   int64
	Target string
	Hash   [32]byte
}

// Snapshot records every path under dir, with content hashed.
func Snapshot(t testing.TB, dir string) map[string]Node {
	t.Helper()
	out := map[string]Node{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		n := Node{Mode: fi.Mode(), MTime: fi.ModTime().UnixNano()}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			n.Target, err = os.Readlink(p)
			n.MTime = 0 // compared separately where it matters
		case fi.Mode().IsRegular():
			n.Size = fi.Size()
			n.Hash, err = HashFile(p)
		}
		out[rel] = n
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// CompareTrees fails the test with every difference between two snapshots.
func CompareTrees(t testing.TB, want, got map[string]Node) {
	t.Helper()
	var diffs []string
	for p, w := range want {
		g, ok := got[p]
		switch {
		case !ok:
			diffs = append(diffs, "missing "+p)
		case g != w:
			diffs = append(diffs, fmt.Sprintf("%s: want %+v, got %+v", p, w, g))
		}
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			diffs = append(diffs, "unexpected "+p)
		}
	}
	sort.Strings(diffs)
	if len(diffs) > 0 {
		if len(diffs) > 20 {
			diffs = append(diffs[:20], fmt.Sprintf("... and %d more", len(diffs)-20))
		}
		t.Fatalf("trees differ:\n%s", bytes.Join(toBytes(diffs), []byte("\n")))
	}
}

func toBytes(s []string) [][]byte {
	out := make([][]byte, len(s))
	for i := range s {
		out[i] = []byte(s[i])
	}
	return out
}
