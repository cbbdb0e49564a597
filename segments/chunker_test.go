package segments

import (
	"bytes"
	"errors"
	"io"
	"runtime"
	"slices"
	"testing"
	"testing/iotest"
)

// smallParams keep chunk-level tests fast while exercising the same code.
var smallParams = ChunkParams{Min: 2 << 10, Avg: 8 << 10, Max: 32 << 10, Seed: 42}

// chunkLens chunks r and returns the chunk lengths, checking on the way
// that the chunks concatenate to want (if not nil).
func chunkLens(tb testing.TB, r io.Reader, p ChunkParams, want []byte) []int {
	tb.Helper()
	c := NewChunker(r, p)
	var lens []int
	pos := 0
	for {
		chunk, err := c.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			tb.Fatal(err)
		}
		if want != nil && !bytes.Equal(chunk, want[pos:pos+len(chunk)]) {
			tb.Fatalf("chunk %d at %d differs from the input", len(lens), pos)
		}
		pos += len(chunk)
		lens = append(lens, len(chunk))
	}
	if want != nil && pos != len(want) {
		tb.Fatalf("chunks add up to %d bytes, input is %d", pos, len(want))
	}
	if _, err := c.Next(); err != io.EOF {
		tb.Fatalf("Next after the end = %v, want io.EOF again", err)
	}
	return lens
}

func TestChunkParamsValidate(t *testing.T) {
	tests := []struct {
		p  ChunkParams
		ok bool
	}{
		{DefaultChunkParams, true},
		{smallParams, true},
		{ChunkParams{Min: 64, Avg: 128, Max: 256}, true},
		{ChunkParams{Min: 63, Avg: 128, Max: 256}, false},
		{ChunkParams{Min: 128, Avg: 128, Max: 256}, false},
		{ChunkParams{Min: 64, Avg: 256, Max: 256}, false},
		{ChunkParams{Min: 1 << 20, Avg: 2 << 20, Max: MaxBlobSize + 1}, false},
		{ChunkParams{}, false},
	}
	for _, tt := range tests {
		if err := tt.p.Validate(); (err == nil) != tt.ok {
			t.Errorf("%+v: Validate = %v, want ok %v", tt.p, err, tt.ok)
		}
	}
	if _, err := NewChunker(bytes.NewReader(nil), ChunkParams{}).Next(); err == nil || err == io.EOF {
		t.Errorf("Next with invalid params = %v", err)
	}
}

func TestChunker(t *testing.T) {
	for _, p := range []ChunkParams{smallParams, DefaultChunkParams} {
		for _, n := range []int{0, 1, p.Min - 1, p.Min, p.Min + 1, p.Max - 1, p.Max, p.Max + 1, 3*p.Max + 12345} {
			data := randBytes(uint64(n), n)
			lens := chunkLens(t, bytes.NewReader(data), p, data)
			for i, l := range lens {
				if l > p.Max || l < 1 || (l < p.Min && i != len(lens)-1) {
					t.Fatalf("params %+v, input %d: chunk %d is %d bytes", p, n, i, l)
				}
			}
			// Deterministic, and independent of how the reader splits reads.
			readers := []io.Reader{bytes.NewReader(data), iotest.HalfReader(bytes.NewReader(data))}
			if n <= 100000 {
				readers = append(readers, iotest.OneByteReader(bytes.NewReader(data)))
			}
			for _, r := range readers {
				if got := chunkLens(t, r, p, nil); !slices.Equal(got, lens) {
					t.Fatalf("params %+v, input %d: boundaries depend on the reader", p, n)
				}
			}
		}
	}
}

func TestChunkerDistribution(t *testing.T) {
	n := 16 << 20
	if raceEnabled {
		n = 4 << 20
	}
	data := randBytes(1, n)
	lens := chunkLens(t, bytes.NewReader(data), smallParams, data)
	mean := float64(n) / float64(len(lens))
	atMax := 0
	for _, l := range lens[:len(lens)-1] {
		if l == smallParams.Max {
			atMax++
		}
	}
	t.Logf("%d chunks, mean %.0f (avg %d), %d forced at max", len(lens), mean, smallParams.Avg, atMax)
	if mean < 0.8*float64(smallParams.Avg) || mean > 1.4*float64(smallParams.Avg) {
		t.Errorf("mean chunk %.0f bytes, want near %d", mean, smallParams.Avg)
	}
	// Normalized chunking makes a forced cut at Max rare.
	if float64(atMax) > 0.01*float64(len(lens)) {
		t.Errorf("%d of %d chunks cut at max", atMax, len(lens))
	}
}

func TestChunkerSeed(t *testing.T) {
	data := randBytes(2, 2<<20)
	a := chunkLens(t, bytes.NewReader(data), smallParams, data)
	p := smallParams
	p.Seed++
	b := chunkLens(t, bytes.NewReader(data), p, data)
	if slices.Equal(a, b) {
		t.Fatal("another seed cut the same boundaries")
	}
	if gearTable(1) == gearTable(2) {
		t.Fatal("gear tables of different seeds are equal")
	}
}

// TestChunkerEditLocality: an edit changes only the chunks around it.
func TestChunkerEditLocality(t *testing.T) {
	data := randBytes(3, 4<<20)
	mid := len(data) / 2
	edits := []struct {
		name string
		data []byte
	}{
		{"insert 100 bytes", slices.Concat(data[:mid], randBytes(4, 100), data[mid:])},
		{"delete 100 bytes", slices.Concat(data[:mid], data[mid+100:])},
		{"overwrite 1 KiB", slices.Concat(data[:mid], randBytes(5, 1024), data[mid+1024:])},
		{"append 1 KiB", slices.Concat(data, randBytes(6, 1024))},
	}
	for _, e := range edits {
		t.Run(e.name, func(t *testing.T) {
			if got, limit := newBytes(t, chunkSet(t, data, cdcChunks(smallParams)), e.data, cdcChunks(smallParams)), 3*smallParams.Max; got > limit {
				t.Fatalf("%d new bytes, want at most %d", got, limit)
			}
		})
	}
}

func TestChunkerReadError(t *testing.T) {
	boom := errors.New("boom")
	data := randBytes(7, 100<<10)
	c := NewChunker(io.MultiReader(bytes.NewReader(data), iotest.ErrReader(boom)), smallParams)
	var err error
	for err == nil {
		_, err = c.Next()
	}
	if !errors.Is(err, boom) {
		t.Fatalf("Next = %v, want the read error", err)
	}
	if _, err := c.Next(); !errors.Is(err, boom) {
		t.Fatalf("Next after the error = %v, want it again", err)
	}
}

// genReader yields n pseudo-random bytes without holding them.
type genReader struct {
	n, off int64
	s      uint64
}

func (g *genReader) Read(p []byte) (int, error) {
	if g.off >= g.n {
		return 0, io.EOF
	}
	p = p[:min(int64(len(p)), g.n-g.off)]
	for i := range p {
		if i&7 == 0 {
			g.s ^= g.s << 13 // xorshift64
			g.s ^= g.s >> 7
			g.s ^= g.s << 17
		}
		p[i] = byte(g.s >> (8 * (i & 7)))
	}
	g.off += int64(len(p))
	return len(p), nil
}

// TestChunkerBoundedMemory chunks 2 GiB (128 MiB under the race detector)
// with DefaultChunkParams: the chunker's whole footprint must be its one
// Max-sized buffer, whatever the input length.
func TestChunkerBoundedMemory(t *testing.T) {
	n := int64(2 << 30)
	if raceEnabled || testing.Short() {
		n = 128 << 20
	}
	p := DefaultChunkParams
	r := &genReader{n: n, s: 0x9e3779b97f4a7c15}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	c := NewChunker(r, p)
	var total int64
	chunks := 0
	for {
		chunk, err := c.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		total += int64(len(chunk))
		chunks++
	}
	runtime.ReadMemStats(&after)
	if total != n {
		t.Fatalf("chunked %d of %d bytes", total, n)
	}
	alloc := after.TotalAlloc - before.TotalAlloc
	mallocs := after.Mallocs - before.Mallocs
	t.Logf("%d MiB in %d chunks: %d KiB allocated in %d allocations", n>>20, chunks, alloc>>10, mallocs)
	if alloc > uint64(p.Max)+64<<10 || mallocs > 20 {
		t.Fatalf("allocated %d bytes in %d allocations for a %d-byte stream, want about one %d-byte buffer", alloc, mallocs, n, p.Max)
	}
}

func TestChunkerAllocsPerChunk(t *testing.T) {
	data := randBytes(8, 1<<20)
	r := bytes.NewReader(data)
	c := NewChunker(r, smallParams)
	// Steady state: Next allocates nothing.
	allocs := testing.AllocsPerRun(50, func() {
		if _, err := c.Next(); err == io.EOF {
			r.Reset(data)
			c = NewChunker(r, smallParams)
		}
	})
	if allocs > 0.1 {
		t.Fatalf("%.2f allocations per Next", allocs)
	}
}

func TestFixedChunker(t *testing.T) {
	for _, n := range []int{0, 1, 4095, 4096, 4097, 3*4096 + 7} {
		data := bytes.Repeat([]byte{0xab}, n)
		c := NewFixedChunker(bytes.NewReader(data), 4096)
		var got []byte
		for {
			b, err := c.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(b) != 4096 && len(got)+len(b) != n {
				t.Fatalf("n=%d: short block %d before the end", n, len(b))
			}
			got = append(got, b...)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("n=%d: blocks do not concatenate to the input", n)
		}
	}
}
