package segments

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// testBlobs is a mix that exercises both codecs and the empty blob.
func testBlobs() [][]byte {
	return [][]byte{
		textBytes(10, 5000),
		randBytes(11, 700),
		nil,
		[]byte("short"),
		textBytes(12, 12<<10),
	}
}

// buildSegment packs blobs into one sealed segment and returns its id,
// bytes and a full Ref per blob.
func buildSegment(tb testing.TB, c *Codec, kind Kind, blobs [][]byte) (ID, []byte, []Ref) {
	tb.Helper()
	b := NewBuilder(kind)
	var refs []Ref
	for _, p := range blobs {
		id, rec := c.Encode(p)
		off, n := b.Add(id, rec, int64(len(p)))
		refs = append(refs, Ref{Blob: id, Offset: off, Length: n, Size: int64(len(p))})
	}
	seg, data := b.Seal()
	for i := range refs {
		refs[i].Segment = seg
	}
	return seg, data, refs
}

func TestSegmentRoundtrip(t *testing.T) {
	c := newTestCodec(t)
	for _, kind := range []Kind{KindData, KindTree, KindLines} {
		t.Run(kind.String(), func(t *testing.T) {
			blobs := testBlobs()
			seg, data, refs := buildSegment(t, c, kind, blobs)
			if seg != Sum(data) {
				t.Fatal("segment id is not the SHA-256 of its bytes")
			}
			gotKind, entries, err := ParseSegment(data, seg)
			if err != nil {
				t.Fatal(err)
			}
			if gotKind != kind || len(entries) != len(blobs) {
				t.Fatalf("ParseSegment = %v, %d entries; want %v, %d", gotKind, len(entries), kind, len(blobs))
			}
			for i, e := range entries {
				if e.Ref(seg) != refs[i] {
					t.Errorf("entry %d = %+v, want %+v", i, e.Ref(seg), refs[i])
				}
				p, err := c.Decode(data[e.Offset:e.Offset+e.Length], e.Blob, e.Size)
				if err != nil || !bytes.Equal(p, blobs[i]) {
					t.Errorf("entry %d: %v", i, err)
				}
			}
			// The exact trailer, any longer tail, and the whole segment
			// parse alike.
			trailer := int(footerLen + 1 + entryLen*len(blobs))
			for _, n := range []int{trailer, trailer + 1, len(data)} {
				k, e2, err := ParseTrailer(data[len(data)-n:], int64(len(data)))
				if err != nil || k != kind || len(e2) != len(entries) {
					t.Errorf("ParseTrailer(last %d bytes) = %v, %d, %v", n, k, len(e2), err)
				}
			}
		})
	}
}

func TestBuilder(t *testing.T) {
	c := newTestCodec(t)
	b := NewBuilder(KindData)
	if b.Len() != segHeaderLen || b.Count() != 0 {
		t.Fatalf("empty builder: Len %d, Count %d", b.Len(), b.Count())
	}
	p := textBytes(1, 1000)
	id, rec := c.Encode(p)
	off, n := b.Add(id, rec, int64(len(p)))
	if off != segHeaderLen || n != int64(len(rec)) || b.Len() != segHeaderLen+n || b.Count() != 1 {
		t.Fatalf("Add = %d, %d; Len %d, Count %d", off, n, b.Len(), b.Count())
	}
	// The same blob again is stored once.
	if off2, n2 := b.Add(id, rec, int64(len(p))); off2 != off || n2 != n || b.Count() != 1 || b.Len() != segHeaderLen+n {
		t.Fatalf("duplicate Add = %d, %d; Count %d", off2, n2, b.Count())
	}
	seg, data := b.Seal()
	if _, _, err := ParseSegment(data, seg); err != nil {
		t.Fatal(err)
	}

	// An empty segment is valid too.
	seg, data = NewBuilder(KindTree).Seal()
	if k, e, err := ParseSegment(data, seg); err != nil || k != KindTree || len(e) != 0 || len(data) != minSegmentLen {
		t.Fatalf("empty segment: %v %d %v (%d bytes)", k, len(e), err, len(data))
	}
}

func TestBuilderPanics(t *testing.T) {
	c := newTestCodec(t)
	p := []byte("payload")
	id, rec := c.Encode(p)
	tests := []struct {
		name string
		fn   func()
	}{
		{"unknown kind", func() { NewBuilder(0) }},
		{"wrong size", func() { NewBuilder(KindData).Add(id, rec, 3) }},
		{"not a record", func() { NewBuilder(KindData).Add(id, []byte("garbage"), 7) }},
		{"add after seal", func() { b := NewBuilder(KindData); b.Seal(); b.Add(id, rec, int64(len(p))) }},
		{"seal twice", func() { b := NewBuilder(KindData); b.Seal(); b.Seal() }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Fatal("no panic")
				}
			}()
			tt.fn()
		})
	}
}

// rehash recomputes the footer's index xxhash64 after a test edited the
// index, so the parser's deeper checks are reached.
func rehash(data []byte, count int) []byte {
	f := data[len(data)-footerLen:]
	il := 1 + entryLen*count
	binary.LittleEndian.PutUint64(f[8:], xxhash.Sum64(data[len(data)-footerLen-il:len(data)-footerLen]))
	return data
}

func TestParseTrailerRejects(t *testing.T) {
	c := newTestCodec(t)
	blobs := testBlobs()
	_, good, _ := buildSegment(t, c, KindData, blobs)
	n := len(blobs)
	size := int64(len(good))
	footer := len(good) - footerLen
	index := footer - (1 + entryLen*n)
	entry := func(i int) int { return index + 1 + i*entryLen }
	edit := func(fn func(d []byte) []byte) []byte { return fn(bytes.Clone(good)) }
	tests := []struct {
		name string
		tail []byte
		size int64
		msg  string
	}{
		{"empty tail", nil, size, "shorter than a footer"},
		{"tail longer than segment", good, size - 1, "tail of a"},
		{"tail misses the index", good[index+1:], size, "does not hold"},
		{"segment size too big", good, size + 1, ""},
		{"tiny segment size", good[len(good)-footerLen:], footerLen, "cannot hold"},
		{"bad magic", edit(func(d []byte) []byte { d[len(d)-1] = 'X'; return d }), size, "magic"},
		{"bad version", edit(func(d []byte) []byte { d[footer+17] = 2; return d }), size, "version"},
		{"reserved not zero", edit(func(d []byte) []byte { d[footer+19] = 1; return d }), size, "reserved"},
		{"unknown kind", edit(func(d []byte) []byte { d[footer+16] = 9; return d }), size, "unknown"},
		{"count off by one", edit(func(d []byte) []byte { d[footer]++; return d }), size, "index length"},
		{"count and length both off", edit(func(d []byte) []byte {
			binary.LittleEndian.PutUint32(d[footer:], uint32(n+1))
			binary.LittleEndian.PutUint32(d[footer+4:], uint32(1+entryLen*(n+1)))
			return d
		}), size, ""},
		{"huge count", edit(func(d []byte) []byte {
			binary.LittleEndian.PutUint32(d[footer:], 1<<22)
			binary.LittleEndian.PutUint32(d[footer+4:], 1+entryLen<<22)
			return d
		}), size, "limit"},
		{"index hash", edit(func(d []byte) []byte { d[entry(1)] ^= 1; return d }), size, "xxhash64"},
		{"index kind differs", edit(func(d []byte) []byte { d[index] = byte(KindTree); return rehash(d, n) }), size, "index names"},
		{"offset gap", edit(func(d []byte) []byte {
			binary.LittleEndian.PutUint64(d[entry(2)+32:], binary.LittleEndian.Uint64(d[entry(2)+32:])+1)
			return rehash(d, n)
		}), size, "want"},
		{"first offset in header", edit(func(d []byte) []byte {
			binary.LittleEndian.PutUint64(d[entry(0)+32:], 0)
			return rehash(d, n)
		}), size, "want 8"},
		{"length beyond size bound", edit(func(d []byte) []byte {
			binary.LittleEndian.PutUint32(d[entry(3)+44:], 0) // plaintext size 0
			return rehash(d, n)
		}), size, "impossible"},
		{"size above MaxBlobSize", edit(func(d []byte) []byte {
			binary.LittleEndian.PutUint32(d[entry(0)+44:], MaxBlobSize+1)
			return rehash(d, n)
		}), size, "outside"},
		{"last record short of index", edit(func(d []byte) []byte {
			p := entry(n-1) + 40
			binary.LittleEndian.PutUint32(d[p:], binary.LittleEndian.Uint32(d[p:])-1)
			return rehash(d, n)
		}), size, "index starts"},
		{"record past index", edit(func(d []byte) []byte {
			p := entry(n-1) + 40
			binary.LittleEndian.PutUint32(d[p:], binary.LittleEndian.Uint32(d[p:])+1)
			return rehash(d, n)
		}), size, "past the records"},
		{"duplicate blob", edit(func(d []byte) []byte {
			copy(d[entry(1):entry(1)+32], d[entry(0):entry(0)+32])
			return rehash(d, n)
		}), size, "twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, e, err := ParseTrailer(tt.tail, tt.size)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("ParseTrailer = %v, %d entries, %v; want ErrCorrupt", k, len(e), err)
			}
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("error %q does not mention %q", err, tt.msg)
			}
		})
	}
}

// TestSegmentEveryByteCorrupt flips every byte of a stored segment, one at
// a time. Whole-segment reads always detect it. Ranged reads detect it
// wherever they read it (a record, the trailer), name the blob and the
// segment, and never return wrong bytes.
func TestSegmentEveryByteCorrupt(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	blobs := testBlobs()
	seg, good, refs := buildSegment(t, c, KindData, blobs)
	size := int64(len(good))
	st := newMemStore()
	trailerStart := refs[len(refs)-1].Offset + refs[len(refs)-1].Length
	harmless := 0
	for i := range good {
		bad := bytes.Clone(good)
		bad[i] ^= 0x55
		st.set(Key(seg), bad)

		if _, _, err := ParseSegment(bad, seg); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), seg.String()) {
			t.Fatalf("byte %d: ParseSegment: %v", i, err)
		}
		_, _, terr := ReadTrailer(ctx, st, seg, size)
		if int64(i) >= trailerStart && !errors.Is(terr, ErrCorrupt) {
			t.Fatalf("byte %d (trailer): ReadTrailer: %v", i, terr)
		} else if int64(i) < trailerStart && terr != nil {
			t.Fatalf("byte %d (not trailer): ReadTrailer: %v", i, terr)
		}
		for j, r := range refs {
			inRecord := int64(i) >= r.Offset && int64(i) < r.Offset+r.Length
			p, err := c.ReadBlob(ctx, st, r, ID{})
			switch {
			case err == nil && !bytes.Equal(p, blobs[j]):
				t.Fatalf("byte %d: ReadBlob %d returned wrong bytes", i, j)
			case err == nil && inRecord:
				harmless++ // an ignored zstd bit: see TestDecodeEveryByte
			case err != nil && !inRecord:
				t.Fatalf("byte %d outside blob %d: ReadBlob: %v", i, j, err)
			case err != nil && (!errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), seg.String()) || !strings.Contains(err.Error(), r.Blob.String())):
				t.Fatalf("byte %d: ReadBlob %d: %v, want ErrCorrupt naming blob %s and segment %s", i, j, err, r.Blob, seg)
			}
		}
		var got int
		err := c.ReadBlobs(ctx, st, seg, refs, func(r Ref, p []byte) error {
			got++
			return nil
		})
		if int64(i) >= segHeaderLen && int64(i) < trailerStart {
			if err == nil {
				continue // an ignored zstd bit again
			}
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), seg.String()) {
				t.Fatalf("byte %d: ReadBlobs: %v", i, err)
			}
		} else if err != nil || got != len(refs) {
			t.Fatalf("byte %d outside records: ReadBlobs read %d: %v", i, got, err)
		}
	}
	t.Logf("%d of %d corrupted bytes left a zstd plaintext unchanged", harmless, len(good))
}

func TestReadTrailer(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	many := make([][]byte, 2000) // index of 96 KiB: past the 64 KiB probe
	for i := range many {
		many[i] = binary.LittleEndian.AppendUint64(nil, uint64(i))
	}
	tests := []struct {
		name     string
		blobs    [][]byte
		wantGets int
	}{
		{"small segment, one GET", testBlobs(), 1},
		{"big segment, small index, one GET", [][]byte{randBytes(1, 200<<10), randBytes(2, 100)}, 1},
		{"index larger than the probe, two GETs", many, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			seg, data, _ := buildSegment(t, c, KindLines, tt.blobs)
			st := newMemStore()
			st.set(Key(seg), data)
			wantKind, wantEntries, err := ParseSegment(data, seg)
			if err != nil {
				t.Fatal(err)
			}
			kind, entries, err := ReadTrailer(ctx, st, seg, int64(len(data)))
			if err != nil {
				t.Fatal(err)
			}
			if kind != wantKind || len(entries) != len(wantEntries) {
				t.Fatalf("ReadTrailer = %v, %d entries", kind, len(entries))
			}
			for i := range entries {
				if entries[i] != wantEntries[i] {
					t.Fatalf("entry %d differs", i)
				}
			}
			if gets := st.getCalls(); len(gets) != tt.wantGets {
				t.Errorf("%d GETs %v, want %d", len(gets), gets, tt.wantGets)
			}
			// A wrong size is caught, never trusted.
			for _, sz := range []int64{int64(len(data)) - 1, int64(len(data)) + 1, 10} {
				if _, _, err := ReadTrailer(ctx, st, seg, sz); !errors.Is(err, ErrCorrupt) {
					t.Errorf("ReadTrailer with size %d of %d: %v, want ErrCorrupt", sz, len(data), err)
				}
			}
		})
	}
}

func FuzzParseTrailer(f *testing.F) {
	c := newTestCodec(f)
	for _, blobs := range [][][]byte{nil, testBlobs(), {[]byte("a"), []byte("b")}} {
		_, data, _ := buildSegment(f, c, KindTree, blobs)
		f.Add(data, int64(len(data)), false)
		f.Add(data[len(data)-footerLen-1-entryLen*len(blobs):], int64(len(data)), true)
		f.Add(data[len(data)/2:], int64(len(data)), false)
	}
	f.Fuzz(func(t *testing.T, tail []byte, segSize int64, fixHash bool) {
		if fixHash && len(tail) >= footerLen {
			// Let the fuzzer past the checksum, to the structure checks:
			// make the footer's xxhash64 match whatever index it claims.
			tail = bytes.Clone(tail)
			f := tail[len(tail)-footerLen:]
			if il := int(binary.LittleEndian.Uint32(f[4:])); il <= len(tail)-footerLen {
				binary.LittleEndian.PutUint64(f[8:], xxhash.Sum64(tail[len(tail)-footerLen-il:len(tail)-footerLen]))
			}
		}
		kind, entries, err := ParseTrailer(tail, segSize)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		// Whatever is accepted is a consistent layout of the segment...
		if !validKind(kind) {
			t.Fatalf("accepted kind %v", kind)
		}
		next := int64(segHeaderLen)
		seen := map[ID]bool{}
		for _, e := range entries {
			if e.Offset != next || checkRecordBounds(e.Length, e.Size) != nil || seen[e.Blob] {
				t.Fatalf("accepted entry %+v at %d", e, next)
			}
			seen[e.Blob] = true
			next += e.Length
		}
		il := int64(1 + entryLen*len(entries))
		if next+il+footerLen != segSize {
			t.Fatalf("records end at %d, index %d + footer leave %d", next, il, segSize)
		}
		// ...and the trailer is exactly what a Builder writes for it.
		want := appendIndex(nil, kind, entries)
		want = appendFooter(want, kind, len(entries), want)
		if len(tail) < len(want) || !bytes.Equal(tail[len(tail)-len(want):], want) {
			t.Fatal("accepted trailer is not in canonical form")
		}
	})
}
