package segments

import (
	"errors"
	"fmt"
	"io"
	"math/bits"
)

// ChunkParams configure content-defined chunking. Chunks are at least Min
// bytes (except the last of a stream), at most Max, and Avg on average.
// Seed derives the gear table: it is per repository (kept in the
// repository config), so the same content chunks the same way within a
// repository, where it deduplicates, but chunk boundaries do not
// fingerprint content across repositories.
type ChunkParams struct {
	Min, Avg, Max int
	Seed          uint64
}

// DefaultChunkParams are 64 KiB / 256 KiB / 1 MiB (seed 0: set Seed from
// the repository config). Measured on a 64 MiB file (BenchmarkChunkEdits,
// mean of 4 edit positions), re-uploaded bytes for 256 KiB / 1 MiB /
// 4 MiB average chunks: 100 bytes inserted 311 KiB / 1.1 MiB / 5.6 MiB,
// 1 KiB appended 121 KiB / 857 KiB / 3.2 MiB, 1 MiB overwritten 1.6 / 2.8 /
// 8.3 MiB, 8 scattered 4 KiB pages 3.0 / 10.9 / 40 MiB. An edit costs about
// one to two average chunks, so with a checkpoint every 15 s the average
// is what every small change pays. The price of 256 KiB over 1 MiB is 4×
// the refs in trees and the local index (about 4000 for a 1 GiB file) and
// about 6% more compressed bytes on a first upload of source-like text
// (zstd sees less context): both smaller than a 4× cheaper edit. Max at
// 4×Avg leaves normalized chunking room (forced cuts at Max are rare) and
// keeps the chunker's memory, its one buffer, at 1 MiB.
var DefaultChunkParams = ChunkParams{Min: 64 << 10, Avg: 256 << 10, Max: 1 << 20}

// Validate reports whether p can be used: 64 ≤ Min ≤ Avg ≤ Max ≤
// MaxBlobSize, with Min < Avg < Max so normalization has room.
func (p ChunkParams) Validate() error {
	switch {
	case p.Min < 64:
		return fmt.Errorf("chunk params: min %d is below 64 bytes", p.Min)
	case p.Avg <= p.Min || p.Max <= p.Avg:
		return fmt.Errorf("chunk params: want min < avg < max, have %d, %d, %d", p.Min, p.Avg, p.Max)
	case p.Max > MaxBlobSize:
		return fmt.Errorf("chunk params: max %d exceeds MaxBlobSize %d", p.Max, MaxBlobSize)
	}
	return nil
}

// Chunker splits a stream into content-defined chunks, FastCDC style: a
// gear rolling hash (fp = fp<<1 + gear[b]) is tested against a mask of
// its top bits, so a cut depends on the last 64 bytes only and an edit
// moves boundaries only near it. With normalized chunking (level 2) the
// mask has two more bits than log2(Avg) before Avg (cuts are rare) and two
// fewer after (cuts come soon), which narrows the size distribution around
// Avg. Hashing starts Min bytes into each chunk, which is also why the
// chunker is fast: those bytes are skipped.
//
// A Chunker uses one buffer of Max bytes, however long the stream.
type Chunker struct {
	r            io.Reader
	p            ChunkParams
	maskS, maskL uint64
	gear         [256]uint64

	buf        []byte // buf[start:end] is read but not yet returned
	start, end int
	eof        bool
	err        error
}

// NewChunker returns a Chunker reading r. Invalid params make Next fail.
func NewChunker(r io.Reader, p ChunkParams) *Chunker {
	c := &Chunker{r: r, p: p}
	if err := p.Validate(); err != nil {
		c.err = err
		return c
	}
	// Round log2(Avg) to the nearest integer: the masks are powers of two.
	avgBits := bits.Len(uint(p.Avg)) - 1
	if p.Avg-1<<avgBits > 1<<avgBits/2 {
		avgBits++
	}
	c.maskS = topBits(avgBits + 2)
	c.maskL = topBits(max(avgBits-2, 1))
	c.gear = gearTable(p.Seed)
	c.buf = make([]byte, p.Max)
	return c
}

func topBits(n int) uint64 { return ^uint64(0) << (64 - n) }

// gearTable derives the 256 gear values from seed with splitmix64, whose
// outputs are equidistributed 64-bit values for any seed.
func gearTable(seed uint64) [256]uint64 {
	var g [256]uint64
	s := seed
	for i := range g {
		s += 0x9e3779b97f4a7c15
		z := s
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		g[i] = z ^ z>>31
	}
	return g
}

// Next returns the next chunk, or io.EOF after the last. The chunk is valid
// only until the next call. A read error other than io.EOF is returned as
// is, and again on every later call.
func (c *Chunker) Next() ([]byte, error) {
	if c.err != nil {
		return nil, c.err
	}
	if !c.eof && c.end-c.start < c.p.Max {
		// Keep the unreturned tail and fill the buffer behind it, so a cut
		// can look up to Max bytes ahead.
		c.end = copy(c.buf, c.buf[c.start:c.end])
		c.start = 0
		n, err := io.ReadFull(c.r, c.buf[c.end:])
		c.end += n
		switch {
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			c.eof = true
		case err != nil:
			c.err = err
			return nil, err
		}
	}
	if c.start == c.end {
		c.err = io.EOF
		return nil, io.EOF
	}
	data := c.buf[c.start:c.end]
	n := c.cut(data)
	c.start += n
	return data[:n:n], nil
}

// cut returns the length of the chunk at the start of data, which holds
// Max bytes unless the stream ends sooner.
func (c *Chunker) cut(data []byte) int {
	n := len(data)
	if n <= c.p.Min {
		return n
	}
	// Locals and range loops let the compiler drop every bounds check:
	// this loop is the chunker's whole cost.
	gear := &c.gear
	maskS, maskL := c.maskS, c.maskL
	lo, normal := c.p.Min, min(n, c.p.Avg)
	var fp uint64
	for i, b := range data[lo:normal] {
		fp = fp<<1 + gear[b]
		if fp&maskS == 0 {
			return lo + i + 1
		}
	}
	for i, b := range data[normal:] {
		fp = fp<<1 + gear[b]
		if fp&maskL == 0 {
			return normal + i + 1
		}
	}
	return n
}

// FixedChunker splits a stream into blocks of one size (the last may be
// shorter). It is for files written in place at fixed offsets, SQLite
// databases above all: a block aligned to the page size changes only when
// one of its pages does, where content-defined boundaries would shift.
type FixedChunker struct {
	r   io.Reader
	buf []byte
	err error
}

// NewFixedChunker returns a FixedChunker of size-byte blocks reading r.
func NewFixedChunker(r io.Reader, size int) *FixedChunker {
	if size <= 0 || size > MaxBlobSize {
		return &FixedChunker{err: fmt.Errorf("fixed chunk size %d out of range", size)}
	}
	return &FixedChunker{r: r, buf: make([]byte, size)}
}

// Next returns the next block (valid until the next call), or io.EOF.
func (c *FixedChunker) Next() ([]byte, error) {
	if c.err != nil {
		return nil, c.err
	}
	n, err := io.ReadFull(c.r, c.buf)
	switch {
	case err == io.ErrUnexpectedEOF || (err == io.EOF && n > 0):
		c.err = io.EOF
		return c.buf[:n], nil
	case err != nil:
		c.err = err
		return nil, err
	}
	return c.buf[:n], nil
}
