package segments

import (
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"slices"

	"github.com/agentstate/agentstate/store"
)

// Getter is the part of store.Store that readers need.
type Getter interface {
	// Get reads length bytes of key starting at offset; see store.Store.
	Get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error)
}

var _ Getter = store.Store(nil)

// readRange fetches exactly length bytes of segment seg at offset. A range
// past the end of the object, or a body that ends early, means the segment
// is not what the reference says: ErrCorrupt (a missing segment stays
// store.ErrNotFound).
func readRange(ctx context.Context, g Getter, seg ID, offset, length int64) ([]byte, error) {
	body, err := g.Get(ctx, Key(seg), offset, length)
	if err != nil {
		if errors.Is(err, store.ErrInvalidRange) {
			return nil, fmt.Errorf("get segment %s bytes %d+%d: %w: %w", seg, offset, length, ErrCorrupt, err)
		}
		return nil, fmt.Errorf("get segment %s bytes %d+%d: %w", seg, offset, length, err)
	}
	defer body.Close()
	buf := make([]byte, length)
	if _, err := io.ReadFull(body, buf); err != nil {
		return nil, readErr(seg, offset, length, err)
	}
	return buf, nil
}

func readErr(seg ID, offset, length int64, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("read segment %s bytes %d+%d: object ends early: %w", seg, offset, length, ErrCorrupt)
	}
	return fmt.Errorf("read segment %s bytes %d+%d: %w", seg, offset, length, err)
}

// checkRef rejects a reference that no valid segment can satisfy, before
// anything is fetched or allocated for it.
func checkRef(r Ref) error {
	if r.Segment.IsZero() {
		return fmt.Errorf("reference to blob %s names no segment and none contains it: %w", r.Blob, ErrCorrupt)
	}
	if r.Offset < segHeaderLen {
		return fmt.Errorf("reference to blob %s in segment %s: offset %d inside the header: %w", r.Blob, r.Segment, r.Offset, ErrCorrupt)
	}
	if err := checkRecordBounds(r.Length, r.Size); err != nil {
		return fmt.Errorf("reference to blob %s in segment %s: %v: %w", r.Blob, r.Segment, err, ErrCorrupt)
	}
	return nil
}

// ReadBlob fetches and verifies the blob ref points at with one ranged GET
// of exactly its record. A zero ref.Segment means container, the segment of
// the blob holding ref. The returned plaintext is the caller's.
func (c *Codec) ReadBlob(ctx context.Context, g Getter, ref Ref, container ID) ([]byte, error) {
	r := ref.Resolve(container)
	if err := checkRef(r); err != nil {
		return nil, fmt.Errorf("read blob: %w", err)
	}
	record, err := readRange(ctx, g, r.Segment, r.Offset, r.Length)
	if err != nil {
		return nil, fmt.Errorf("read blob %s: %w", r.Blob, err)
	}
	plain, err := c.Decode(record, r.Blob, r.Size)
	if err != nil {
		return nil, fmt.Errorf("read segment %s bytes %d+%d: %w", r.Segment, r.Offset, r.Length, err)
	}
	return plain, nil
}

// ReadBlobs fetches and verifies blobs of segment seg with ONE ranged GET
// from the first needed record to the end of the last, streamed in offset
// order: gaps are read and discarded, and one record is held at a time, so
// memory is bounded by the largest blob however many are read. Whether to
// read a whole segment this way or a few ranges is the caller's choice:
// group refs by segment and, where gaps are large, call ReadBlobs per group.
//
// refs may be unsorted and hold duplicates; a zero Segment means seg, any
// other must be seg. fn is called once per distinct blob, in offset order;
// its plaintext is valid only until fn returns (the buffer is reused), so
// copy what must be kept. An error from fn stops the read and is returned
// as is.
func (c *Codec) ReadBlobs(ctx context.Context, g Getter, seg ID, refs []Ref, fn func(Ref, []byte) error) error {
	if len(refs) == 0 {
		return nil
	}
	return c.readBlobs(ctx, g, seg, refs, -1, fn)
}

// ReadSegment is ReadBlobs over the whole object, which is size bytes: it
// also hashes every byte and checks the result against the segment's name,
// so damage anywhere in it (the trailer, the gaps between needed blobs, the
// few bits of a zstd frame that decoding ignores) is detected. fn may have
// been called for some blobs before that final check fails: whatever it
// did with them must be discarded when ReadSegment returns an error.
func (c *Codec) ReadSegment(ctx context.Context, g Getter, seg ID, size int64, refs []Ref, fn func(Ref, []byte) error) error {
	return c.readBlobs(ctx, g, seg, refs, size, fn)
}

// readBlobs reads the span of the needed records, or with whole >= 0 the
// entire object of that size, verifying its SHA-256.
func (c *Codec) readBlobs(ctx context.Context, g Getter, seg ID, refs []Ref, whole int64, fn func(Ref, []byte) error) error {
	sorted := make([]Ref, 0, len(refs))
	for _, ref := range refs {
		if !ref.Segment.IsZero() && ref.Segment != seg {
			return fmt.Errorf("read blobs of segment %s: reference to blob %s is in segment %s", seg, ref.Blob, ref.Segment)
		}
		r := ref.Resolve(seg)
		if err := checkRef(r); err != nil {
			return fmt.Errorf("read blobs: %w", err)
		}
		sorted = append(sorted, r)
	}
	slices.SortFunc(sorted, func(a, b Ref) int { return cmp.Compare(a.Offset, b.Offset) })
	sorted = slices.Compact(sorted)
	maxLen, maxSize := int64(0), int64(0)
	for i, r := range sorted {
		if i > 0 && r.Offset < sorted[i-1].Offset+sorted[i-1].Length {
			p := sorted[i-1]
			return fmt.Errorf("read blobs of segment %s: records of blob %s (%d+%d) and blob %s (%d+%d) overlap: %w",
				seg, p.Blob, p.Offset, p.Length, r.Blob, r.Offset, r.Length, ErrCorrupt)
		}
		maxLen, maxSize = max(maxLen, r.Length), max(maxSize, r.Size)
	}
	var start, end int64
	if len(sorted) > 0 {
		first, last := sorted[0], sorted[len(sorted)-1]
		start, end = first.Offset, last.Offset+last.Length
	}
	var hasher hash.Hash
	if whole >= 0 {
		if end > whole {
			return fmt.Errorf("read segment %s: a record ends at %d, past its size %d: %w", seg, end, whole, ErrCorrupt)
		}
		start, end, hasher = 0, whole, sha256.New()
	}
	rawBody, err := g.Get(ctx, Key(seg), start, end-start)
	if err != nil {
		if errors.Is(err, store.ErrInvalidRange) {
			return fmt.Errorf("read blobs: get segment %s bytes %d+%d: %w: %w", seg, start, end-start, ErrCorrupt, err)
		}
		return fmt.Errorf("read blobs: get segment %s bytes %d+%d: %w", seg, start, end-start, err)
	}
	defer rawBody.Close()
	var body io.Reader = rawBody
	if hasher != nil {
		body = io.TeeReader(rawBody, hasher)
	}

	// Allocated once and reused for every blob; checkRef bounded both by
	// MaxBlobSize.
	record := make([]byte, 0, maxLen)
	plain := make([]byte, 0, maxSize)
	pos := start
	for _, r := range sorted {
		if gap := r.Offset - pos; gap > 0 {
			if _, err := io.CopyN(io.Discard, body, gap); err != nil {
				return fmt.Errorf("read blobs: skip to blob %s: %w", r.Blob, readErr(seg, pos, gap, err))
			}
		}
		record = record[:r.Length]
		if _, err := io.ReadFull(body, record); err != nil {
			return fmt.Errorf("read blob %s: %w", r.Blob, readErr(seg, r.Offset, r.Length, err))
		}
		pos = r.Offset + r.Length
		p, err := c.decode(plain, record, r.Blob, r.Size)
		if err != nil {
			return fmt.Errorf("read segment %s bytes %d+%d: %w", seg, r.Offset, r.Length, err)
		}
		if err := fn(r, p); err != nil {
			return err
		}
	}
	if hasher == nil {
		return nil
	}
	if _, err := io.CopyN(io.Discard, body, end-pos); err != nil {
		return fmt.Errorf("read segment %s: %w", seg, readErr(seg, pos, end-pos, err))
	}
	if got := ID(hasher.Sum(nil)); got != seg {
		return fmt.Errorf("read segment %s: content hashes to %s: %w", seg, got, ErrCorrupt)
	}
	return nil
}
