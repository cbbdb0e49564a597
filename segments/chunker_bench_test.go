package segments

// Measurement behind DefaultChunkParams. Run:
//
//	go test -bench Chunk -run XXX ./segments/
//
// BenchmarkChunkEdits applies typical edits to a 64 MiB pseudo-random file
// and reports, for fixed-size chunking at two sizes and CDC at four, the
// bytes of chunks that are new after the edit (what must be uploaded
// again, before compression) as reupload-KiB (mean over editTrials edit
// positions) and worst-KiB, and the file's chunk count as chunks.
// BenchmarkChunker reports the chunker's throughput, and SHA-256's for
// scale (every chunk is hashed too).

import (
	"bytes"
	"slices"
	"testing"
)

// chunkFunc splits data and returns the chunk lengths.
type chunkFunc func(tb testing.TB, data []byte) []int

func cdcChunks(p ChunkParams) chunkFunc {
	return func(tb testing.TB, data []byte) []int { return chunkLens(tb, bytes.NewReader(data), p, nil) }
}

func fixedChunks(size int) chunkFunc {
	return func(_ testing.TB, data []byte) []int {
		var lens []int
		for off := 0; off < len(data); off += size {
			lens = append(lens, min(size, len(data)-off))
		}
		return lens
	}
}

// chunkSet is the set of chunk ids of data.
func chunkSet(tb testing.TB, data []byte, split chunkFunc) map[ID]bool {
	have := make(map[ID]bool)
	pos := 0
	for _, l := range split(tb, data) {
		have[Sum(data[pos:pos+l])] = true
		pos += l
	}
	return have
}

// newBytes is how many bytes of edited's chunks are not in have (the
// chunks of the original): what a checkpoint after the edit uploads.
func newBytes(tb testing.TB, have map[ID]bool, edited []byte, split chunkFunc) int {
	seen := make(map[ID]bool)
	n, pos := 0, 0
	for _, l := range split(tb, edited) {
		if id := Sum(edited[pos : pos+l]); !have[id] && !seen[id] {
			seen[id] = true
			n += l
		}
		pos += l
	}
	return n
}

type chunker struct {
	name  string
	split chunkFunc
}

func benchChunkers() []chunker {
	p := func(min, avg, max int) ChunkParams { return ChunkParams{Min: min, Avg: avg, Max: max, Seed: 1} }
	return []chunker{
		{"fixed-1MiB", fixedChunks(1 << 20)},
		{"fixed-256KiB", fixedChunks(256 << 10)},
		{"cdc-256KiB", cdcChunks(p(64<<10, 256<<10, 1<<20))},
		{"cdc-512KiB", cdcChunks(p(128<<10, 512<<10, 2<<20))},
		{"cdc-1MiB", cdcChunks(p(256<<10, 1<<20, 4<<20))},
		{"cdc-4MiB", cdcChunks(p(1<<20, 4<<20, 16<<20))},
	}
}

// An edit turns trial t of the original into (base, edited): the file as
// last checkpointed and as it is now. Each is measured at editTrials
// places (or lengths), because what one edit costs depends on where it
// falls relative to the chunk boundaries.
type edit struct {
	name string
	make func(orig []byte, t int) (base, edited []byte)
}

const editTrials = 4

func benchEdits() []edit {
	// Offsets spread over the file, none aligned to any chunk grid.
	at := func(orig []byte, t int) int { return (2*t+1)*len(orig)/(2*editTrials) + 12345*t + 123 }
	return []edit{
		{"insert-100B-middle", func(orig []byte, t int) ([]byte, []byte) {
			off := at(orig, t)
			return orig, slices.Concat(orig[:off], randBytes(uint64(10+t), 100), orig[off:])
		}},
		{"append-1KiB", func(orig []byte, t int) ([]byte, []byte) {
			base := orig[:len(orig)-t*99991] // files end anywhere
			return base, slices.Concat(base, randBytes(uint64(20+t), 1024))
		}},
		{"overwrite-1MiB", func(orig []byte, t int) ([]byte, []byte) {
			off := at(orig, t)
			return orig, slices.Concat(orig[:off], randBytes(uint64(30+t), 1<<20), orig[off+1<<20:])
		}},
		{"overwrite-8x4KiB-pages", func(orig []byte, t int) ([]byte, []byte) {
			// A few scattered SQLite page writes: page-aligned, in place.
			ed := slices.Clone(orig)
			for i := range 8 {
				off := (i*len(orig)/8 + (t*37+i*11+5)*4096) / 4096 * 4096
				copy(ed[off:], randBytes(uint64(100*t+i), 4096))
			}
			return orig, ed
		}},
	}
}

// BenchmarkChunkEdits reports, per chunker and edit, the mean and the
// largest re-upload over editTrials trials, and the file's chunk count.
func BenchmarkChunkEdits(b *testing.B) {
	orig := randBytes(9, 64<<20)
	for _, c := range benchChunkers() {
		sets := map[int]map[ID]bool{} // chunk sets by base length
		set := func(base []byte) map[ID]bool {
			if sets[len(base)] == nil {
				sets[len(base)] = chunkSet(b, base, c.split)
			}
			return sets[len(base)]
		}
		chunks := len(c.split(b, orig))
		for _, e := range benchEdits() {
			b.Run(c.name+"/"+e.name, func(b *testing.B) {
				var total, worst int
				for b.Loop() {
					total, worst = 0, 0
					for t := range editTrials {
						base, edited := e.make(orig, t)
						n := newBytes(b, set(base), edited, c.split)
						total += n
						worst = max(worst, n)
					}
				}
				b.ReportMetric(float64(total)/editTrials/1024, "reupload-KiB")
				b.ReportMetric(float64(worst)/1024, "worst-KiB")
				b.ReportMetric(float64(chunks), "chunks")
			})
		}
	}
}

func BenchmarkChunker(b *testing.B) {
	data := randBytes(1, 64<<20)
	d := DefaultChunkParams
	d.Seed = 1
	for _, c := range append(benchChunkers()[2:], chunker{"default", cdcChunks(d)}) {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			for b.Loop() {
				c.split(b, data)
			}
		})
	}
	b.Run("sha256-for-scale", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			Sum(data)
		}
	})
}
