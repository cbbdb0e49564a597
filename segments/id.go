package segments

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
)

// ID is a SHA-256: of a blob's plaintext (a blob id) or of a segment's bytes
// (a segment id).
type ID [32]byte

// Sum returns the ID of b.
func Sum(b []byte) ID { return ID(sha256.Sum256(b)) }

// String is the lowercase hex form used in keys and manifests.
func (id ID) String() string { return hex.EncodeToString(id[:]) }

// IsZero reports whether id is the zero ID, which in a Ref's Segment field
// means "the segment that holds the referring blob".
func (id ID) IsZero() bool { return id == ID{} }

// ParseID parses the hex form.
func ParseID(s string) (ID, error) {
	var id ID
	if len(s) != 2*len(id) {
		return id, fmt.Errorf("parse id %q: want %d hex digits", s, 2*len(id))
	}
	if _, err := hex.Decode(id[:], []byte(s)); err != nil {
		return id, fmt.Errorf("parse id %q: %w", s, err)
	}
	return id, nil
}

// MarshalText / UnmarshalText let IDs appear as hex in JSON.
func (id ID) MarshalText() ([]byte, error) { return []byte(id.String()), nil }

func (id *ID) UnmarshalText(b []byte) error {
	v, err := ParseID(string(b))
	if err != nil {
		return err
	}
	*id = v
	return nil
}

// Kind keeps blobs of different life expectancy in different segments, so
// whole segments die together and GC never rewrites to reclaim space.
type Kind uint8

const (
	KindData  Kind = 1 // chunks of regular files
	KindTree  Kind = 2 // directory listings
	KindLines Kind = 3 // complete-line segments of append-only transcripts
)

func (k Kind) String() string {
	switch k {
	case KindData:
		return "data"
	case KindTree:
		return "tree"
	case KindLines:
		return "lines"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Ref names a blob and where it lives: the segment, the byte offset of the
// blob's record in it, and the record's length. Size is the plaintext length.
// A zero Segment means the segment that holds the blob that contains this
// Ref: a tree can point at a child tree packed into the same, not yet sealed,
// segment (whose id is unknown until it is sealed).
type Ref struct {
	Blob    ID    `json:"b"`
	Segment ID    `json:"s"`
	Offset  int64 `json:"o"`
	Length  int64 `json:"l"`
	Size    int64 `json:"n"`
}

// Resolve returns r with a zero Segment replaced by container.
func (r Ref) Resolve(container ID) Ref {
	if r.Segment.IsZero() {
		r.Segment = container
	}
	return r
}

// Key is the object key of a segment: segments/<xx>/<hex>.
func Key(seg ID) string {
	h := seg.String()
	return "segments/" + h[:2] + "/" + h
}
