package manifest

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"

	"github.com/agentstate/agentstate/segments"
)

// TreeKey is a directory's location-free identity: a Merkle hash of its
// entries' names, types, modes, times, sizes, link targets and content blob
// ids, with each subdirectory represented by its own TreeKey. Unlike the
// tree blob's id it does not depend on which segment anything was packed
// into, so a writer can tell that a directory is unchanged, and reuse its
// stored tree, even when its children were first stored with same-segment
// references.
func TreeKey(t *Tree, childKey func(i int) segments.ID) segments.ID {
	h := sha256.New()
	var buf [8]byte
	num := func(h hash.Hash, v uint64) {
		binary.LittleEndian.PutUint64(buf[:], v)
		h.Write(buf[:])
	}
	str := func(h hash.Hash, s string) {
		num(h, uint64(len(s)))
		h.Write([]byte(s))
	}
	num(h, uint64(len(t.Entries)))
	for i := range t.Entries {
		e := &t.Entries[i]
		str(h, e.Name)
		str(h, string(e.Type))
		num(h, uint64(e.Mode))
		num(h, uint64(e.MTime))
		num(h, uint64(e.Size))
		num(h, uint64(e.Deleted))
		str(h, e.Target)
		str(h, e.Format)
		num(h, uint64(len(e.Content)))
		for _, r := range e.Content {
			h.Write(r.Blob[:])
			num(h, uint64(r.Size))
		}
		if e.Type == TypeDir {
			k := childKey(i)
			h.Write(k[:])
		}
	}
	var id segments.ID
	h.Sum(id[:0])
	return id
}
