package store_test

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/store"
	"github.com/agentstate/agentstate/store/storetest"
)

func openDir(t *testing.T) *store.Dir {
	t.Helper()
	d, err := store.OpenDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestDirConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store { return openDir(t) })
}

func TestDirModes(t *testing.T) {
	root := filepath.Join(t.TempDir(), "new", "root")
	d, err := store.OpenDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"top", "a/b/c/deep", "empty"} {
		body := []byte(key)
		if key == "empty" {
			body = nil
		}
		if _, err := d.Put(t.Context(), key, bytes.NewReader(body), int64(len(body)), store.PutOptions{CreateOnly: key == "top"}); err != nil {
			t.Fatal(err)
		}
	}
	err = filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := e.Info()
		if err != nil {
			return err
		}
		want := fs.FileMode(0o600)
		if e.IsDir() {
			want = fs.ModeDir | 0o700
		}
		if fi.Mode() != want {
			t.Errorf("%s: mode %v, want %v", p, fi.Mode(), want)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestDirRejectsKeys(t *testing.T) {
	d := openDir(t)
	for _, key := range []string{".tmp", ".tmp/x", ".lock", ".lock/x", "", "/etc/passwd", "../escape", "a/../../escape", "a\x00", "a/", "a//b"} {
		if _, err := d.Put(t.Context(), key, strings.NewReader("x"), 1, store.PutOptions{}); err == nil {
			t.Errorf("Put(%q) accepted", key)
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(d.Root()), "escape")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a key escaped the root: %v", err)
	}
	// ".tmp" is only reserved at the top.
	if _, err := d.Put(t.Context(), "a/.tmp", strings.NewReader("x"), 1, store.PutOptions{}); err != nil {
		t.Errorf("Put(a/.tmp): %v", err)
	}
}

func TestDirKeyPrefixConflict(t *testing.T) {
	d := openDir(t)
	ctx := t.Context()
	if _, err := d.Put(ctx, "a", strings.NewReader("x"), 1, store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Put(ctx, "a/b", strings.NewReader("x"), 1, store.PutOptions{}); err == nil || errors.Is(err, store.ErrPrecondition) {
		t.Errorf("Put(a/b) with object a: err = %v, want a conflict error", err)
	}
	if _, err := d.Put(ctx, "c/d", strings.NewReader("x"), 1, store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, opts := range []store.PutOptions{{}, {CreateOnly: true}} {
		if _, err := d.Put(ctx, "c", strings.NewReader("x"), 1, opts); err == nil {
			t.Errorf("Put(c, %+v) with object c/d succeeded", opts)
		}
	}
	if got, err := d.Get(ctx, "c/d", 0, -1); err != nil {
		t.Errorf("c/d damaged: %v", err)
	} else {
		got.Close()
	}
}

func TestDirNoTempFilesLeft(t *testing.T) {
	d := openDir(t)
	ctx := t.Context()
	v1, err := d.Put(ctx, "k", strings.NewReader("one"), 3, store.PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = d.Put(ctx, "k", strings.NewReader("two"), 3, store.PutOptions{CreateOnly: true}) // refused
	_, _ = d.Put(ctx, "k", strings.NewReader("two"), 3, store.PutOptions{IfMatch: "wrong"}) // refused
	if _, err := d.Put(ctx, "k", strings.NewReader("two"), 3, store.PutOptions{IfMatch: v1.ETag}); err != nil {
		t.Fatal(err)
	}
	_, _ = d.Put(ctx, "short", strings.NewReader("ab"), 3, store.PutOptions{}) // wrong size
	if _, err := d.Put(ctx, "new", strings.NewReader("n"), 1, store.PutOptions{CreateOnly: true}); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(filepath.Join(d.Root(), ".tmp"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 0 {
		t.Errorf("temp files left: %v", entries)
	}
}

func TestDirRemovesStaleTemps(t *testing.T) {
	d := openDir(t)
	stale := filepath.Join(d.Root(), ".tmp", "put-stale")
	fresh := filepath.Join(d.Root(), ".tmp", "put-fresh")
	for _, p := range []string{stale, fresh} {
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-48 * time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	if _, err := store.OpenDir(d.Root()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stale temp file kept: %v", err)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Errorf("fresh temp file (maybe a live put) removed: %v", err)
	}
}

// TestDirETagChangesOnSameContent: unlike S3's MD5 ETag, the dir ETag names
// one write, so rewriting identical bytes (even within one clock tick)
// invalidates an If-Match taken before.
func TestDirETagChangesOnSameContent(t *testing.T) {
	d := openDir(t)
	seen := map[string]bool{}
	for range 50 {
		info, err := d.Put(t.Context(), "lease", strings.NewReader("same"), 4, store.PutOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if seen[info.ETag] {
			t.Fatalf("ETag %s repeated", info.ETag)
		}
		seen[info.ETag] = true
	}
}

func TestDirDeleteRemovesEmptyDirs(t *testing.T) {
	d := openDir(t)
	ctx := t.Context()
	for _, k := range []string{"x/y/z/1", "x/y/z/2", "x/keep"} {
		if _, err := d.Put(ctx, k, strings.NewReader("v"), 1, store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Delete(ctx, []string{"x/y/z/1", "x/y/z/2"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(d.Root(), "x", "y")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("empty directory x/y kept: %v", err)
	}
	if _, err := os.Stat(filepath.Join(d.Root(), "x", "keep")); err != nil {
		t.Errorf("x/keep: %v", err)
	}
	if err := d.Delete(ctx, []string{"x/keep"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.Root()); err != nil {
		t.Errorf("root removed: %v", err)
	}
}

// TestDirPutDeleteRace: GC deleting the last object of a directory while a
// checkpoint puts a new one into it must not lose the put.
func TestDirPutDeleteRace(t *testing.T) {
	d := openDir(t)
	ctx := t.Context()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 300 {
			k := fmt.Sprintf("s/00/gc-%d", i)
			if _, err := d.Put(ctx, k, strings.NewReader("g"), 1, store.PutOptions{}); err != nil {
				t.Error(err)
				return
			}
			if err := d.Delete(ctx, []string{k}); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for i := range 300 {
		k := fmt.Sprintf("s/00/new-%d", i)
		if _, err := d.Put(ctx, k, strings.NewReader("n"), 1, store.PutOptions{CreateOnly: true}); err != nil {
			t.Fatal(err)
		}
		if err := d.Delete(ctx, []string{k}); err != nil {
			t.Fatal(err)
		}
	}
	<-done
}

// Multi-process tests re-execute the test binary: with
// AGENTSTATE_DIR_HELPER set, TestDirHelperProcess acts as one writer.
const helperEnv = "AGENTSTATE_DIR_HELPER"

func TestDirHelperProcess(t *testing.T) {
	mode := os.Getenv(helperEnv)
	if mode == "" {
		t.Skip("helper process for the multi-process dir tests")
	}
	d, err := store.OpenDir(os.Getenv("AGENTSTATE_DIR_ROOT"))
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(2)
	}
	id := os.Getenv("AGENTSTATE_DIR_ID")
	// Start together, so the writers really race.
	startAt, _ := strconv.ParseInt(os.Getenv("AGENTSTATE_DIR_START"), 10, 64)
	time.Sleep(time.Until(time.Unix(0, startAt)))
	ctx := t.Context()
	switch mode {
	case "create":
		body := "writer " + id
		_, err := d.Put(ctx, "manifests/l/1", strings.NewReader(body), int64(len(body)), store.PutOptions{CreateOnly: true})
		switch {
		case err == nil:
			fmt.Println("result: won")
		case errors.Is(err, store.ErrPrecondition):
			fmt.Println("result: lost")
		default:
			fmt.Println("error:", err)
			os.Exit(2)
		}
	case "count":
		for done := 0; done < 20; {
			info, err := d.Stat(ctx, "counter")
			if err != nil {
				fmt.Println("error:", err)
				os.Exit(2)
			}
			rc, err := d.Get(ctx, "counter", 0, -1)
			if err != nil {
				fmt.Println("error:", err)
				os.Exit(2)
			}
			var n int
			_, err = fmt.Fscan(rc, &n)
			rc.Close()
			if err != nil {
				fmt.Println("error:", err)
				os.Exit(2)
			}
			next := strconv.Itoa(n + 1)
			_, err = d.Put(ctx, "counter", strings.NewReader(next), int64(len(next)), store.PutOptions{IfMatch: info.ETag})
			switch {
			case err == nil:
				done++
			case !errors.Is(err, store.ErrPrecondition):
				fmt.Println("error:", err)
				os.Exit(2)
			}
		}
		fmt.Println("result: counted")
	}
	os.Exit(0)
}

// runHelpers starts n helper processes in mode on root and returns their
// "result:" lines.
func runHelpers(t *testing.T, root, mode string, n int) []string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	startAt := time.Now().Add(500 * time.Millisecond).UnixNano()
	cmds := make([]*exec.Cmd, n)
	outs := make([]*bytes.Buffer, n)
	for i := range n {
		cmd := exec.CommandContext(t.Context(), exe, "-test.run=^TestDirHelperProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), helperEnv+"="+mode, "AGENTSTATE_DIR_ROOT="+root,
			"AGENTSTATE_DIR_ID="+strconv.Itoa(i), "AGENTSTATE_DIR_START="+strconv.FormatInt(startAt, 10))
		outs[i] = new(bytes.Buffer)
		cmd.Stdout, cmd.Stderr = outs[i], outs[i]
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds[i] = cmd
	}
	var results []string
	for i, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			t.Fatalf("helper %d: %v\n%s", i, err, outs[i])
		}
		_, after, ok := strings.Cut(outs[i].String(), "result: ")
		if !ok {
			t.Fatalf("helper %d printed no result:\n%s", i, outs[i])
		}
		results = append(results, strings.Fields(after)[0])
	}
	return results
}

func TestDirCreateOnlyAcrossProcesses(t *testing.T) {
	d := openDir(t)
	results := runHelpers(t, d.Root(), "create", 4)
	won := 0
	for _, r := range results {
		if r == "won" {
			won++
		}
	}
	if won != 1 {
		t.Fatalf("%d processes created the key, want exactly 1 (results %v)", won, results)
	}
	rc, err := d.Get(t.Context(), "manifests/l/1", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var b bytes.Buffer
	if _, err := b.ReadFrom(rc); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(b.String(), "writer ") {
		t.Errorf("content %q", b.String())
	}
}

func TestDirIfMatchAcrossProcesses(t *testing.T) {
	d := openDir(t)
	if _, err := d.Put(t.Context(), "counter", strings.NewReader("0"), 1, store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	const procs = 3
	runHelpers(t, d.Root(), "count", procs)
	rc, err := d.Get(t.Context(), "counter", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var n int
	if _, err := fmt.Fscan(rc, &n); err != nil {
		t.Fatal(err)
	}
	if n != procs*20 {
		t.Errorf("counter = %d, want %d: If-Match puts of different processes overwrote each other", n, procs*20)
	}
}
