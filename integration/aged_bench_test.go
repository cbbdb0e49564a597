package integration

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/adapters"
	"github.com/agentstate/agentstate/internal/engine"
	"github.com/agentstate/agentstate/internal/testutil"
	"github.com/agentstate/agentstate/manifest"
)

// BenchmarkAgedLineage checkpoints a harness-like tree 2,000 times against
// MinIO (a transcript appended every time, a new one every 20th time as
// sessions begin, small notes rewritten, a SQLite
// database updated every 10th time, a 2 MiB cache file replaced every
// 100th), then restores the newest manifest with a fresh state directory
// and reports what that restore cost, after 500 and 2,000 checkpoints;
// "none" is the same run with compaction disabled, for comparison. Numbers in docs/benchmarks.md:
//
//	go test -run XXX -bench AgedLineage -benchtime 1x -timeout 60m ./integration/
func BenchmarkAgedLineage(b *testing.B) {
	for _, v := range []struct {
		name              string
		compactAt, rounds int
	}{{"compaction-500", 0, 500}, {"compaction-2000", 0, 2000}, {"none-2000", -1, 2000}} {
		b.Run(v.name, func(b *testing.B) {
			for range b.N {
				agedLineage(b, v.compactAt, v.rounds)
			}
		})
	}
}

func agedLineage(b *testing.B, compactAt, rounds int) {
	ctx := context.Background()
	storeURL, _ := newBucket(b)
	st := openS3(b, storeURL)
	src := filepath.Join(b.TempDir(), "home")
	testutil.GenTree(b, src, testutil.TreeSpec{Seed: 50, SmallFiles: 200})
	sessions := filepath.Join(src, "sessions")
	dbPath := filepath.Join(src, "state.db")
	os.MkdirAll(sessions, 0o700)
	os.MkdirAll(filepath.Join(src, "notes"), 0o700)
	db, err := sql.Open("sqlite", "file:"+dbPath+"?_pragma=journal_mode(WAL)")
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.Exec(`CREATE TABLE kv (k INTEGER PRIMARY KEY, v TEXT)`); err != nil {
		b.Fatal(err)
	}
	e, err := engine.New(st, engine.Options{StateDir: filepath.Join(b.TempDir(), "state"),
		Databases: adapters.Databases{}, CompactAt: compactAt})
	if err != nil {
		b.Fatal(err)
	}
	opts := engine.CheckpointOptions{Lineage: "aged", Dir: src,
		AppendOnly: func(rel string) bool { return strings.HasSuffix(rel, ".jsonl") },
		SQLite:     func(rel string) bool { return rel == "state.db" },
		Exclude: func(rel string, _ bool) bool {
			return strings.HasPrefix(rel, "state.db-") // captured with the database
		}}
	var compacted, uploaded int64
	start := time.Now()
	for i := range rounds {
		// A new session every 20 checkpoints, as a harness starts a new
		// transcript file per session; the old ones stay.
		transcript := filepath.Join(sessions, fmt.Sprintf("s%03d.jsonl", i/20))
		fh, err := os.OpenFile(transcript, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
		if err != nil {
			b.Fatal(err)
		}
		fmt.Fprintf(fh, `{"turn":%d,"role":"assistant","text":"%s"}`+"\n", i, strings.Repeat("x", 400))
		fh.Close()
		os.WriteFile(filepath.Join(src, "notes", fmt.Sprintf("n%d.md", i%5)), []byte(fmt.Sprint("round ", i)), 0o600)
		if i%10 == 0 {
			if _, err := db.Exec(`INSERT OR REPLACE INTO kv (k, v) VALUES (?, ?)`, i%50, // keys 0, 10, .. 40
				strings.Repeat("v", 300)); err != nil {
				b.Fatal(err)
			}
		}
		if i%100 == 0 {
			f, _ := os.Create(filepath.Join(src, "cache.bin"))
			io.CopyN(f, testutil.RandReader(uint64(i)), 2<<20)
			f.Close()
		}
		res, err := e.Checkpoint(ctx, opts)
		if err != nil {
			b.Fatalf("checkpoint %d: %v", i, err)
		}
		compacted += int64(res.SegmentsCompacted)
		uploaded += res.BytesUploaded
	}
	took := time.Since(start)
	if err := db.Close(); err != nil {
		b.Fatal(err)
	}
	seqs, err := manifest.Sequences(ctx, st, "aged")
	if err != nil {
		b.Fatal(err)
	}
	m, err := manifest.Load(ctx, st, "aged", seqs[0])
	if err != nil {
		b.Fatal(err)
	}
	mb, _ := manifest.Encode(m)

	fresh, err := engine.New(st, engine.Options{StateDir: filepath.Join(b.TempDir(), "fresh"), Databases: adapters.Databases{}})
	if err != nil {
		b.Fatal(err)
	}
	dst := filepath.Join(b.TempDir(), "restored")
	rstart := time.Now()
	rres, err := fresh.Restore(ctx, engine.RestoreOptions{Lineage: "aged", Dir: dst})
	if err != nil {
		b.Fatal(err)
	}
	rtook := time.Since(rstart)
	want, got := testutil.Snapshot(b, src), testutil.Snapshot(b, dst)
	delete(want, "state.db") // compared by content below: the live one has a -wal
	delete(want, "state.db-wal")
	delete(want, "state.db-shm")
	delete(got, "state.db")
	testutil.CompareTrees(b, want, got)
	var n int
	rdb, err := sql.Open("sqlite", "file:"+filepath.Join(dst, "state.db")+"?mode=ro")
	if err != nil {
		b.Fatal(err)
	}
	defer rdb.Close()
	if err := rdb.QueryRow(`SELECT count(*) FROM kv`).Scan(&n); err != nil || n != 5 {
		b.Fatalf("restored database: %d rows, %v", n, err)
	}
	// Most of a compacted restore's requests are one ranged GET per tree
	// (directory) and chunk-list page: the tree's shape, not its age.
	if compactAt >= 0 && rres.Requests > 400 {
		b.Fatalf("restore after %d checkpoints made %d requests", rounds, rres.Requests)
	}
	b.ReportMetric(float64(rounds), "checkpoints")
	b.ReportMetric(float64(seqs[0]), "seq")
	b.ReportMetric(float64(len(m.Segments)), "manifest-segments")
	b.ReportMetric(float64(len(mb)), "manifest-bytes")
	b.ReportMetric(float64(rres.Requests), "restore-requests")
	rs := fresh.Stats() // the fresh engine made only the restore's requests
	b.ReportMetric(float64(rs.Gets), "restore-gets")
	b.ReportMetric(float64(rs.Stats), "restore-heads")
	b.ReportMetric(float64(rtook.Milliseconds()), "restore-ms")
	b.ReportMetric(float64(took.Milliseconds())/float64(rounds), "ms/checkpoint")
	b.ReportMetric(float64(compacted), "segments-compacted")
	b.ReportMetric(float64(uploaded)/float64(rounds), "bytes-uploaded/checkpoint")
}
