package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/internal/testutil"
)

// Benchmarks against the MinIO server, side by side with `rclone copy` and
// `restic backup` of the same tree to the same server (Debian's packages;
// a tool that is not installed is skipped). Each iteration uses a fresh
// bucket. Run, for the numbers in docs/benchmarks.md:
//
//	go test -run XXX -bench . -benchtime 1x -timeout 60m ./integration/
//
// Reported: MB/s of tree content, peak RSS of the tool's process, and for
// agentstate the requests it made.

type benchTree struct {
	name string
	spec testutil.TreeSpec
}

var benchTrees = []benchTree{
	{"1GiB", testutil.TreeSpec{Seed: 11, LargeFile: 1 << 30, SmallFiles: 100}},
	{"10k-small", testutil.TreeSpec{Seed: 12, SmallFiles: 10000}},
}

func treeBytes(tb testing.TB, dir string) int64 {
	var n int64
	for _, node := range testutil.Snapshot(tb, dir) {
		n += node.Size
	}
	return n
}

// tool runs one backup tool against a bucket.
type tool struct {
	name    string
	backup  func(b *testing.B, src string) *exec.Cmd
	restore func(b *testing.B, dst string) *exec.Cmd
}

func tools(b *testing.B, storeURL string, env []string, state string) []tool {
	bucket := strings.TrimPrefix(storeURL, "s3://")
	bucket = bucket[:strings.Index(bucket, "/")]
	endpoint := s3Srv.endpoint
	withEnv := func(cmd *exec.Cmd, extra ...string) *exec.Cmd {
		cmd.Env = append(append(append(os.Environ(), env...), "HOME="+state), extra...)
		return cmd
	}
	as := func(args ...string) *exec.Cmd {
		return withEnv(exec.Command(agentstateBin(b), append([]string{"--store", storeURL, "--state-dir", state, "--json"}, args...)...))
	}
	rcloneEnv := []string{"RCLONE_CONFIG_BENCH_TYPE=s3", "RCLONE_CONFIG_BENCH_PROVIDER=Minio",
		"RCLONE_CONFIG_BENCH_ENDPOINT=" + endpoint, "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=" + s3Srv.accessKey,
		"RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=" + s3Srv.secretKey, "RCLONE_CONFIG_BENCH_REGION=us-east-1"}
	resticEnv := []string{"RESTIC_REPOSITORY=s3:" + endpoint + "/" + bucket + "/restic", "RESTIC_PASSWORD=bench",
		"RESTIC_CACHE_DIR=" + filepath.Join(state, "restic-cache")}
	out := []tool{{
		name:    "agentstate",
		backup:  func(b *testing.B, src string) *exec.Cmd { return as("checkpoint", "--lineage", "bench", "--dir", src) },
		restore: func(b *testing.B, dst string) *exec.Cmd { return as("restore", "--lineage", "bench", "--dir", dst) },
	}}
	if _, err := exec.LookPath("rclone"); err == nil {
		out = append(out, tool{
			name: "rclone",
			backup: func(b *testing.B, src string) *exec.Cmd {
				return withoutCABundle(withEnv(exec.Command("rclone", "copy", "--links", src, "bench:"+bucket+"/rclone"), rcloneEnv...))
			},
			restore: func(b *testing.B, dst string) *exec.Cmd {
				return withoutCABundle(withEnv(exec.Command("rclone", "copy", "--links", "bench:"+bucket+"/rclone", dst), rcloneEnv...))
			},
		})
	}
	if _, err := exec.LookPath("restic"); err == nil {
		out = append(out, tool{
			name: "restic",
			backup: func(b *testing.B, src string) *exec.Cmd {
				init := withEnv(exec.Command("restic", "init"), resticEnv...)
				init.Run() // fails harmlessly once the repository exists
				return withEnv(exec.Command("restic", "backup", "--quiet", src), resticEnv...)
			},
			restore: func(b *testing.B, dst string) *exec.Cmd {
				return withEnv(exec.Command("restic", "restore", "latest", "--target", dst), resticEnv...)
			},
		})
	}
	return out
}

type measured struct {
	d   time.Duration
	rss int64
	out string
}

func measure(b *testing.B, cmd *exec.Cmd) measured {
	b.Helper()
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	start := time.Now()
	if err := cmd.Run(); err != nil {
		b.Fatalf("%v: %v\n%s", cmd.Args, err, e.String())
	}
	return measured{time.Since(start), peakRSS(cmd.ProcessState), o.String()}
}

func report(b *testing.B, m measured, size int64) {
	b.ReportMetric(float64(size)/1e6/m.d.Seconds(), "MB/s")
	b.ReportMetric(float64(m.rss)/(1<<20), "peak-RSS-MiB")
	b.ReportMetric(m.d.Seconds(), "s")
}

// BenchmarkBackupRestore: a full first backup, then a restore into an
// empty folder, per tool and tree.
func BenchmarkBackupRestore(b *testing.B) {
	for _, bt := range benchTrees {
		src := filepath.Join(b.TempDir(), "src")
		testutil.GenTree(b, src, bt.spec)
		size := treeBytes(b, src)
		storeURL, env := newBucket(b)
		for _, tl := range tools(b, storeURL, env, b.TempDir()) {
			b.Run(fmt.Sprintf("%s/%s/backup", bt.name, tl.name), func(b *testing.B) {
				for range b.N {
					report(b, measure(b, tl.backup(b, src)), size)
				}
			})
			b.Run(fmt.Sprintf("%s/%s/restore", bt.name, tl.name), func(b *testing.B) {
				for range b.N {
					dst := filepath.Join(b.TempDir(), "dst")
					report(b, measure(b, tl.restore(b, dst)), size)
				}
			})
		}
	}
}

// BenchmarkIdle: the second backup of an unchanged 10,000-file tree.
// agentstate's makes no request at all.
func BenchmarkIdle(b *testing.B) {
	src := filepath.Join(b.TempDir(), "src")
	testutil.GenTree(b, src, testutil.TreeSpec{Seed: 13, SmallFiles: 10000})
	storeURL, env := newBucket(b)
	for _, tl := range tools(b, storeURL, env, b.TempDir()) {
		measure(b, tl.backup(b, src))
		time.Sleep(1100 * time.Millisecond) // past agentstate's racy window
		measure(b, tl.backup(b, src))
		b.Run("10k-small/"+tl.name, func(b *testing.B) {
			for range b.N {
				m := measure(b, tl.backup(b, src))
				b.ReportMetric(float64(m.d.Microseconds())/1000, "ms")
				b.ReportMetric(float64(m.rss)/(1<<20), "peak-RSS-MiB")
				if tl.name == "agentstate" {
					var r checkpointOut
					if err := json.Unmarshal([]byte(m.out), &r); err != nil || r.Committed {
						b.Fatalf("idle checkpoint: %+v, %v", r, err)
					}
					b.ReportMetric(float64(r.Requests), "requests")
				}
			}
		})
	}
}
