package manifest

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

func ref(seg byte) segments.Ref {
	var s segments.ID
	s[0] = seg
	return segments.Ref{Blob: segments.Sum([]byte{seg}), Segment: s, Offset: 4, Length: 20, Size: 10}
}

func validTree() Tree {
	r := ref(1)
	return Tree{Version: TreeVersion, Entries: []Entry{
		{Name: "a.txt", Type: TypeFile, Mode: 0o644, MTime: 1, Size: 10, Content: []segments.Ref{ref(1)}},
		{Name: "dir", Type: TypeDir, Mode: 0o755, MTime: 2, Tree: &r},
		{Name: "link", Type: TypeSymlink, Mode: 0o777, MTime: 3, Target: "../outside/is/fine/as/text"},
	}}
}

func TestTreeValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Tree)
		ok     bool
	}{
		{"valid", func(*Tree) {}, true},
		{"dotdot name", func(t *Tree) { t.Entries[0].Name = ".." }, false},
		{"dot name", func(t *Tree) { t.Entries[0].Name = "." }, false},
		{"slash in name", func(t *Tree) { t.Entries[0].Name = "x/../../etc" }, false},
		{"absolute name", func(t *Tree) { t.Entries[0].Name = "/etc" }, false},
		{"NUL in name", func(t *Tree) { t.Entries[0].Name = "a\x00b" }, false},
		{"empty name", func(t *Tree) { t.Entries[0].Name = "" }, false},
		{"unsorted", func(t *Tree) { t.Entries[0].Name = "zzz" }, false},
		{"duplicate", func(t *Tree) { t.Entries[1].Name = "a.txt" }, false},
		{"size mismatch", func(t *Tree) { t.Entries[0].Size = 11 }, false},
		{"file with tree", func(t *Tree) { r := ref(2); t.Entries[0].Tree = &r }, false},
		{"dir without tree", func(t *Tree) { t.Entries[1].Tree = nil }, false},
		{"symlink without target", func(t *Tree) { t.Entries[2].Target = "" }, false},
		{"symlink NUL target", func(t *Tree) { t.Entries[2].Target = "a\x00" }, false},
		{"unknown type", func(t *Tree) { t.Entries[0].Type = "p" }, false},
		{"mode type bits", func(t *Tree) { t.Entries[0].Mode = 0o100644 }, false},
		{"negative offset", func(t *Tree) { t.Entries[0].Content[0].Offset = -1 }, false},
		{"bad version", func(t *Tree) { t.Version = 2 }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := validTree()
			tr.Entries[0].Content = []segments.Ref{ref(1)}
			tc.mutate(&tr)
			err := tr.Validate()
			if (err == nil) != tc.ok {
				t.Fatalf("Validate() = %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
		})
	}
}

func TestTreeEncodingIsDeterministic(t *testing.T) {
	a, err := EncodeTree(validTree())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := EncodeTree(validTree())
	if !bytes.Equal(a, b) {
		t.Fatal("same tree encoded differently")
	}
	got, err := DecodeTree(a)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := EncodeTree(got)
	if !bytes.Equal(a, c) {
		t.Fatal("decode/encode does not round-trip")
	}
}

func TestDecodeTreeStrict(t *testing.T) {
	good, _ := EncodeTree(validTree())
	for name, b := range map[string][]byte{
		"unknown field": bytes.Replace(good, []byte(`"v":1`), []byte(`"v":1,"x":2`), 1),
		"trailing data": append(append([]byte{}, good...), []byte(` {}`)...),
		"not json":      []byte("garbage"),
	} {
		if _, err := DecodeTree(b); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: DecodeTree err = %v, want ErrInvalid", name, err)
		}
	}
}

func validManifest() *Manifest {
	r := ref(7)
	return &Manifest{Version: Version, Lineage: "claude", Seq: 3, Parent: 2,
		Time: time.Unix(1700000000, 5).UTC(), Writer: "host/abc", Root: r,
		Totals: Totals{Files: 1, Bytes: 10}, Segments: []segments.ID{r.Segment}}
}

func TestManifestRoundTripAndTamper(t *testing.T) {
	b, err := Encode(validManifest())
	if err != nil {
		t.Fatal(err)
	}
	m, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	if m.Seq != 3 || m.Lineage != "claude" || !m.Time.Equal(validManifest().Time) {
		t.Fatalf("decoded %+v", m)
	}
	for i := range b {
		c := append([]byte{}, b...)
		c[i] ^= 0x20
		if _, err := Decode(c); err == nil {
			t.Fatalf("flipping byte %d went undetected", i)
		}
	}
	if _, err := Decode(b[:len(b)-1]); err == nil {
		t.Fatal("truncated manifest accepted")
	}
}

func TestManifestValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Manifest)
	}{
		{"seq zero", func(m *Manifest) { m.Seq = 0 }},
		{"parent not before", func(m *Manifest) { m.Parent = 3 }},
		{"lineage with slash", func(m *Manifest) { m.Lineage = "a/../b" }},
		{"lineage dotdot", func(m *Manifest) { m.Lineage = ".." }},
		{"root segment unlisted", func(m *Manifest) { m.Segments = nil }},
		{"unsorted segments", func(m *Manifest) {
			m.Segments = []segments.ID{m.Root.Segment, {}}
		}},
		{"negative totals", func(m *Manifest) { m.Totals.Bytes = -1 }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := validManifest()
			tc.mutate(m)
			if err := m.Validate(); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate() = %v, want ErrInvalid", err)
			}
		})
	}
}

func TestKeys(t *testing.T) {
	k := Key("codex", 42)
	if k != "manifests/codex/00000000000000000042" {
		t.Fatal(k)
	}
	if seq, ok := ParseKey("codex", k); !ok || seq != 42 {
		t.Fatal(seq, ok)
	}
	for _, bad := range []string{"manifests/codex/42", "manifests/codex/0000000000000000004x", "manifests/other/00000000000000000042", "manifests/codex/00000000000000000000"} {
		if _, ok := ParseKey("codex", bad); ok {
			t.Errorf("ParseKey accepted %q", bad)
		}
	}
}

func TestCommitProtocol(t *testing.T) {
	ctx := context.Background()
	st, err := store.OpenDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	m := validManifest()
	if err := Commit(ctx, st, m); err != nil {
		t.Fatal(err)
	}
	// Our own PUT retried after a lost response finds identical bytes: fine.
	if err := Commit(ctx, st, m); err != nil {
		t.Fatalf("identical re-commit: %v", err)
	}
	other := validManifest()
	other.Writer = "elsewhere/def"
	err = Commit(ctx, st, other)
	if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), `writer "host/abc"`) {
		t.Fatalf("conflicting commit: %v", err)
	}
	got, err := Load(ctx, st, "claude", 3)
	if err != nil || got.Writer != "host/abc" {
		t.Fatalf("Load = %+v, %v: the first commit must stand", got, err)
	}
	seqs, err := Sequences(ctx, st, "claude")
	if err != nil || len(seqs) != 1 || seqs[0] != 3 {
		t.Fatalf("Sequences = %v, %v", seqs, err)
	}
}

func TestConcurrentCommitsExactlyOneWins(t *testing.T) {
	ctx := context.Background()
	st, err := store.OpenDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	const n = 8
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := validManifest()
			m.Writer = "w" + string(rune('a'+i))
			errs[i] = Commit(ctx, st, m)
		}()
	}
	wg.Wait()
	wins := 0
	for _, err := range errs {
		switch {
		case err == nil:
			wins++
		case !errors.Is(err, ErrConflict):
			t.Fatalf("unexpected error %v", err)
		}
	}
	if wins != 1 {
		t.Fatalf("%d commits won, want exactly 1", wins)
	}
}

func FuzzDecodeTree(f *testing.F) {
	good, _ := EncodeTree(validTree())
	f.Add(good)
	f.Add([]byte(`{"v":1,"entries":[{"name":"..","type":"f","mode":0,"mtime":0}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		tr, err := DecodeTree(b)
		if err != nil {
			return
		}
		for _, e := range tr.Entries {
			if ValidName(e.Name) != nil {
				t.Fatalf("decoded unsafe name %q", e.Name)
			}
		}
		if _, err := EncodeTree(tr); err != nil {
			t.Fatalf("decoded tree does not re-encode: %v", err)
		}
	})
}

func FuzzDecodeManifest(f *testing.F) {
	good, _ := Encode(validManifest())
	f.Add(good)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("Decode returned an invalid manifest: %v", err)
		}
		if ValidLineage(m.Lineage) != nil {
			t.Fatalf("unsafe lineage %q", m.Lineage)
		}
	})
}
