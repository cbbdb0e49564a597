package segments

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"

	"github.com/cespare/xxhash/v2"
)

const (
	segMagic   = "AGSG"
	segVersion = 1

	segHeaderLen = 8
	footerLen    = 24
	entryLen     = 32 + 8 + 4 + 4

	// minSegmentLen is a segment without blobs: header, index kind byte,
	// footer.
	minSegmentLen = segHeaderLen + 1 + footerLen

	// maxIndexLen bounds the index a reader fetches: at 48 bytes an entry
	// it is 1.4 million blobs, far more than a segment of a few tens of
	// MiB holds, and it keeps one bad footer from costing more memory.
	maxIndexLen = 64 << 20

	// trailerProbe is how much of a segment's end ReadTrailer fetches
	// first: the footer plus, in the common case, the whole index
	// (1300 entries), so a trailer usually costs one GET, not two.
	trailerProbe = 64 << 10
)

func validKind(k Kind) bool { return k == KindData || k == KindTree || k == KindLines }

// IndexEntry describes one blob of a segment, as its trailer lists it.
type IndexEntry struct {
	Blob   ID    // SHA-256 of the plaintext
	Offset int64 // of the record in the segment
	Length int64 // of the record
	Size   int64 // of the plaintext
}

// Ref returns the reference to the entry's blob in segment seg.
func (e IndexEntry) Ref(seg ID) Ref {
	return Ref{Blob: e.Blob, Segment: seg, Offset: e.Offset, Length: e.Length, Size: e.Size}
}

// checkRecordBounds reports whether a record of length bytes can hold a
// plaintext of size bytes. The same rule is applied when building (to
// catch a record that did not come from Encode) and when reading (so a bad
// index or ref cannot make a reader allocate or fetch more than the size
// allows).
func checkRecordBounds(length, size int64) error {
	if size < 0 || size > MaxBlobSize {
		return fmt.Errorf("plaintext size %d outside [0, %d]", size, MaxBlobSize)
	}
	if length < minRecordLen || length > maxRecordLen(size) {
		return fmt.Errorf("record length %d impossible for a %d-byte plaintext", length, size)
	}
	return nil
}

// Builder assembles one segment in memory. Add the records, then Seal. It
// is not safe for concurrent use.
type Builder struct {
	kind    Kind
	buf     []byte
	entries []IndexEntry
	byBlob  map[ID]int // index into entries, so a blob is stored once
	sealed  bool
}

// NewBuilder starts an empty segment for blobs of one kind.
func NewBuilder(kind Kind) *Builder {
	if !validKind(kind) {
		panic(fmt.Sprintf("segments: NewBuilder with unknown kind %d", kind))
	}
	b := &Builder{kind: kind, byBlob: make(map[ID]int)}
	b.buf = append(make([]byte, 0, 4<<10), segMagic...)
	b.buf = append(b.buf, segVersion, byte(kind), 0, 0)
	return b
}

// Add appends the record of blob id (plaintext size bytes, from
// Codec.Encode) and returns where it lives in the segment. A blob already
// in this segment is not stored again: Add returns its existing place.
//
// Add panics if the record is not one Encode could have produced for a
// plaintext of size bytes, or after Seal: both are programming errors that
// would otherwise produce an unreadable segment.
func (b *Builder) Add(id ID, record []byte, size int64) (offset, length int64) {
	if b.sealed {
		panic("segments: Builder.Add after Seal")
	}
	if i, ok := b.byBlob[id]; ok {
		return b.entries[i].Offset, b.entries[i].Length
	}
	h, err := parseRecordHeader(record, -1)
	if err == nil && h.size != size {
		err = fmt.Errorf("record declares %d plaintext bytes, Add was told %d", h.size, size)
	}
	if err == nil {
		err = checkRecordBounds(int64(len(record)), size)
	}
	if err != nil {
		panic(fmt.Sprintf("segments: Builder.Add blob %s: %v", id, err))
	}
	offset, length = int64(len(b.buf)), int64(len(record))
	b.buf = append(b.buf, record...)
	b.byBlob[id] = len(b.entries)
	b.entries = append(b.entries, IndexEntry{Blob: id, Offset: offset, Length: length, Size: size})
	return offset, length
}

// Len is the segment's length so far: header and records, without the
// trailer Seal will add.
func (b *Builder) Len() int64 { return int64(len(b.buf)) }

// Count is the number of blobs added.
func (b *Builder) Count() int { return len(b.entries) }

// Seal appends the index and footer and returns the segment's id and bytes.
// The Builder must not be used afterwards; the bytes are the caller's.
func (b *Builder) Seal() (ID, []byte) {
	if b.sealed {
		panic("segments: Builder.Seal twice")
	}
	b.sealed = true
	indexStart := len(b.buf)
	b.buf = appendIndex(b.buf, b.kind, b.entries)
	b.buf = appendFooter(b.buf, b.kind, len(b.entries), b.buf[indexStart:])
	data := b.buf
	if cap(data)-len(data) > len(data)/8 {
		// append's doubling can leave up to twice the segment allocated;
		// the bytes live on while their upload is in flight, so hand out
		// an exact copy and let the oversized buffer go.
		data = bytes.Clone(data)
	}
	b.buf, b.entries, b.byBlob = nil, nil, nil
	return Sum(data), data
}

func appendIndex(dst []byte, kind Kind, entries []IndexEntry) []byte {
	dst = append(dst, byte(kind))
	for _, e := range entries {
		dst = append(dst, e.Blob[:]...)
		dst = binary.LittleEndian.AppendUint64(dst, uint64(e.Offset))
		dst = binary.LittleEndian.AppendUint32(dst, uint32(e.Length))
		dst = binary.LittleEndian.AppendUint32(dst, uint32(e.Size))
	}
	return dst
}

func appendFooter(dst []byte, kind Kind, count int, index []byte) []byte {
	dst = binary.LittleEndian.AppendUint32(dst, uint32(count))
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(index)))
	dst = binary.LittleEndian.AppendUint64(dst, xxhash.Sum64(index))
	dst = append(dst, byte(kind), segVersion, 0, 0)
	return append(dst, segMagic...)
}

// footer is a decoded, self-consistent footer.
type footer struct {
	count    int
	indexLen int64
	xxh      uint64
	kind     Kind
}

// parseFooter checks the last footerLen bytes of a segment of segSize
// bytes. Its errors wrap ErrCorrupt.
func parseFooter(f []byte, segSize int64) (footer, error) {
	var ft footer
	if len(f) != footerLen {
		return ft, fmt.Errorf("footer is %d bytes, want %d: %w", len(f), footerLen, ErrCorrupt)
	}
	if string(f[20:24]) != segMagic {
		return ft, fmt.Errorf("bad footer magic %q: %w", f[20:24], ErrCorrupt)
	}
	if f[17] != segVersion {
		return ft, fmt.Errorf("segment version %d, want %d: %w", f[17], segVersion, ErrCorrupt)
	}
	if f[18] != 0 || f[19] != 0 {
		return ft, fmt.Errorf("footer reserved bytes %#x %#x not zero: %w", f[18], f[19], ErrCorrupt)
	}
	ft.kind = Kind(f[16])
	if !validKind(ft.kind) {
		return ft, fmt.Errorf("footer names unknown %v: %w", ft.kind, ErrCorrupt)
	}
	count := uint64(binary.LittleEndian.Uint32(f[0:]))
	ft.indexLen = int64(binary.LittleEndian.Uint32(f[4:]))
	ft.xxh = binary.LittleEndian.Uint64(f[8:])
	if uint64(ft.indexLen) != 1+entryLen*count {
		return ft, fmt.Errorf("footer index length %d does not fit %d entries: %w", ft.indexLen, count, ErrCorrupt)
	}
	if ft.indexLen > maxIndexLen {
		return ft, fmt.Errorf("index of %d bytes exceeds the %d-byte limit: %w", ft.indexLen, maxIndexLen, ErrCorrupt)
	}
	// Every entry needs a record of at least minRecordLen bytes.
	if segSize < minSegmentLen || int64(count) > (segSize-minSegmentLen)/(entryLen+minRecordLen) {
		return ft, fmt.Errorf("segment of %d bytes cannot hold %d blobs: %w", segSize, count, ErrCorrupt)
	}
	ft.count = int(count)
	return ft, nil
}

// ParseTrailer validates the trailer of a segment of segSize bytes, given
// tail, the last len(tail) bytes of the segment (at least its index and
// footer; the whole segment will do), and returns the segment's kind and
// its index in offset order. Validation is strict (see the package
// documentation); its errors wrap ErrCorrupt.
func ParseTrailer(tail []byte, segSize int64) (Kind, []IndexEntry, error) {
	if int64(len(tail)) > segSize {
		return 0, nil, fmt.Errorf("parse trailer: %d-byte tail of a %d-byte segment: %w", len(tail), segSize, ErrCorrupt)
	}
	if len(tail) < footerLen {
		return 0, nil, fmt.Errorf("parse trailer: %d-byte tail is shorter than a footer: %w", len(tail), ErrCorrupt)
	}
	ft, err := parseFooter(tail[len(tail)-footerLen:], segSize)
	if err != nil {
		return 0, nil, fmt.Errorf("parse trailer: %w", err)
	}
	if int64(len(tail)) < ft.indexLen+footerLen {
		return 0, nil, fmt.Errorf("parse trailer: %d-byte tail does not hold the %d-byte index: %w", len(tail), ft.indexLen, ErrCorrupt)
	}
	index := tail[int64(len(tail))-footerLen-ft.indexLen : len(tail)-footerLen]
	entries, err := parseIndex(index, ft, segSize)
	if err != nil {
		return 0, nil, fmt.Errorf("parse trailer: %w", err)
	}
	return ft.kind, entries, nil
}

// parseIndex checks index against its footer. Its errors wrap ErrCorrupt.
func parseIndex(index []byte, ft footer, segSize int64) ([]IndexEntry, error) {
	if got := xxhash.Sum64(index); got != ft.xxh {
		return nil, fmt.Errorf("index xxhash64 %016x, footer declares %016x: %w", got, ft.xxh, ErrCorrupt)
	}
	if Kind(index[0]) != ft.kind {
		return nil, fmt.Errorf("index names %v, footer %v: %w", Kind(index[0]), ft.kind, ErrCorrupt)
	}
	recordsEnd := segSize - footerLen - ft.indexLen
	entries := make([]IndexEntry, ft.count)
	seen := make(map[ID]struct{}, ft.count)
	next := int64(segHeaderLen)
	for i := range entries {
		p := index[1+i*entryLen : 1+(i+1)*entryLen]
		e := &entries[i]
		copy(e.Blob[:], p[:32])
		off := binary.LittleEndian.Uint64(p[32:])
		e.Length = int64(binary.LittleEndian.Uint32(p[40:]))
		e.Size = int64(binary.LittleEndian.Uint32(p[44:]))
		if off != uint64(next) {
			return nil, fmt.Errorf("index entry %d (blob %s) at offset %d, want %d: %w", i, e.Blob, off, next, ErrCorrupt)
		}
		e.Offset = next
		if err := checkRecordBounds(e.Length, e.Size); err != nil {
			return nil, fmt.Errorf("index entry %d (blob %s): %v: %w", i, e.Blob, err, ErrCorrupt)
		}
		next += e.Length
		if next > recordsEnd {
			return nil, fmt.Errorf("index entry %d (blob %s) ends at %d, past the records' end %d: %w", i, e.Blob, next, recordsEnd, ErrCorrupt)
		}
		if _, dup := seen[e.Blob]; dup {
			return nil, fmt.Errorf("index lists blob %s twice: %w", e.Blob, ErrCorrupt)
		}
		seen[e.Blob] = struct{}{}
	}
	if next != recordsEnd {
		return nil, fmt.Errorf("records end at %d, index starts at %d: %w", next, recordsEnd, ErrCorrupt)
	}
	return entries, nil
}

// ParseSegment verifies a whole segment that should be seg: its SHA-256,
// header and trailer. It returns the kind and the index; the record of an
// entry e is data[e.Offset : e.Offset+e.Length], for Codec.Decode.
func ParseSegment(data []byte, seg ID) (Kind, []IndexEntry, error) {
	if got := Sum(data); got != seg {
		return 0, nil, fmt.Errorf("parse segment %s: %d bytes have SHA-256 %s: %w", seg, len(data), got, ErrCorrupt)
	}
	if len(data) < minSegmentLen || string(data[:4]) != segMagic || data[4] != segVersion || data[6] != 0 || data[7] != 0 {
		return 0, nil, fmt.Errorf("parse segment %s: bad header: %w", seg, ErrCorrupt)
	}
	kind, entries, err := ParseTrailer(data, int64(len(data)))
	if err != nil {
		return 0, nil, fmt.Errorf("segment %s: %w", seg, err)
	}
	if Kind(data[5]) != kind {
		return 0, nil, fmt.Errorf("parse segment %s: header names %v, trailer %v: %w", seg, Kind(data[5]), kind, ErrCorrupt)
	}
	return kind, entries, nil
}

// ReadTrailer fetches and validates the trailer of the stored segment seg,
// which is size bytes long (from the manifest, or a Stat). It fetches the
// last 64 KiB (or the whole segment if smaller) first, which holds the
// footer and, for up to about 1300 blobs, the whole index; only a larger
// index costs a second ranged GET of exactly its bytes.
func ReadTrailer(ctx context.Context, g Getter, seg ID, size int64) (Kind, []IndexEntry, error) {
	if size < minSegmentLen {
		return 0, nil, fmt.Errorf("read trailer of segment %s: size %d is smaller than any segment: %w", seg, size, ErrCorrupt)
	}
	probe := min(size, trailerProbe)
	tail, err := readRange(ctx, g, seg, size-probe, probe)
	if err != nil {
		return 0, nil, fmt.Errorf("read trailer: %w", err)
	}
	ft, err := parseFooter(tail[len(tail)-footerLen:], size)
	if err != nil {
		return 0, nil, fmt.Errorf("read trailer of segment %s: %w", seg, err)
	}
	if need := ft.indexLen + footerLen; need > probe {
		if need > size {
			return 0, nil, fmt.Errorf("read trailer of segment %s: %d-byte trailer in a %d-byte segment: %w", seg, need, size, ErrCorrupt)
		}
		index, err := readRange(ctx, g, seg, size-need, ft.indexLen)
		if err != nil {
			return 0, nil, fmt.Errorf("read trailer index: %w", err)
		}
		// Reuse the footer already fetched; it was validated above.
		tail = append(index, tail[len(tail)-footerLen:]...)
	}
	kind, entries, err := ParseTrailer(tail, size)
	if err != nil {
		return 0, nil, fmt.Errorf("read trailer of segment %s: %w", seg, err)
	}
	return kind, entries, nil
}
