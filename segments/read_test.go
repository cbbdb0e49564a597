package segments

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/agentstate/agentstate/store"
)

// storedSegment builds a segment of blobs and puts it in a fresh memStore.
func storedSegment(t *testing.T, c *Codec, blobs [][]byte) (*memStore, ID, []byte, []Ref) {
	t.Helper()
	seg, data, refs := buildSegment(t, c, KindData, blobs)
	st := newMemStore()
	st.set(Key(seg), data)
	return st, seg, data, refs
}

func TestReadBlob(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	blobs := testBlobs()
	st, seg, _, refs := storedSegment(t, c, blobs)
	for i, r := range refs {
		for _, tc := range []struct {
			name      string
			ref       Ref
			container ID
		}{
			{"absolute", r, ID{}},
			{"absolute ignores container", r, ID{9}},
			{"relative", Ref{Blob: r.Blob, Offset: r.Offset, Length: r.Length, Size: r.Size}, seg},
		} {
			st.resetGets()
			got, err := c.ReadBlob(ctx, st, tc.ref, tc.container)
			if err != nil || !bytes.Equal(got, blobs[i]) {
				t.Fatalf("blob %d %s: %v", i, tc.name, err)
			}
			// One GET of exactly the record.
			if g := st.getCalls(); len(g) != 1 || g[0] != (getCall{Key(seg), r.Offset, r.Length}) {
				t.Fatalf("blob %d %s: GETs %v", i, tc.name, g)
			}
		}
	}
}

func TestReadBlobErrors(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	st, seg, data, refs := storedSegment(t, c, testBlobs())
	r := refs[0]
	with := func(fn func(*Ref)) Ref { x := r; fn(&x); return x }
	tests := []struct {
		name      string
		ref       Ref
		container ID
		wantIs    error
		wantGets  int
	}{
		{"missing segment", with(func(x *Ref) { x.Segment = ID{7} }), ID{}, store.ErrNotFound, 1},
		{"no segment, no container", with(func(x *Ref) { x.Segment = ID{} }), ID{}, ErrCorrupt, 0},
		{"offset in header", with(func(x *Ref) { x.Offset = 2 }), ID{}, ErrCorrupt, 0},
		{"length impossible for size", with(func(x *Ref) { x.Length = x.Size + 100 }), ID{}, ErrCorrupt, 0},
		{"size above MaxBlobSize", with(func(x *Ref) { x.Size = MaxBlobSize + 1; x.Length = 1 << 30 }), ID{}, ErrCorrupt, 0},
		{"negative size", with(func(x *Ref) { x.Size = -1 }), ID{}, ErrCorrupt, 0},
		{"past the end", with(func(x *Ref) { x.Offset = int64(len(data)) + 10 }), ID{}, ErrCorrupt, 1},
		{"runs past the end", with(func(x *Ref) { x.Offset = int64(len(data)) - x.Length + 1 }), ID{}, ErrCorrupt, 1},
		{"wrong offset", with(func(x *Ref) { x.Offset++ }), ID{}, ErrCorrupt, 1},
		{"wrong blob", with(func(x *Ref) { x.Blob = refs[1].Blob }), ID{}, ErrCorrupt, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st.resetGets()
			_, err := c.ReadBlob(ctx, st, tt.ref, tt.container)
			if !errors.Is(err, tt.wantIs) {
				t.Fatalf("ReadBlob = %v, want %v", err, tt.wantIs)
			}
			if tt.wantIs == store.ErrNotFound && errors.Is(err, ErrCorrupt) {
				t.Fatalf("a missing segment is not corruption: %v", err)
			}
			if !strings.Contains(err.Error(), tt.ref.Blob.String()) {
				t.Errorf("error %q does not name the blob", err)
			}
			if !tt.ref.Segment.IsZero() && !strings.Contains(err.Error(), tt.ref.Segment.String()) {
				t.Errorf("error %q does not name the segment", err)
			}
			if g := st.getCalls(); len(g) != tt.wantGets {
				t.Errorf("%d GETs, want %d", len(g), tt.wantGets)
			}
		})
	}
	_ = seg
}

func TestReadBlobs(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	var blobs [][]byte
	for i := range 12 {
		blobs = append(blobs, textBytes(uint64(i), 1000+i*300))
	}
	st, seg, _, refs := storedSegment(t, c, blobs)
	relative := func(r Ref) Ref { r.Segment = ID{}; return r }
	tests := []struct {
		name string
		refs []Ref
		want []int // blob indexes, in the order fn must see them
	}{
		{"all in order", refs, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}},
		{"one", refs[5:6], []int{5}},
		{"unsorted with gaps and duplicates", []Ref{refs[9], refs[2], refs[9], refs[4], refs[2], refs[10]}, []int{2, 4, 9, 10}},
		{"relative and absolute mixed", []Ref{relative(refs[3]), refs[3], refs[1]}, []int{1, 3}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st.resetGets()
			var order []int
			err := c.ReadBlobs(ctx, st, seg, tt.refs, func(r Ref, p []byte) error {
				i := slices.IndexFunc(refs, func(x Ref) bool { return x == r })
				if i < 0 || !bytes.Equal(p, blobs[i]) {
					t.Fatalf("fn got %+v with wrong bytes", r)
				}
				order = append(order, i)
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(order, tt.want) {
				t.Fatalf("fn saw blobs %v, want %v", order, tt.want)
			}
			first, last := refs[tt.want[0]], refs[tt.want[len(tt.want)-1]]
			want := getCall{Key(seg), first.Offset, last.Offset + last.Length - first.Offset}
			if g := st.getCalls(); len(g) != 1 || g[0] != want {
				t.Fatalf("GETs %v, want exactly %v", g, want)
			}
		})
	}

	t.Run("no refs, no request", func(t *testing.T) {
		st.resetGets()
		if err := c.ReadBlobs(ctx, st, seg, nil, nil); err != nil || len(st.getCalls()) != 0 {
			t.Fatalf("%v, %d GETs", err, len(st.getCalls()))
		}
	})
	t.Run("fn error stops the read", func(t *testing.T) {
		stop := errors.New("stop")
		n := 0
		err := c.ReadBlobs(ctx, st, seg, refs, func(Ref, []byte) error { n++; return stop })
		if err != stop || n != 1 {
			t.Fatalf("ReadBlobs = %v after %d calls", err, n)
		}
	})
	t.Run("ref of another segment", func(t *testing.T) {
		other := refs[0]
		other.Segment = ID{3}
		if err := c.ReadBlobs(ctx, st, seg, []Ref{refs[1], other}, nil); err == nil || !strings.Contains(err.Error(), other.Blob.String()) {
			t.Fatalf("ReadBlobs = %v", err)
		}
	})
	t.Run("overlapping refs", func(t *testing.T) {
		bad := refs[1]
		bad.Offset++
		err := c.ReadBlobs(ctx, st, seg, []Ref{refs[1], bad}, func(Ref, []byte) error { return nil })
		if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("ReadBlobs = %v, want ErrCorrupt", err)
		}
	})
	t.Run("truncated object", func(t *testing.T) {
		short := newMemStore()
		short.set(Key(seg), st.object(Key(seg))[:refs[6].Offset+10])
		var n int
		err := c.ReadBlobs(ctx, short, seg, refs, func(Ref, []byte) error { n++; return nil })
		if !errors.Is(err, ErrCorrupt) || n != 6 || !strings.Contains(err.Error(), refs[6].Blob.String()) {
			t.Fatalf("ReadBlobs = %v after %d blobs, want ErrCorrupt at blob 6", err, n)
		}
	})
	t.Run("missing segment", func(t *testing.T) {
		err := c.ReadBlobs(ctx, newMemStore(), seg, refs, nil)
		if !errors.Is(err, store.ErrNotFound) || errors.Is(err, ErrCorrupt) {
			t.Fatalf("ReadBlobs = %v, want ErrNotFound", err)
		}
	})
}

// TestReadBlobsBoundedMemory reads 32 MiB of blobs in one call: it must
// allocate about one record and one plaintext, not the segment.
func TestReadBlobsBoundedMemory(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	const n, size = 32, 1 << 20
	var blobs [][]byte
	for i := range n {
		blobs = append(blobs, randBytes(uint64(i), size))
	}
	st, seg, _, refs := storedSegment(t, c, blobs)
	blobs = nil
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var total int
	err := c.ReadBlobs(ctx, st, seg, refs, func(_ Ref, p []byte) error { total += len(p); return nil })
	runtime.ReadMemStats(&after)
	if err != nil || total != n*size {
		t.Fatalf("read %d bytes: %v", total, err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 4*size {
		t.Fatalf("ReadBlobs of %d MiB allocated %d bytes, want at most %d", n*size>>20, alloc, 4*size)
	} else {
		t.Logf("ReadBlobs of %d MiB allocated %d KiB", n*size>>20, alloc>>10)
	}
}

// TestReadSegmentDetectsEveryFlippedByte: unlike ranged reads, a whole
// segment read checks the segment's name, so no damaged byte goes unseen.
func TestReadSegmentDetectsEveryFlippedByte(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	blobs := testBlobs()
	st, seg, data, refs := storedSegment(t, c, blobs)
	var got [][]byte
	if err := c.ReadSegment(ctx, st, seg, int64(len(data)), refs[:1], func(_ Ref, b []byte) error {
		got = append(got, bytes.Clone(b))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || !bytes.Equal(got[0], blobs[0]) {
		t.Fatal("ReadSegment did not return the requested blob")
	}
	for i := range data {
		bad := bytes.Clone(data)
		bad[i] ^= 0x01
		st.set(Key(seg), bad)
		err := c.ReadSegment(ctx, st, seg, int64(len(data)), refs, func(Ref, []byte) error { return nil })
		if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("flipped byte %d of %d: err = %v, want ErrCorrupt", i, len(data), err)
		}
	}
}
