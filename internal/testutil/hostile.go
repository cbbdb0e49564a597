package testutil

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// HostileContent is the content of the file a hostile manifest places.
const HostileContent = "pwned\n"

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

// CommitHostile stores one file's content and a two-level tree whose inner
// entry is named name, then commits a manifest for it, bypassing every
// encoder-side check.
func CommitHostile(t testing.TB, st store.Store, seq uint64, outerName, innerName string) {
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
	content := []byte(HostileContent)
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
