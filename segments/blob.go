package segments

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cespare/xxhash/v2"
	"github.com/klauspost/compress/zstd"
)

// ErrCorrupt marks data read back from the store that fails verification: a
// record, trailer or segment whose structure, length or hash is wrong.
// Test with errors.Is.
var ErrCorrupt = errors.New("corrupt data")

// MaxBlobSize is the largest plaintext a blob may have. Decode refuses
// anything larger whatever a record declares, so one bad record can never
// make a reader allocate more than this. Chunks (at most ChunkParams.Max),
// transcript line segments and trees must all stay below it.
const MaxBlobSize = 64 << 20

const (
	recordVersion = 1

	codecRaw  = 0
	codecZstd = 1

	// minRecordLen is version + codec + a one-byte length + xxhash64.
	minRecordLen = 1 + 1 + 1 + 8

	// maxZstdRatio bounds how much plaintext one payload byte can yield:
	// a zstd RLE block is a 3-byte header plus 1 byte and regenerates at
	// most 128 KiB. A record declaring more than this per payload byte is
	// corrupt, and is rejected before anything is allocated for it.
	maxZstdRatio = (128 << 10) / 4
)

// recordHeaderLen is the length of a record header for a plaintext of size
// bytes.
func recordHeaderLen(size int64) int64 {
	return 2 + int64(uvarintLen(uint64(size))) + 8
}

// maxRecordLen is the longest record a plaintext of size bytes can have:
// the encoder stores raw whenever zstd would not be strictly smaller.
func maxRecordLen(size int64) int64 { return recordHeaderLen(size) + size }

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// Codec encodes and decodes blob records. It holds one zstd encoder and one
// decoder, reused for every blob (building them is expensive); EncodeAll and
// DecodeAll are safe for concurrent use, so one Codec serves all goroutines.
type Codec struct {
	enc *zstd.Encoder
	dec *zstd.Decoder
}

// NewCodec returns a Codec ready for concurrent use.
func NewCodec() (*Codec, error) {
	enc, err := zstd.NewWriter(nil,
		zstd.WithEncoderLevel(zstd.SpeedDefault),
		// The record carries its own xxhash64 and the id its SHA-256;
		// zstd's 32-bit checksum would add 4 bytes and nothing else.
		zstd.WithEncoderCRC(false),
	)
	if err != nil {
		return nil, fmt.Errorf("create zstd encoder: %w", err)
	}
	dec, err := zstd.NewReader(nil,
		// Restores decode in parallel: one block decoder per CPU.
		zstd.WithDecoderConcurrency(0),
		// Hard ceiling for any DecodeAll, whatever a frame header claims.
		zstd.WithDecoderMaxMemory(MaxBlobSize),
		// Decode passes a destination whose capacity is exactly the
		// declared plaintext length; with this option that capacity is the
		// output limit, so a bomb stops at the declared length.
		zstd.WithDecodeAllCapLimit(true),
	)
	if err != nil {
		enc.Close()
		return nil, fmt.Errorf("create zstd decoder: %w", err)
	}
	return &Codec{enc: enc, dec: dec}, nil
}

// Close releases the zstd encoder and decoder. The Codec must not be used
// afterwards.
func (c *Codec) Close() {
	c.enc.Close()
	c.dec.Close()
}

// Encode returns the id (SHA-256) of plain and its record. The record is
// zstd-compressed when that makes it strictly smaller, raw otherwise.
//
// plain must not exceed MaxBlobSize: such a blob could never be read back,
// so Encode panics rather than let it be written.
func (c *Codec) Encode(plain []byte) (id ID, record []byte) {
	size := int64(len(plain))
	if size > MaxBlobSize {
		panic(fmt.Sprintf("segments: Encode of %d bytes exceeds MaxBlobSize %d", size, MaxBlobSize))
	}
	id = Sum(plain)
	hdr := recordHeaderLen(size)
	// Sized for the raw record: if zstd needs more, raw wins anyway.
	record = make([]byte, hdr, hdr+size)
	record[0] = recordVersion
	n := binary.PutUvarint(record[2:], uint64(size))
	binary.LittleEndian.PutUint64(record[2+n:], xxhash.Sum64(plain))

	out := c.enc.EncodeAll(plain, record)
	if int64(len(out))-hdr < size {
		out[1] = codecZstd
		return id, out
	}
	// record's own storage (hdr+size) holds the raw record whether or not
	// EncodeAll had to grow into a new buffer; the header is untouched.
	record = append(record[:hdr], plain...)
	record[1] = codecRaw
	return id, record
}

// Decode verifies record and returns its plaintext, which must be the blob
// want. It refuses a declared plaintext length above maxSize (a negative
// maxSize means no limit but MaxBlobSize) and above MaxBlobSize before
// allocating anything, decompresses into a buffer of exactly the declared
// length (a zstd bomb stops there), then checks the length, the xxhash64
// and the SHA-256. Every failure wraps ErrCorrupt and names the blob.
func (c *Codec) Decode(record []byte, want ID, maxSize int64) ([]byte, error) {
	return c.decode(nil, record, want, maxSize)
}

// decode is Decode into dst's storage when it is large enough, so a reader
// of many blobs can reuse one buffer.
func (c *Codec) decode(dst, record []byte, want ID, maxSize int64) ([]byte, error) {
	h, err := parseRecordHeader(record, maxSize)
	if err != nil {
		return nil, fmt.Errorf("decode blob %s: %w", want, err)
	}
	payload := record[h.headerLen:]
	var plain []byte
	if int64(cap(dst)) >= h.size {
		// The full slice expression makes the capacity exactly the
		// declared length, which is the zstd output limit.
		plain = dst[:0:h.size]
	} else {
		plain = make([]byte, 0, h.size)
	}
	switch h.codec {
	case codecRaw:
		plain = append(plain, payload...)
	case codecZstd:
		plain, err = c.dec.DecodeAll(payload, plain)
		if err != nil {
			return nil, fmt.Errorf("decode blob %s: decompress %d-byte zstd payload declared as %d bytes: %v: %w",
				want, len(payload), h.size, err, ErrCorrupt)
		}
	}
	if int64(len(plain)) != h.size {
		return nil, fmt.Errorf("decode blob %s: plaintext is %d bytes, record declares %d: %w",
			want, len(plain), h.size, ErrCorrupt)
	}
	if got := xxhash.Sum64(plain); got != h.xxh {
		return nil, fmt.Errorf("decode blob %s: xxhash64 %016x, record declares %016x: %w",
			want, got, h.xxh, ErrCorrupt)
	}
	if got := Sum(plain); got != want {
		return nil, fmt.Errorf("decode blob %s: plaintext has SHA-256 %s: %w", want, got, ErrCorrupt)
	}
	return plain, nil
}

type recordHeader struct {
	codec     byte
	size      int64
	xxh       uint64
	headerLen int
}

// parseRecordHeader checks everything about a record that can be checked
// without decompressing it. Its errors wrap ErrCorrupt.
func parseRecordHeader(record []byte, maxSize int64) (recordHeader, error) {
	var h recordHeader
	if len(record) < minRecordLen {
		return h, fmt.Errorf("record of %d bytes is shorter than a header: %w", len(record), ErrCorrupt)
	}
	if record[0] != recordVersion {
		return h, fmt.Errorf("record version %d, want %d: %w", record[0], recordVersion, ErrCorrupt)
	}
	h.codec = record[1]
	if h.codec != codecRaw && h.codec != codecZstd {
		return h, fmt.Errorf("unknown record codec %d: %w", h.codec, ErrCorrupt)
	}
	v, n := binary.Uvarint(record[2:])
	if n <= 0 || n != uvarintLen(v) {
		return h, fmt.Errorf("record plaintext length is not a minimal varint: %w", ErrCorrupt)
	}
	if v > MaxBlobSize {
		return h, fmt.Errorf("record declares %d plaintext bytes, more than MaxBlobSize %d: %w", v, MaxBlobSize, ErrCorrupt)
	}
	h.size = int64(v)
	if maxSize >= 0 && h.size > maxSize {
		return h, fmt.Errorf("record declares %d plaintext bytes, more than the %d expected: %w", h.size, maxSize, ErrCorrupt)
	}
	h.headerLen = 2 + n + 8
	if len(record) < h.headerLen {
		return h, fmt.Errorf("record of %d bytes is shorter than its %d-byte header: %w", len(record), h.headerLen, ErrCorrupt)
	}
	h.xxh = binary.LittleEndian.Uint64(record[2+n:])
	payload := int64(len(record) - h.headerLen)
	switch h.codec {
	case codecRaw:
		if payload != h.size {
			return h, fmt.Errorf("raw record payload is %d bytes, declares %d: %w", payload, h.size, ErrCorrupt)
		}
	case codecZstd:
		// The encoder only chooses zstd when it is strictly smaller.
		if payload >= h.size || h.size > payload*maxZstdRatio {
			return h, fmt.Errorf("zstd record payload of %d bytes cannot hold %d plaintext bytes: %w", payload, h.size, ErrCorrupt)
		}
	}
	return h, nil
}
