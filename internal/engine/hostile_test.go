package engine

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/store"
)

func TestRestoreRefusesHostileNames(t *testing.T) {
	tests := []struct{ outer, inner string }{
		{"sub", "../x"},
		{"sub", "../../x"},
		{"sub", "/etc/x"},
		{"sub", ".."},
		{"..", "x"},
		{"/tmp", "x"},
		{"sub", "a\x00b"},
		{"sub/../..", "x"},
	}
	for _, tc := range tests {
		t.Run(tc.outer+"|"+tc.inner, func(t *testing.T) {
			f := newFixture(t)
			testutil.CommitHostile(t, f.st, 1, tc.outer, tc.inner)
			target := filepath.Join(f.root, "deep", "target")
			_, err := f.e.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: target})
			if !errors.Is(err, ErrNoValidManifest) {
				t.Fatalf("restore of a hostile manifest: err = %v, want ErrNoValidManifest", err)
			}
			assertNothingOutside(t, f.root, target)
			if ents, _ := os.ReadDir(target); len(ents) != 0 {
				t.Fatalf("a rejected manifest left %d entries in the target", len(ents))
			}
		})
	}
}

func TestRestoreRefusesPathThroughLocalSymlink(t *testing.T) {
	f := newFixture(t)
	testutil.CommitHostile(t, f.st, 1, "sub", "x") // a valid manifest: sub/x
	target := filepath.Join(f.root, "target")
	outside := filepath.Join(f.root, "outside")
	os.MkdirAll(target, 0o700)
	os.MkdirAll(outside, 0o700)
	if err := os.Symlink(outside, filepath.Join(target, "sub")); err != nil {
		t.Fatal(err)
	}
	res, err := f.e.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: target})
	if !errors.Is(err, ErrIncomplete) || len(res.Failed) != 2 {
		t.Fatalf("restore through a symlink: err = %v, result %+v; want ErrIncomplete naming sub and sub/x", err, res)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Fatalf("restore wrote through a symlink: %v", ents)
	}
}

// assertNothingOutside fails if the hostile content landed anywhere under
// root but inside target, or at the absolute paths the names aim at.
func assertNothingOutside(t testing.TB, root, target string) {
	t.Helper()
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if rel, _ := filepath.Rel(target, p); !filepath.IsLocal(rel) {
			if b, _ := os.ReadFile(p); bytes.Equal(b, []byte("pwned\n")) {
				t.Errorf("hostile content written outside the target at %s", p)
			}
		}
		return nil
	})
	for _, p := range []string{"/x", "/etc/x", "/tmp/x"} {
		if b, err := os.ReadFile(p); err == nil && bytes.Equal(b, []byte("pwned\n")) {
			t.Errorf("hostile content written at %s", p)
		}
	}
}

// FuzzRestoreNames restores manifests with arbitrary names and checks the
// one property that matters: no byte lands outside the target.
func FuzzRestoreNames(f *testing.F) {
	for _, s := range []string{"../x", "/x", "..", ".", "a/b", "ok", "\x00", "../../../../../../tmp/x"} {
		f.Add("sub", s)
		f.Add(s, "x")
	}
	f.Fuzz(func(t *testing.T, outer, inner string) {
		root := t.TempDir()
		st, err := store.OpenDir(filepath.Join(root, "store"))
		if err != nil {
			t.Fatal(err)
		}
		testutil.CommitHostile(t, st, 1, outer, inner)
		e, err := New(st, Options{StateDir: filepath.Join(root, "state")})
		if err != nil {
			t.Fatal(err)
		}
		target := filepath.Join(root, "a", "b", "target")
		_, err = e.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: target})
		if err == nil {
			// Accepted names must be plain components: the file is inside.
			if manifest.ValidName(outer) != nil || manifest.ValidName(inner) != nil {
				t.Fatalf("restore accepted names %q / %q", outer, inner)
			}
			if b, err := os.ReadFile(filepath.Join(target, outer, inner)); err != nil || string(b) != "pwned\n" {
				t.Fatalf("valid restore did not write %q/%q", outer, inner)
			}
			return
		}
		assertNothingOutside(t, root, target)
	})
}
