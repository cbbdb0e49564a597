package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/store"
)

// Benchmarks for issue #3, numbers in docs/benchmarks.md:
//
//	go test -run XXX -bench 'Transcript|SQLitePages' -benchtime 1x -timeout 60m ./integration/
//
// Litestream (go install github.com/benbjohnson/litestream/cmd/litestream@v0.5.18)
// is run side by side when AGENTSTATE_LITESTREAM names its binary or it is
// in ~/.cache/agentstate/litestream/.

func bucketBytes(b testing.TB, st store.Store, prefix string) (n int64, objects int) {
	for o, err := range st.List(context.Background(), prefix) {
		if err != nil {
			b.Fatal(err)
		}
		n += o.Size
		objects++
	}
	return n, objects
}

// BenchmarkTranscriptAppend: 1 KiB appended to a 100 MiB transcript.
func BenchmarkTranscriptAppend(b *testing.B) {
	storeURL, env := newBucket(b)
	st := openS3(b, storeURL)
	am := b.TempDir()
	p := filepath.Join(am, "agent-state/claude/projects/-work/5f1c.jsonl")
	os.MkdirAll(filepath.Dir(p), 0o700)
	f, _ := os.Create(p)
	line := make([]byte, 500)
	for written := 0; written < 100<<20; written += 1001 {
		rand.Read(line)
		fmt.Fprintf(f, `{"type":"assistant","text":"%x"}`+"\n", line)
	}
	f.Close()
	c := adapterCLI(b, storeURL, env, am)
	var res []checkpointOut
	c.mustJSON(&res, "checkpoint", "--adapter", "claude")
	time.Sleep(1100 * time.Millisecond)
	for range b.N {
		fh, _ := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
		fmt.Fprintf(fh, `{"type":"user","text":"%s"}`+"\n", strings.Repeat("k", 1024-26))
		fh.Close()
		_, before := bucketBytes(b, st, "")
		start := time.Now()
		c.mustJSON(&res, "checkpoint", "--adapter", "claude")
		d := time.Since(start)
		_, after := bucketBytes(b, st, "")
		b.ReportMetric(float64(res[0].BytesUploaded), "bytes-uploaded")
		b.ReportMetric(float64(res[0].Requests), "requests")
		b.ReportMetric(float64(after-before), "new-objects")
		b.ReportMetric(float64(d.Milliseconds()), "ms")
	}
}

func litestreamBin() string {
	if p := os.Getenv("AGENTSTATE_LITESTREAM"); p != "" {
		return p
	}
	home, _ := os.UserHomeDir()
	p := filepath.Join(home, ".cache", "agentstate", "litestream", "litestream")
	if _, err := os.Stat(p); err == nil {
		return p
	}
	return ""
}

// makeBigDB writes a WAL database of about size bytes: one ~page-sized row
// per id, so changing a row changes one page.
func makeBigDB(b testing.TB, p string, size int64) int {
	os.MkdirAll(filepath.Dir(p), 0o700)
	db, err := sql.Open("sqlite", "file:"+p+"?_pragma=journal_mode(WAL)&_pragma=synchronous(OFF)")
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	db.Exec(`CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)`)
	rows := int(size / 4096)
	blob := make([]byte, 3500)
	tx, _ := db.Begin()
	stmt, _ := tx.Prepare(`INSERT INTO t (id, body) VALUES (?, ?)`)
	for i := 1; i <= rows; i++ {
		rand.Read(blob)
		if _, err := stmt.Exec(i, blob); err != nil {
			b.Fatal(err)
		}
	}
	stmt.Close()
	if err := tx.Commit(); err != nil {
		b.Fatal(err)
	}
	db.Exec(`PRAGMA wal_checkpoint(TRUNCATE)`)
	return rows
}

// change rewrites 1% of the rows: a clustered run, or random ones. The
// connection is returned open with auto-checkpoints off, as a live harness
// would hold it, so Litestream sees the changes in the WAL.
func change(b testing.TB, p string, rows int, clustered bool, seed uint64) *sql.DB {
	db, err := sql.Open("sqlite", "file:"+p+"?_pragma=journal_mode(WAL)&_pragma=wal_autocheckpoint(0)")
	if err != nil {
		b.Fatal(err)
	}
	db.SetMaxOpenConns(1)
	rng := mrand.New(mrand.NewPCG(seed, 1))
	n := rows / 100
	blob := make([]byte, 3500)
	tx, _ := db.Begin()
	start := rng.IntN(rows - n)
	for i := range n {
		id := start + i + 1
		if !clustered {
			id = rng.IntN(rows) + 1
		}
		rand.Read(blob)
		if _, err := tx.Exec(`UPDATE t SET body = ? WHERE id = ?`, blob, id); err != nil {
			b.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		b.Fatal(err)
	}
	return db
}

// BenchmarkSQLitePages: 1% of the pages of a 1 GiB database changed, in a
// clustered run and at random: what agentstate uploads for the change,
// against what Litestream uploads for the same change of the same file.
func BenchmarkSQLitePages(b *testing.B) {
	size := int64(1 << 30)
	if testing.Short() {
		size = 64 << 20
	}
	for _, clustered := range []bool{true, false} {
		layout := map[bool]string{true: "clustered", false: "random"}[clustered]
		b.Run(layout+"/agentstate", func(b *testing.B) {
			storeURL, env := newBucket(b)
			am := b.TempDir()
			p := filepath.Join(am, "opencode-share", "opencode.db")
			rows := makeBigDB(b, p, size)
			c := adapterCLI(b, storeURL, env, am)
			var res []checkpointOut
			c.mustJSON(&res, "checkpoint", "--adapter", "opencode")
			for i := range b.N {
				db := change(b, p, rows, clustered, uint64(i))
				start := time.Now()
				c.mustJSON(&res, "checkpoint", "--adapter", "opencode")
				d := time.Since(start)
				db.Close()
				fi, _ := os.Stat(p)
				b.ReportMetric(float64(res[0].BytesUploaded)/(1<<20), "MiB-uploaded")
				b.ReportMetric(100*float64(res[0].BytesUploaded)/float64(fi.Size()), "%-of-db")
				b.ReportMetric(d.Seconds(), "s")
			}
		})
		b.Run(layout+"/litestream", func(b *testing.B) {
			bin := litestreamBin()
			if bin == "" {
				b.Skip("litestream not installed")
			}
			storeURL, _ := newBucket(b)
			bucket := strings.TrimPrefix(storeURL, "s3://")
			bucket = bucket[:strings.Index(bucket, "/")]
			st := openS3(b, "s3://"+bucket) // Litestream writes at the bucket's root
			dir := b.TempDir()
			p := filepath.Join(dir, "opencode.db")
			rows := makeBigDB(b, p, size)
			cfg := filepath.Join(dir, "litestream.yml")
			os.WriteFile(cfg, []byte(fmt.Sprintf(`dbs:
  - path: %s
    replicas:
      - type: s3
        bucket: %s
        path: litestream
        endpoint: %s
        region: us-east-1
        force-path-style: true
        access-key-id: %s
        secret-access-key: %s
`, p, bucket, s3Srv.endpoint, s3Srv.accessKey, s3Srv.secretKey)), 0o600)
			once := func() time.Duration {
				cmd := withoutCABundle(exec.Command(bin, "replicate", "-once", "-config", cfg))
				var out bytes.Buffer
				cmd.Stdout, cmd.Stderr = &out, &out
				start := time.Now()
				if err := cmd.Run(); err != nil {
					b.Fatalf("litestream: %v\n%s", err, out.String())
				}
				return time.Since(start)
			}
			once() // the initial snapshot
			for i := range b.N {
				before, _ := bucketBytes(b, st, "litestream")
				db := change(b, p, rows, clustered, uint64(i))
				d := once()
				db.Close()
				after, _ := bucketBytes(b, st, "litestream")
				fi, _ := os.Stat(p)
				b.ReportMetric(float64(after-before)/(1<<20), "MiB-uploaded")
				b.ReportMetric(100*float64(after-before)/float64(fi.Size()), "%-of-db")
				b.ReportMetric(d.Seconds(), "s")
			}
		})
	}
}
