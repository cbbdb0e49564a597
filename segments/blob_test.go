package segments

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/klauspost/compress/zstd"
)

func newTestCodec(tb testing.TB) *Codec {
	tb.Helper()
	c, err := NewCodec()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c
}

// randBytes is n deterministic incompressible bytes.
func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x5eed))
	b := make([]byte, n)
	for i := 0; i < n; i += 8 {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], r.Uint64())
		copy(b[i:], w[:])
	}
	return b
}

// textBytes is n deterministic compressible bytes.
func textBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 7))
	words := []string{"agent ", "state ", "checkpoint ", "segment ", "blob ", "tree ", "{\"role\":\"user\"} ", "\n"}
	var b bytes.Buffer
	for b.Len() < n {
		b.WriteString(words[r.IntN(len(words))])
	}
	return b.Bytes()[:n]
}

func TestCodecRoundtrip(t *testing.T) {
	c := newTestCodec(t)
	tests := []struct {
		name      string
		plain     []byte
		wantCodec byte
	}{
		{"empty", nil, codecRaw},
		{"one byte", []byte{42}, codecRaw},
		{"short text", []byte("hello"), codecRaw},
		{"text 10 KiB", textBytes(1, 10<<10), codecZstd},
		{"random 64 KiB", randBytes(2, 64<<10), codecRaw},
		{"zeros 4 MiB", make([]byte, 4<<20), codecZstd},
		{"random 1 MiB + text", append(randBytes(3, 1<<20), textBytes(4, 1<<20)...), codecZstd},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, rec := c.Encode(tt.plain)
			if id != Sum(tt.plain) {
				t.Fatalf("id %s, want SHA-256 %s", id, Sum(tt.plain))
			}
			if rec[1] != tt.wantCodec {
				t.Errorf("codec %d, want %d (record %d bytes for %d plaintext)", rec[1], tt.wantCodec, len(rec), len(tt.plain))
			}
			if max := maxRecordLen(int64(len(tt.plain))); int64(len(rec)) > max {
				t.Errorf("record is %d bytes, more than the %d bound", len(rec), max)
			}
			for _, maxSize := range []int64{int64(len(tt.plain)), -1, MaxBlobSize} {
				got, err := c.Decode(rec, id, maxSize)
				if err != nil {
					t.Fatalf("Decode(maxSize %d): %v", maxSize, err)
				}
				if !bytes.Equal(got, tt.plain) {
					t.Fatalf("Decode(maxSize %d) returned different bytes", maxSize)
				}
			}
			if len(tt.plain) > 0 {
				_, err := c.Decode(rec, id, int64(len(tt.plain))-1)
				if !errors.Is(err, ErrCorrupt) {
					t.Errorf("Decode with maxSize one below the size: %v, want ErrCorrupt", err)
				}
			}
		})
	}
}

func TestEncodeRefusesOversizedBlob(t *testing.T) {
	c := newTestCodec(t)
	defer func() {
		if recover() == nil {
			t.Fatal("Encode of MaxBlobSize+1 bytes did not panic")
		}
	}()
	c.Encode(make([]byte, MaxBlobSize+1))
}

// record builds a record by hand, to reach checks Encode never trips.
func record(version, codec byte, size uint64, xxh uint64, payload []byte) []byte {
	r := []byte{version, codec}
	r = binary.AppendUvarint(r, size)
	r = binary.LittleEndian.AppendUint64(r, xxh)
	return append(r, payload...)
}

func TestDecodeRejects(t *testing.T) {
	c := newTestCodec(t)
	plain := textBytes(9, 20<<10)
	id, zrec := c.Encode(plain)
	if zrec[1] != codecZstd {
		t.Fatal("test wants a zstd record")
	}
	raw := []byte("a raw record payload")
	rid, rrec := c.Encode(raw)
	xxh := xxhash.Sum64(raw)
	tests := []struct {
		name    string
		record  []byte
		want    ID
		maxSize int64
	}{
		{"empty record", nil, rid, -1},
		{"truncated header", rrec[:5], rid, -1},
		{"bad version", record(2, codecRaw, uint64(len(raw)), xxh, raw), rid, -1},
		{"bad codec", record(1, 7, uint64(len(raw)), xxh, raw), rid, -1},
		{"non-minimal varint", append([]byte{1, 0, 0x80 | byte(len(raw)), 0}, rrec[3:]...), rid, -1},
		{"varint overflow", append([]byte{1, 0}, bytes.Repeat([]byte{0xff}, 11)...), rid, -1},
		{"raw payload short", rrec[:len(rrec)-1], rid, -1},
		{"raw payload long", append(bytes.Clone(rrec), 0), rid, -1},
		{"raw declares more", record(1, codecRaw, uint64(len(raw))+1, xxh, raw), rid, -1},
		{"xxhash mismatch", record(1, codecRaw, uint64(len(raw)), xxh^1, raw), rid, -1},
		{"wrong blob id", rrec, id, -1},
		{"above maxSize", rrec, rid, int64(len(raw)) - 1},
		{"zero maxSize", rrec, rid, 0},
		{"above MaxBlobSize", record(1, codecRaw, MaxBlobSize+1, 0, nil), rid, -1},
		{"zstd declared empty", record(1, codecZstd, 0, xxhash.Sum64(nil), zrec[len(zrec)-4:]), Sum(nil), -1},
		{"zstd payload not smaller", record(1, codecZstd, 4, 0, []byte{1, 2, 3, 4}), rid, -1},
		{"zstd truncated", zrec[:len(zrec)-3], id, -1},
		{"zstd garbage", record(1, codecZstd, 1000, 0, bytes.Repeat([]byte{0xab}, 100)), id, -1},
		{"zstd declares less", record(1, codecZstd, uint64(len(plain))-1, xxhash.Sum64(plain), zrec[recordHeaderLen(int64(len(plain))):]), id, -1},
		{"zstd declares more", record(1, codecZstd, uint64(len(plain))+1, xxhash.Sum64(plain), zrec[recordHeaderLen(int64(len(plain))):]), id, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Decode(tt.record, tt.want, tt.maxSize)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Decode = %d bytes, %v; want ErrCorrupt", len(got), err)
			}
			if !strings.Contains(err.Error(), tt.want.String()) {
				t.Errorf("error %q does not name blob %s", err, tt.want)
			}
		})
	}
}

// TestDecodeEveryByte flips every bit of a raw and a zstd record, and
// truncates them at every length. Decode must never return wrong bytes.
// Every change to the header or to a raw payload is ErrCorrupt. A zstd
// payload has a few bits its decoder ignores (the frame header's unused
// bit, padding in entropy tables): flipping one yields the very same
// plaintext, which Decode rightly returns, since that plaintext passes
// SHA-256; ParseSegment's SHA-256 of the whole segment catches those too
// (TestSegmentEveryByteCorrupt).
func TestDecodeEveryByte(t *testing.T) {
	c := newTestCodec(t)
	for _, plain := range [][]byte{randBytes(5, 300), textBytes(6, 3000)} {
		id, rec := c.Encode(plain)
		hdr := int(recordHeaderLen(int64(len(plain))))
		harmless := 0
		for i := range rec {
			for bit := range 8 {
				bad := bytes.Clone(rec)
				bad[i] ^= 1 << bit
				got, err := c.Decode(bad, id, int64(len(plain)))
				switch {
				case errors.Is(err, ErrCorrupt):
				case err != nil:
					t.Fatalf("codec %d: byte %d bit %d: %v, want ErrCorrupt", rec[1], i, bit, err)
				case rec[1] == codecRaw || i < hdr:
					t.Fatalf("codec %d: byte %d bit %d of the header or raw payload not detected", rec[1], i, bit)
				case !bytes.Equal(got, plain):
					t.Fatalf("codec %d: byte %d bit %d: Decode returned wrong bytes", rec[1], i, bit)
				default:
					harmless++
				}
			}
		}
		t.Logf("codec %d: %d of %d bit flips left the plaintext unchanged", rec[1], harmless, 8*len(rec))
		for n := range len(rec) {
			if _, err := c.Decode(rec[:n], id, -1); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("codec %d: truncated to %d of %d: %v, want ErrCorrupt", rec[1], n, len(rec), err)
			}
		}
	}
}

// rleFrame hand-builds a zstd frame of RLE blocks that decompresses to
// total bytes of 'A' from about total/32768 bytes, without ever holding the
// plaintext. With fcs the frame header declares the content size.
func rleFrame(total int64, fcs bool) []byte {
	b := []byte{0x28, 0xb5, 0x2f, 0xfd} // magic
	if fcs {
		// Frame_Header_Descriptor: 4-byte content size; window 128 KiB.
		b = append(b, 0x80, 0x38)
		b = binary.LittleEndian.AppendUint32(b, uint32(total))
	} else {
		b = append(b, 0x00, 0x38)
	}
	for rem := total; rem > 0; {
		n := min(rem, 128<<10)
		rem -= n
		hdr := uint32(n)<<3 | 1<<1 // RLE block
		if rem == 0 {
			hdr |= 1 // last block
		}
		b = append(b, byte(hdr), byte(hdr>>8), byte(hdr>>16), 'A')
	}
	return b
}

func TestRLEFrameIsValidZstd(t *testing.T) {
	d, err := zstd.NewReader(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for _, fcs := range []bool{false, true} {
		got, err := d.DecodeAll(rleFrame(300<<10, fcs), nil)
		if err != nil || !bytes.Equal(got, bytes.Repeat([]byte{'A'}, 300<<10)) {
			t.Fatalf("fcs %v: %d bytes, %v", fcs, len(got), err)
		}
	}
}

// TestDecodeBomb feeds records whose payload decompresses to 1 GiB: each
// must fail with ErrCorrupt having allocated little, never the gigabyte.
func TestDecodeBomb(t *testing.T) {
	c := newTestCodec(t)
	const gib = 1 << 30
	bombNoFCS, bombFCS := rleFrame(gib, false), rleFrame(gib, true)
	tests := []struct {
		name     string
		record   []byte
		maxSize  int64
		maxAlloc uint64
		wantMsg  string
	}{
		// The brief's case: caught by the header, since a zstd payload is
		// always smaller than its plaintext.
		{"declares 1 KiB, no content size", record(1, codecZstd, 1<<10, 0, bombNoFCS), -1, 1 << 20, "cannot hold"},
		{"declares 1 KiB, content size 1 GiB", record(1, codecZstd, 1<<10, 0, bombFCS), -1, 1 << 20, "cannot hold"},
		// Declared above the payload, so it reaches the decompressor, which
		// must stop at the declared length.
		{"declares 1 KiB, 902-byte payload of 28 MiB", record(1, codecZstd, 1<<10, 0, rleFrame(28<<20, false)), -1, 1 << 20, "decompress"},
		{"declares 1 MiB, no content size", record(1, codecZstd, 1<<20, 0, bombNoFCS), -1, 4 << 20, "decompress"},
		{"declares 1 MiB, content size 1 GiB", record(1, codecZstd, 1<<20, 0, bombFCS), -1, 4 << 20, "decompress"},
		{"declares 1 MiB, ref allows 1 KiB", record(1, codecZstd, 1<<20, 0, bombNoFCS), 1 << 10, 1 << 20, "expected"},
		{"declares MaxBlobSize+1", record(1, codecZstd, MaxBlobSize+1, 0, bombFCS), -1, 1 << 20, "MaxBlobSize"},
		{"declares 1 GiB", record(1, codecZstd, gib, 0, bombFCS), -1, 1 << 20, "MaxBlobSize"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			got, err := c.Decode(tt.record, ID{1}, tt.maxSize)
			runtime.ReadMemStats(&after)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Decode = %d bytes, %v; want ErrCorrupt", len(got), err)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q, want it to mention %q", err, tt.wantMsg)
			}
			alloc := after.TotalAlloc - before.TotalAlloc
			if alloc > tt.maxAlloc {
				t.Errorf("Decode allocated %d bytes, want at most %d", alloc, tt.maxAlloc)
			}
			t.Logf("rejected after allocating %d KiB: %v", alloc>>10, err)
		})
	}
}

func FuzzDecode(f *testing.F) {
	c := newTestCodec(f)
	for i, plain := range [][]byte{nil, []byte("x"), textBytes(1, 5000), randBytes(2, 500), make([]byte, 70000)} {
		_, rec := c.Encode(plain)
		f.Add(rec, int64(len(plain)))
		f.Add(rec, int64(-1))
		f.Add(rec[:len(rec)/2], int64(i))
	}
	f.Add(record(1, codecZstd, 1<<16, 0, rleFrame(1<<20, false)), int64(-1))
	f.Add(record(1, codecZstd, 1<<16, 0, rleFrame(1<<20, true)), int64(-1))
	f.Fuzz(func(t *testing.T, rec []byte, maxSize int64) {
		// Decode may allocate up to the declared size, which is what the
		// caller allows (a Ref's Size): keep that small so the fuzzer runs
		// fast. The MaxBlobSize ceiling has its own tests.
		if maxSize < 0 || maxSize > 1<<20 {
			maxSize = 1 << 20
		}
		// A random record essentially never matches a random id: every
		// success would be a hash collision.
		if p, err := c.Decode(rec, ID{}, maxSize); err == nil {
			t.Fatalf("decoded %d bytes as the zero id", len(p))
		} else if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("error %v does not wrap ErrCorrupt", err)
		}
		// Past the header and the decompressor, the only thing left to
		// fail is the hashes: with the right ones it must succeed, and
		// never exceed the limits.
		h, err := parseRecordHeader(rec, maxSize)
		if err != nil {
			return
		}
		var plain []byte
		switch h.codec {
		case codecRaw:
			plain = rec[h.headerLen:]
		case codecZstd:
			plain, err = c.dec.DecodeAll(rec[h.headerLen:], make([]byte, 0, h.size))
			if err != nil || int64(len(plain)) != h.size {
				return
			}
		}
		if int64(len(plain)) > MaxBlobSize || (maxSize >= 0 && int64(len(plain)) > maxSize) {
			t.Fatalf("header accepted %d bytes beyond the limits (maxSize %d)", len(plain), maxSize)
		}
		got, err := c.Decode(rec, Sum(plain), maxSize)
		if xxhash.Sum64(plain) != h.xxh {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("xxhash mismatch not reported: %v", err)
			}
			return
		}
		if err != nil || !bytes.Equal(got, plain) {
			t.Fatalf("valid record rejected: %v", err)
		}
		// What decodes re-encodes to a record that decodes the same.
		id2, rec2 := c.Encode(got)
		if back, err := c.Decode(rec2, id2, int64(len(got))); err != nil || !bytes.Equal(back, got) {
			t.Fatalf("re-encoded record does not round-trip: %v", err)
		}
	})
}

// TestCodecConcurrent shares one Codec between goroutines, as restore and
// checkpoint do (run with -race).
func TestCodecConcurrent(t *testing.T) {
	c := newTestCodec(t)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 20 {
				plain := textBytes(uint64(g*100+i), 1000+i*500)
				id, rec := c.Encode(plain)
				got, err := c.Decode(rec, id, int64(len(plain)))
				if err != nil || !bytes.Equal(got, plain) {
					t.Errorf("goroutine %d blob %d: %v", g, i, err)
					return
				}
			}
		})
	}
	wg.Wait()
}
