package integration

import (
	"bufio"
	"bytes"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// The WAL writer is this test binary run again with the variable set: a
// separate OS process, like opencode holding opencode.db.
func init() {
	if p := os.Getenv("AGENTSTATE_TEST_WAL_WRITER"); p != "" {
		os.Exit(walWriter(p))
	}
}

// walWriter inserts one row per transaction, WAL mode with
// synchronous=NORMAL as opencode does, and prints each committed id.
func walWriter(p string) int {
	db, err := sql.Open("sqlite", "file:"+p+"?_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_pragma=busy_timeout(5000)")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	db.SetMaxOpenConns(1)
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, body TEXT)`); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	w := bufio.NewWriter(os.Stdout)
	for i := 1; ; i++ {
		if _, err := db.Exec(`INSERT INTO t (id, body) VALUES (?, ?)`, i, strings.Repeat("message part ", 40)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Fprintln(w, i) // committed
		w.Flush()
		time.Sleep(time.Millisecond)
	}
}

type walProc struct {
	cmd       *exec.Cmd
	committed atomic.Int64
}

func startWALWriter(t *testing.T, p string) *walProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "AGENTSTATE_TEST_WAL_WRITER="+p)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &walProc{cmd: cmd}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if n, err := strconv.ParseInt(sc.Text(), 10, 64); err == nil {
				w.committed.Store(n)
			}
		}
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
	deadline := time.Now().Add(30 * time.Second)
	for w.committed.Load() < 200 {
		if time.Now().After(deadline) {
			t.Fatal("WAL writer did not start committing")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return w
}

func countUpTo(t testing.TB, p string, id int64) int64 {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+p+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var n int64
	if err := db.QueryRow(`SELECT count(*) FROM t WHERE id <= ?`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestOpencodeSnapshotWhileWALWriterWrites: the checkpoint holds every row
// committed before the backup began, while the writer stays alive and
// keeps writing; what was uploaded passes quick_check.
func TestOpencodeSnapshotWhileWALWriterWrites(t *testing.T) {
	storeURL, env := newBucket(t)
	am := t.TempDir()
	dir := filepath.Join(am, "opencode-share")
	os.MkdirAll(dir, 0o700)
	db := filepath.Join(dir, "opencode.db")
	w := startWALWriter(t, db)
	c := adapterCLI(t, storeURL, env, am)
	start := w.committed.Load()
	for round := range 3 {
		before := w.committed.Load()
		var res []checkpointOut
		c.mustJSON(&res, "checkpoint", "--adapter", "opencode")
		if w.cmd.ProcessState != nil {
			t.Fatal("the writer died during the checkpoint")
		}
		fresh := t.TempDir()
		adapterCLI(t, storeURL, env, fresh).restoreAdapter("opencode")
		got := filepath.Join(fresh, "opencode-share", "opencode.db")
		dbRows(t, got) // quick_check of what was uploaded
		if n := countUpTo(t, got, before); n != before {
			t.Fatalf("round %d: %d of the %d rows committed before the checkpoint", round, n, before)
		}
		if _, err := os.Stat(got + "-wal"); err == nil {
			t.Fatal("a -wal was restored beside the database")
		}
	}
	// The writer was never blocked for the length of the checkpoints.
	deadline := time.Now().Add(10 * time.Second)
	for w.committed.Load() <= start && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if w.committed.Load() <= start || w.cmd.ProcessState != nil {
		t.Fatalf("the writer stopped committing: %d commits before the checkpoints, %d after", start, w.committed.Load())
	}
}

// TestCorruptLiveDatabaseKeepsDurableSnapshot: a live database that fails
// quick_check never replaces the previous good checkpoint; the rest of the
// lineage still commits and the command exits non-zero.
func TestCorruptLiveDatabaseKeepsDurableSnapshot(t *testing.T) {
	storeURL, env := newBucket(t)
	am := t.TempDir()
	dir := filepath.Join(am, "hermes")
	db := filepath.Join(dir, "state.db")
	makeDB(t, db, 2000)
	os.WriteFile(filepath.Join(dir, "SOUL.md"), []byte("v1\n"), 0o600)
	c := adapterCLI(t, storeURL, env, am)
	var res []checkpointOut
	c.mustJSON(&res, "checkpoint", "--adapter", "hermes")

	// Corrupt pages in the middle of the live file (after a clean close,
	// so no -wal can repair them), and change another file too.
	f, err := os.OpenFile(db, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := f.Stat()
	junk := []byte(strings.Repeat("\xde\xad\xbe\xef", 4096))
	for off := int64(8192); off < fi.Size()-int64(len(junk)); off += fi.Size() / 4 {
		f.WriteAt(junk, off)
	}
	f.Close()
	os.WriteFile(filepath.Join(dir, "SOUL.md"), []byte("v2\n"), 0o600)
	_, errOut, code := c.run("checkpoint", "--adapter", "hermes")
	if code == 0 || !strings.Contains(errOut, "state.db") {
		t.Fatalf("checkpoint of a corrupt database: exit %d, %s; want non-zero naming state.db", code, errOut)
	}
	fresh := t.TempDir()
	adapterCLI(t, storeURL, env, fresh).restoreAdapter("hermes")
	got := filepath.Join(fresh, "hermes")
	if n := dbRows(t, filepath.Join(got, "state.db")); n != 2000 {
		t.Fatalf("restored database has %d rows: the good snapshot was replaced", n)
	}
	if b, _ := os.ReadFile(filepath.Join(got, "SOUL.md")); string(b) != "v2\n" {
		t.Fatalf("the rest of the lineage was not committed: %q", b)
	}
}

// TestRestoreRemovesStaleWALAndSHM: companions left beside a database
// from before the restore are removed, never replayed into it.
func TestRestoreRemovesStaleWALAndSHM(t *testing.T) {
	storeURL, env := newBucket(t)
	am := t.TempDir()
	db := filepath.Join(am, "hermes", "state.db")
	makeDB(t, db, 300)
	c := adapterCLI(t, storeURL, env, am)
	var res []checkpointOut
	c.mustJSON(&res, "checkpoint", "--adapter", "hermes")

	fresh := t.TempDir()
	stale := filepath.Join(fresh, "hermes")
	os.MkdirAll(stale, 0o700)
	os.WriteFile(filepath.Join(stale, "state.db-wal"), []byte("stale wal frames"), 0o600)
	os.WriteFile(filepath.Join(stale, "state.db-shm"), []byte("stale shm"), 0o600)
	adapterCLI(t, storeURL, env, fresh).restoreAdapter("hermes")
	for _, suf := range []string{"-wal", "-shm"} {
		if _, err := os.Stat(filepath.Join(stale, "state.db"+suf)); err == nil {
			t.Fatalf("stale state.db%s left beside the restored database", suf)
		}
	}
	if n := dbRows(t, filepath.Join(stale, "state.db")); n != 300 {
		t.Fatalf("%d rows", n)
	}
}

// TestSIGKILLedWALWriterDatabase: after the writer is killed with -9
// mid-transaction, the next checkpoint captures a consistent database.
func TestSIGKILLedWALWriterDatabase(t *testing.T) {
	storeURL, env := newBucket(t)
	am := t.TempDir()
	db := filepath.Join(am, "opencode-share", "opencode.db")
	os.MkdirAll(filepath.Dir(db), 0o700)
	w := startWALWriter(t, db)
	time.Sleep(200 * time.Millisecond)
	w.cmd.Process.Signal(syscall.SIGKILL)
	w.cmd.Wait()
	last := w.committed.Load()
	c := adapterCLI(t, storeURL, env, am)
	var res []checkpointOut
	c.mustJSON(&res, "checkpoint", "--adapter", "opencode")
	fresh := t.TempDir()
	adapterCLI(t, storeURL, env, fresh).restoreAdapter("opencode")
	got := filepath.Join(fresh, "opencode-share", "opencode.db")
	dbRows(t, got)
	if n := countUpTo(t, got, last); n != last {
		t.Fatalf("%d of %d committed rows after the writer was killed", n, last)
	}
}

// TestLegacyRawCopyMigration: a directory the old sync script copied raw
// (db, -wal and -shm copied as files while the harness wrote) is accepted
// once with --legacy-raw-sqlite: recovered from a private copy, validated,
// checkpointed; the raw files are never modified.
func TestLegacyRawCopyMigration(t *testing.T) {
	storeURL, env := newBucket(t)
	live := filepath.Join(t.TempDir(), "live.db")
	w := startWALWriter(t, live)
	am := t.TempDir()
	raw := filepath.Join(am, "hermes", "state.db")
	os.MkdirAll(filepath.Dir(raw), 0o700)
	before := w.committed.Load()
	for _, suf := range []string{"", "-wal", "-shm"} { // as rsync would: one file after the other
		b, err := os.ReadFile(live + suf)
		if err != nil && suf != "-shm" {
			t.Fatal(err)
		}
		os.WriteFile(raw+suf, b, 0o600)
	}
	w.cmd.Process.Kill()
	sums := map[string][]byte{}
	for _, suf := range []string{"", "-wal", "-shm"} {
		sums[suf], _ = os.ReadFile(raw + suf)
	}
	c := adapterCLI(t, storeURL, env, am)
	var res []checkpointOut
	c.mustJSON(&res, "checkpoint", "--adapter", "hermes", "--legacy-raw-sqlite")
	for suf, want := range sums {
		if got, _ := os.ReadFile(raw + suf); !bytes.Equal(got, want) {
			t.Fatalf("the raw copy's state.db%s was modified", suf)
		}
	}
	fresh := t.TempDir()
	adapterCLI(t, storeURL, env, fresh).restoreAdapter("hermes")
	got := filepath.Join(fresh, "hermes", "state.db")
	dbRows(t, got)
	if n := countUpTo(t, got, before); n != before {
		t.Fatalf("migrated database holds %d of the %d rows committed before the copy", n, before)
	}
}
