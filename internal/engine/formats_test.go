package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/internal/testutil"
)

func TestCheckpointRefusesUnrestoredLineage(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	testutil.GenTree(t, src, testutil.TreeSpec{Seed: 20})
	f.checkpoint(f.e, src)
	empty := filepath.Join(f.root, "fresh-container")
	os.MkdirAll(empty, 0o700)
	fresh := f.engine(filepath.Join(f.root, "fresh-state"))
	_, err := fresh.Checkpoint(context.Background(), CheckpointOptions{Lineage: "test", Dir: empty})
	if !errors.Is(err, ErrNotRestored) {
		t.Fatalf("checkpoint of an unrestored lineage: %v, want ErrNotRestored", err)
	}
	// After a restore on this machine, checkpoints go ahead.
	if _, err := fresh.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: empty}); err != nil {
		t.Fatal(err)
	}
	if res := f.checkpoint(fresh, empty); res.Committed {
		t.Fatalf("restored tree re-committed: %+v", res)
	}
}

func appendLines(t *testing.T, p string, from, to int, torn string) {
	t.Helper()
	fh, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	var b strings.Builder
	for i := from; i < to; i++ {
		fmt.Fprintf(&b, `{"n":%d,"text":"line %d of the session"}`+"\n", i, i)
	}
	b.WriteString(torn)
	if _, err := fh.WriteString(b.String()); err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) checkpointOpts(e *Engine, opts CheckpointOptions) *CheckpointResult {
	f.t.Helper()
	opts.Lineage = "test"
	res, err := e.Checkpoint(context.Background(), opts)
	if err != nil {
		f.t.Fatalf("checkpoint: %v", err)
	}
	return res
}

func TestTranscriptShipsOnlyAppendedCompleteLines(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	os.MkdirAll(src, 0o700)
	p := filepath.Join(src, "rollout.jsonl")
	appendLines(t, p, 0, 20000, `{"n":20000,"te`) // ~1 MiB and a torn last line
	opts := CheckpointOptions{Dir: src, AppendOnly: func(rel string) bool { return strings.HasSuffix(rel, ".jsonl") }}
	first := f.checkpointOpts(f.e, opts)

	appendLines(t, p, 0, 0, "xt\"}\n") // completes the torn line
	appendLines(t, p, 20001, 20020, `{"torn`)
	before := f.keys()
	res := f.checkpointOpts(f.e, opts)
	added := len(f.keys()) - len(before)
	if !res.Committed || res.BytesUploaded > 16<<10 || added > 3 {
		t.Fatalf("append: %+v, %d objects (first checkpoint %+v): want only the new lines", res, added, first)
	}
	dst := filepath.Join(f.root, "dst")
	if _, err := f.engine(filepath.Join(f.root, "s2")).Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst}); err != nil {
		t.Fatal(err)
	}
	live, _ := os.ReadFile(p)
	got, _ := os.ReadFile(filepath.Join(dst, "rollout.jsonl"))
	want := live[:bytes.LastIndexByte(live, '\n')+1]
	if !bytes.Equal(got, want) {
		t.Fatalf("restored transcript: %d bytes, want the %d bytes up to the last complete line", len(got), len(want))
	}
}

func TestTranscriptRewriteIsShippedWhole(t *testing.T) {
	f := newFixture(t)
	src := filepath.Join(f.root, "src")
	os.MkdirAll(src, 0o700)
	p := filepath.Join(src, "history.jsonl")
	appendLines(t, p, 0, 5000, "")
	opts := CheckpointOptions{Dir: src, AppendOnly: func(string) bool { return true }}
	f.checkpointOpts(f.e, opts)
	for name, rewrite := range map[string]func(){
		// Codex trims history.jsonl in place past a size limit.
		"trimmed in place": func() {
			b, _ := os.ReadFile(p)
			fh, _ := os.OpenFile(p, os.O_WRONLY|os.O_TRUNC, 0)
			fh.Write(b[len(b)/2:])
			fh.Close()
		},
		"same size, prefix changed": func() {
			b, _ := os.ReadFile(p)
			b[len(b)-10] = 'Z'
			os.WriteFile(p, b, 0o600)
			appendLines(t, p, 9000, 9001, "")
		},
		"replaced by rename": func() {
			b, _ := os.ReadFile(p)
			tmp := p + ".tmp"
			os.WriteFile(tmp, append([]byte(`{"new":true}`+"\n"), b...), 0o600)
			os.Rename(tmp, p)
		},
	} {
		rewrite()
		time.Sleep(10 * time.Millisecond)
		f.checkpointOpts(f.e, opts)
		dst := filepath.Join(f.root, "dst-"+strings.ReplaceAll(name, " ", "-"))
		if _, err := f.engine(filepath.Join(f.root, "s-"+strings.ReplaceAll(name, " ", "-"))).Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst}); err != nil {
			t.Fatal(err)
		}
		live, _ := os.ReadFile(p)
		got, _ := os.ReadFile(filepath.Join(dst, "history.jsonl"))
		if !bytes.Equal(got, live) {
			t.Fatalf("%s: restored %d bytes, live file has %d", name, len(got), len(live))
		}
	}
}

// fakeDBs stands in for the SQLite adapter: Snapshot copies the file and
// fails for content starting with "CORRUPT".
type fakeDBs struct{ snapshots int }

func (d *fakeDBs) Stamp(p string) (string, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return "", err
	}
	w, _ := os.Stat(p + "-wal")
	ws := "-"
	if w != nil {
		ws = fmt.Sprint(w.Size(), w.ModTime().UnixNano())
	}
	return fmt.Sprint(fi.Size(), fi.ModTime().UnixNano(), ws), nil
}

func (d *fakeDBs) Snapshot(_ context.Context, src, dst string) error {
	d.snapshots++
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if bytes.HasPrefix(b, []byte("CORRUPT")) {
		return errors.New("quick_check: database disk image is malformed")
	}
	return os.WriteFile(dst, b, 0o600)
}

func (d *fakeDBs) Valid(_ context.Context, p string) bool {
	b, err := os.ReadFile(p)
	return err == nil && !bytes.HasPrefix(b, []byte("CORRUPT"))
}

func TestDatabases(t *testing.T) {
	f := newFixture(t)
	dbs := &fakeDBs{}
	e, err := New(f.st, Options{StateDir: f.state, Databases: dbs})
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(f.root, "src")
	os.MkdirAll(src, 0o700)
	db := filepath.Join(src, "state.db")
	good := bytes.Repeat([]byte("page"), 64<<10)
	os.WriteFile(db, good, 0o600)
	os.WriteFile(db+"-wal", []byte("wal frames"), 0o600)
	os.WriteFile(filepath.Join(src, "notes.md"), []byte("keep"), 0o600)
	opts := CheckpointOptions{Dir: src, SQLite: func(rel string) bool { return rel == "state.db" },
		Exclude: func(rel string, _ bool) bool { return strings.HasSuffix(rel, "-wal") }}
	f.checkpointOpts(e, opts)
	time.Sleep(1100 * time.Millisecond)
	f.checkpointOpts(e, opts)
	n := dbs.snapshots
	if res := f.checkpointOpts(e, opts); res.Requests != 0 || dbs.snapshots != n {
		t.Fatalf("idle database: %+v, %d snapshots: want no request and no snapshot", res, dbs.snapshots-n)
	}

	// A corrupt live database never replaces the previous good copy, and
	// the rest of the lineage still commits.
	os.WriteFile(db, append([]byte("CORRUPT"), good...), 0o600)
	os.WriteFile(filepath.Join(src, "notes.md"), []byte("newer notes"), 0o600)
	res, err := e.Checkpoint(context.Background(), CheckpointOptions{Lineage: "test", Dir: src, SQLite: opts.SQLite, Exclude: opts.Exclude})
	if !errors.Is(err, ErrDatabase) || res == nil || !res.Committed {
		t.Fatalf("corrupt database: %+v, %v; want committed with ErrDatabase", res, err)
	}
	dst := filepath.Join(f.root, "dst")
	os.MkdirAll(dst, 0o700)
	os.WriteFile(filepath.Join(dst, "state.db-wal"), []byte("stale"), 0o600)
	os.WriteFile(filepath.Join(dst, "state.db-shm"), []byte("stale"), 0o600)
	e2, _ := New(f.st, Options{StateDir: filepath.Join(f.root, "s2"), Databases: dbs})
	if _, err := e2.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "state.db")); !bytes.Equal(b, good) {
		t.Fatal("restored database is not the last good capture")
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "notes.md")); string(b) != "newer notes" {
		t.Fatal("the rest of the lineage was not committed")
	}
	for _, suf := range []string{"-wal", "-shm"} {
		if _, err := os.Stat(filepath.Join(dst, "state.db"+suf)); !os.IsNotExist(err) {
			t.Fatalf("stale %s left beside the restored database", suf)
		}
	}
	// Hot restart: a valid local database is authoritative and left alone.
	mine := bytes.Repeat([]byte("mine"), 100)
	os.WriteFile(filepath.Join(dst, "state.db"), mine, 0o600)
	os.Chtimes(filepath.Join(dst, "state.db"), time.Unix(1, 0), time.Unix(1, 0)) // older than the checkpoint
	if _, err := e2.Restore(context.Background(), RestoreOptions{Lineage: "test", Dir: dst}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "state.db")); !bytes.Equal(b, mine) {
		t.Fatal("a valid local database was replaced on a hot restart")
	}
}
