package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/store"
)

// bucketHolds reports whether any object in the bucket contains needle
// (random bytes are stored raw: zstd cannot shrink them).
func bucketHolds(t *testing.T, st store.Store, needle []byte) bool {
	t.Helper()
	ctx := context.Background()
	for o, err := range st.List(ctx, "") {
		if err != nil {
			t.Fatal(err)
		}
		rc, err := st.Get(ctx, o.Key, 0, -1)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(b, needle) {
			return true
		}
	}
	return false
}

// A deleted file is recoverable during the --keep-deleted window, through
// GC runs, and gone from the bucket once the window ended and GC ran.
func TestDeletedFileWindow(t *testing.T) {
	storeURL, env := newBucket(t)
	st := openS3(t, storeURL)
	c := newCLI(t, storeURL, env)
	src := t.TempDir()
	secret := make([]byte, 100<<10)
	rand.Read(secret)
	os.WriteFile(filepath.Join(src, "a.bin"), secret, 0o600)
	os.WriteFile(filepath.Join(src, "b.txt"), []byte("b0"), 0o600)
	const window = "5s"
	ckpt := func() checkpointOut {
		t.Helper()
		var out checkpointOut
		c.mustJSON(&out, "checkpoint", "--lineage", "del", "--dir", src, "--keep-deleted", window)
		return out
	}
	change := func(i int) {
		os.WriteFile(filepath.Join(src, "b.txt"), []byte(strings.Repeat("b", i+2)), 0o600)
	}
	ckpt()
	os.Remove(filepath.Join(src, "a.bin"))
	if out := ckpt(); !out.Committed || out.FilesChanged != 1 {
		t.Fatalf("checkpoint after the deletion: %+v", out)
	}
	deletedAt := time.Now()
	var ls struct {
		Seq     uint64 `json:"seq"`
		Deleted []struct {
			Path string `json:"path"`
			Size int64  `json:"size"`
		} `json:"deleted"`
	}
	c.mustJSON(&ls, "ls", "--lineage", "del", "--deleted")
	if len(ls.Deleted) != 1 || ls.Deleted[0].Path != "a.bin" || ls.Deleted[0].Size != int64(len(secret)) {
		t.Fatalf("ls --deleted: %+v", ls)
	}
	// Later checkpoints and GC (keep the last 2) keep it restorable.
	for i := range 3 {
		change(i)
		ckpt()
	}
	gcFinish(t, c)
	dst := t.TempDir()
	if out, errOut, code := c.run("restore", "--lineage", "del", "--dir", dst, "--path", "a.bin"); code != 0 {
		t.Fatalf("restore --path during the window: exit %d\n%s%s", code, out, errOut)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "a.bin")); !bytes.Equal(b, secret) {
		t.Fatal("restored a.bin differs")
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 1 {
		t.Fatalf("restore --path wrote %d entries, want only a.bin", len(ents))
	}
	if !bucketHolds(t, st, secret[:4096]) {
		t.Fatal("the deleted file's bytes are not in the bucket during the window")
	}

	// Past the window the next checkpoint drops it; GC then reclaims it.
	time.Sleep(time.Until(deletedAt.Add(5500 * time.Millisecond)))
	for i := range 3 {
		change(10 + i)
		ckpt()
	}
	c.mustJSON(&ls, "ls", "--lineage", "del", "--deleted")
	if len(ls.Deleted) != 0 {
		t.Fatalf("ls --deleted past the window: %+v", ls)
	}
	_, errOut, code := c.run("restore", "--lineage", "del", "--dir", t.TempDir(), "--path", "a.bin")
	if code != 1 || !strings.Contains(errOut, "not in the checkpoint") {
		t.Fatalf("restore --path past the window: exit %d\n%s", code, errOut)
	}
	gcFinish(t, c)
	if bucketHolds(t, st, secret[:4096]) {
		t.Fatal("the deleted file's bytes are still in the bucket after the window and GC")
	}
}
