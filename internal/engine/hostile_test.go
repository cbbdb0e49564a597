package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// rawEntry is a tree entry written without validation, as an attacker who
// controls the bucket could.
type rawEntry struct {
	Name    string         `json:"name"`
	Type    string         `json:"type"`
	Mode    uint32         `json:"mode"`
	MTime   int64          `json:"mtime"`
	Size    int64          `json:"size,omitempty"`
	Content []segments.Ref `json:"content,omitempty"`
	Tree    *segments.Ref  `json:"tree,omitempty"`
	Target  string         `json:"target,omitempty"`
}

// commitHostile stores one file's content and a two-level tree whose inner
// entry is named name, then commits a manifest for it, bypassing every
// encoder-side check.
func commitHostile(t testing.TB, st store.Store, seq uint64, outerName, innerName string) {
	t.Helper()
	ctx := context.Background()
	codec, err := segments.NewCodec()
	if err != nil {
		t.Fatal(err)
	}
	put := func(kind segments.Kind, plains ...[]byte) (segments.ID, []segments.Ref) {
		b := segments.NewBuilder(kind)
		var refs []segments.Ref
		for _, p := range plains {
			id, rec := codec.Encode(p)
			off, n := b.Add(id, rec, int64(len(p)))
			refs = append(refs, segments.Ref{Blob: id, Offset: off, Length: n, Size: int64(len(p))})
		}
		seg, data := b.Seal()
		if _, err := st.Put(ctx, segments.Key(seg), bytes.NewReader(data), int64(len(data)), store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		for i := range refs {
			refs[i].Segment = seg
		}
		return seg, refs
	}
	content := []byte("pwned\n")
	dseg, drefs := put(segments.KindData, content)
	inner, _ := json.Marshal(map[string]any{"v": 1, "entries": []rawEntry{
		{Name: innerName, Type: "f", Mode: 0o644, MTime: 1, Size: int64(len(content)), Content: drefs}}})
	iseg, irefs := put(segments.KindTree, inner)
	outer, _ := json.Marshal(map[string]any{"v": 1, "entries": []rawEntry{
		{Name: outerName, Type: "d", Mode: 0o755, MTime: 1, Tree: &irefs[0]}}})
	oseg, orefs := put(segments.KindTree, outer)
	m := &manifest.Manifest{Version: manifest.Version, Lineage: "test", Seq: seq, Parent: seq - 1,
		Time: time.Now().UTC(), Writer: "attacker", Root: orefs[0],
		Segments: manifest.SortSegments([]segments.ID{dseg, iseg, oseg})}
	if err := manifest.Commit(ctx, st, m); err != nil {
		t.Fatal(err)
	}
}

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
			commitHostile(t, f.st, 1, tc.outer, tc.inner)
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
	commitHostile(t, f.st, 1, "sub", "x") // a valid manifest: sub/x
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
		commitHostile(t, st, 1, outer, inner)
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
