package adapters

import (
	"bufio"
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The writer runs as a separate OS process: this test binary re-executed
// with writerEnv set, running TestHelperSQLiteWriter only.
const (
	writerEnv        = "AGENTSTATE_TEST_SQLITE_WRITER" // mode: "wal" or "hotjournal"
	writerDBEnv      = "AGENTSTATE_TEST_SQLITE_WRITER_DB"
	writerAutoCkpEnv = "AGENTSTATE_TEST_SQLITE_WRITER_AUTOCHECKPOINT"
	rowsPerTxn       = 5
)

const schema = `CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, txn INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS t_txn ON t(txn);`

// TestHelperSQLiteWriter is not a test: it is the body of the writer
// process. In "wal" mode it opens the database like opencode does (WAL,
// synchronous=NORMAL, busy timeout 5 s) and commits transactions of
// rowsPerTxn rows forever, printing "c <last id> <unix ns>" after each
// COMMIT returned. In "hotjournal" mode it commits 100 rows in rollback
// (DELETE) mode, then leaves a large transaction open whose pages spilled
// into the database file, prints "ready" and waits to be killed. It exits
// when its stdin closes (the test went away).
func TestHelperSQLiteWriter(t *testing.T) {
	mode := os.Getenv(writerEnv)
	if mode == "" {
		t.Skip("helper process only")
	}
	go func() {
		io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	if err := runWriter(mode, os.Getenv(writerDBEnv), os.Getenv(writerAutoCkpEnv)); err != nil {
		fmt.Fprintln(os.Stderr, "writer:", err)
		os.Exit(3)
	}
	os.Exit(0)
}

func runWriter(mode, path, autockpt string) error {
	ctx := context.Background()
	var q string
	switch mode {
	case "wal":
		q = "_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_pragma=busy_timeout(5000)"
		if autockpt != "" {
			q += "&_pragma=wal_autocheckpoint(" + autockpt + ")"
		}
	case "hotjournal":
		q = "_pragma=journal_mode(DELETE)&_pragma=cache_size(10)&_pragma=busy_timeout(5000)"
	default:
		return fmt.Errorf("unknown mode %q", mode)
	}
	db, err := sql.Open("sqlite", fileURI(path, q))
	if err != nil {
		return err
	}
	db.SetMaxOpenConns(1)
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	if _, err := conn.ExecContext(ctx, schema); err != nil {
		return err
	}
	var next int64
	if err := conn.QueryRowContext(ctx, "SELECT coalesce(max(id), 0) + 1 FROM t").Scan(&next); err != nil {
		return err
	}
	txn := func(rows, size int, commit bool) error {
		if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
			return err
		}
		for range rows {
			if _, err := conn.ExecContext(ctx, "INSERT INTO t(id, txn, payload) VALUES(?, ?, randomblob(?))",
				next, (next-1)/rowsPerTxn, size); err != nil {
				return err
			}
			next++
		}
		if !commit {
			return nil
		}
		_, err := conn.ExecContext(ctx, "COMMIT")
		return err
	}
	if mode == "hotjournal" {
		for range 100 / rowsPerTxn {
			if err := txn(rowsPerTxn, 1000, true); err != nil {
				return err
			}
		}
		if err := txn(300, 1000, false); err != nil {
			return err
		}
		fmt.Println("ready")
		select {}
	}
	out := bufio.NewWriter(os.Stdout)
	for {
		if err := txn(rowsPerTxn, 100, true); err != nil {
			return err
		}
		fmt.Fprintf(out, "c %d %d\n", next-1, time.Now().UnixNano())
		out.Flush()
		time.Sleep(200 * time.Microsecond)
	}
}

type commit struct{ id, at int64 }

type writer struct {
	t     testing.TB
	cmd   *exec.Cmd
	stdin io.WriteCloser
	ready chan struct{}
	done  chan struct{}

	mu      sync.Mutex
	commits []commit
}

func startWriter(t testing.TB, mode, path string, env ...string) *writer {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestHelperSQLiteWriter$")
	cmd.Env = append(os.Environ(), writerEnv+"="+mode, writerDBEnv+"="+path)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &writer{t: t, cmd: cmd, stdin: stdin, ready: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		sc := bufio.NewScanner(stdout)
		readyOnce := sync.OnceFunc(func() { close(w.ready) })
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			switch {
			case len(f) == 1 && f[0] == "ready":
				readyOnce()
			case len(f) == 3 && f[0] == "c":
				id, _ := strconv.ParseInt(f[1], 10, 64)
				at, _ := strconv.ParseInt(f[2], 10, 64)
				w.mu.Lock()
				w.commits = append(w.commits, commit{id, at})
				w.mu.Unlock()
			}
		}
	}()
	t.Cleanup(w.kill)
	return w
}

// last is the id of the last row the writer reported committed.
func (w *writer) last() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.commits) == 0 {
		return 0
	}
	return w.commits[len(w.commits)-1].id
}

func (w *writer) waitFor(id int64) {
	w.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for w.last() < id {
		select {
		case <-w.done:
			w.t.Fatalf("writer exited after id %d, waiting for %d", w.last(), id)
		default:
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("writer reached id %d, waiting for %d", w.last(), id)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (w *writer) waitReady() {
	w.t.Helper()
	select {
	case <-w.ready:
	case <-w.done:
		w.t.Fatal("writer exited before it was ready")
	case <-time.After(30 * time.Second):
		w.t.Fatal("writer not ready")
	}
}

// maxGap is the longest time between two consecutive commits that ended in
// [from, to], and how many commits there were.
func (w *writer) maxGap(from, to time.Time) (time.Duration, int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var gap int64
	n := 0
	for i := 1; i < len(w.commits); i++ {
		at := w.commits[i].at
		if at < from.UnixNano() || at > to.UnixNano() {
			continue
		}
		n++
		gap = max(gap, at-w.commits[i-1].at)
	}
	return time.Duration(gap), n
}

// kill SIGKILLs the writer and waits until it is gone and its output read.
func (w *writer) kill() {
	if w.cmd.ProcessState != nil {
		return
	}
	w.cmd.Process.Signal(syscall.SIGKILL)
	w.cmd.Wait()
	<-w.done
	w.stdin.Close()
}

func stagingDir(t testing.TB) string {
	t.Helper()
	d := filepath.Join(t.TempDir(), "staging")
	if err := os.Mkdir(d, 0o700); err != nil {
		t.Fatal(err)
	}
	return d
}

// checkSnapshot asserts what every snapshot must be: one 0600 file with no
// companions that passes QuickCheck, holding a contiguous run of ids
// 1..max made of whole transactions, with max ≥ atLeast. It returns max.
func checkSnapshot(t testing.TB, path string, atLeast int64) int64 {
	t.Helper()
	ctx := context.Background()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("%s has mode %04o, want 0600", path, fi.Mode().Perm())
	}
	assertNoCompanions(t, path)
	if err := QuickCheck(ctx, path); err != nil {
		t.Fatalf("QuickCheck(snapshot): %v", err)
	}
	n, lo, hi := countRows(t, path)
	if n > 0 && (lo != 1 || hi != n) {
		t.Fatalf("snapshot ids not contiguous: %d rows, min %d, max %d", n, lo, hi)
	}
	if hi%rowsPerTxn != 0 {
		t.Fatalf("snapshot has max id %d: a partial transaction", hi)
	}
	if hi < atLeast {
		t.Fatalf("snapshot holds ids up to %d, but %d were committed before it began", hi, atLeast)
	}
	assertNoCompanions(t, path) // checking did not create any
	return hi
}

func assertNoCompanions(t testing.TB, path string) {
	t.Helper()
	for _, s := range []string{"-wal", "-shm", "-journal"} {
		if _, err := os.Lstat(path + s); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s%s exists beside the snapshot (%v)", path, s, err)
		}
	}
}

func countRows(t testing.TB, path string) (n, lo, hi int64) {
	t.Helper()
	db, err := sql.Open("sqlite", fileURI(path, "mode=ro&immutable=1"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.QueryRow("SELECT count(*), coalesce(min(id), 0), coalesce(max(id), 0) FROM t").Scan(&n, &lo, &hi); err != nil {
		t.Fatalf("count rows of %s: %v", path, err)
	}
	return
}

// fileHashes hashes every file in dir except the -shm (which WAL readers
// legitimately rewrite).
func fileHashes(t testing.TB, dir string) map[string]string {
	t.Helper()
	m := map[string]string{}
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(e.Name(), "-shm") {
			m[e.Name()] = "present"
			continue
		}
		m[e.Name()] = fmt.Sprintf("%d/%x", len(b), sha256.Sum256(b))
	}
	return m
}

func assertSameFiles(t testing.TB, before, after map[string]string) {
	t.Helper()
	if fmt.Sprint(before) != fmt.Sprint(after) {
		t.Fatalf("source files changed:\nbefore %v\nafter  %v", before, after)
	}
}

func TestSnapshotWhileWriterRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	src := filepath.Join(dir, "opencode.db")
	stage := stagingDir(t)
	w := startWriter(t, "wal", src)
	w.waitFor(2000)

	var prev int64
	start := time.Now()
	for i := range 6 {
		before := w.last()
		dst := filepath.Join(stage, fmt.Sprintf("snap-%d.db", i))
		step := int32(defaultStepPages)
		if i%2 == 1 {
			step = 7 // many steps inside the one read transaction
		}
		info, err := snapshot(ctx, src, dst, false, backupOpts{step: step})
		if err != nil {
			t.Fatalf("snapshot %d: %v", i, err)
		}
		after := w.last()
		got := checkSnapshot(t, dst, before)
		if got < prev {
			t.Fatalf("snapshot %d went back in time: %d < %d", i, got, prev)
		}
		prev = got
		if info.PageSize != 4096 || info.PageCount < 2 || info.Size != int64(info.PageSize)*info.PageCount || info.FromCopy {
			t.Fatalf("snapshot %d info = %+v", i, info)
		}
		if !info.Source.DB.Exists || !info.Source.WAL.Exists {
			t.Fatalf("snapshot %d source stamp = %+v", i, info.Source)
		}
		t.Logf("snapshot %d (step %d): %d pages in %v; committed before %d, in snapshot %d, after %d",
			i, step, info.PageCount, info.Duration.Round(time.Microsecond), before, got, after)
		w.waitFor(after + 200)
	}
	// The writer was never held up for long.
	gap, n := w.maxGap(start, time.Now())
	t.Logf("writer: %d commits during the snapshots, longest gap %v", n, gap)
	if n < 100 || gap > 2*time.Second {
		t.Fatalf("writer blocked: %d commits, longest gap %v", n, gap)
	}

	// A raw copy taken while the writer runs (the legacy script's way) is
	// either recovered into a valid snapshot or refused; never a bad dst.
	raw := filepath.Join(t.TempDir(), "raw")
	if err := os.Mkdir(raw, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"", "-wal", "-shm"} {
		copyForTest(t, src+s, filepath.Join(raw, "opencode.db"+s))
	}
	dst := filepath.Join(stage, "raw.db")
	if _, err := SnapshotRawCopy(ctx, filepath.Join(raw, "opencode.db"), dst); err != nil {
		t.Logf("racing raw copy refused: %v", err)
		if _, serr := os.Stat(dst); !errors.Is(serr, fs.ErrNotExist) {
			t.Fatalf("failed raw snapshot left %s (%v)", dst, serr)
		}
	} else {
		t.Logf("racing raw copy recovered: ids up to %d", checkSnapshot(t, dst, 0))
	}

	// SIGKILL the writer: the database it leaves (db + -wal + -shm, nobody
	// attached) snapshots consistently, with every reported commit, and
	// neither the db nor the -wal is touched (no checkpoint from us).
	w.kill()
	last := w.last()
	files := fileHashes(t, dir)
	if _, ok := files["opencode.db-wal"]; !ok {
		t.Fatalf("killed writer left no -wal: %v", files)
	}
	dst = filepath.Join(stage, "after-kill.db")
	info, err := Snapshot(ctx, src, dst)
	if err != nil {
		t.Fatal(err)
	}
	got := checkSnapshot(t, dst, last)
	t.Logf("after SIGKILL: last reported %d, snapshot has %d (%d pages)", last, got, info.PageCount)
	assertSameFiles(t, files, fileHashes(t, dir))
	if !LocalIsValid(ctx, src) {
		t.Fatal("LocalIsValid(killed writer's db) = false")
	}
	assertSameFiles(t, files, fileHashes(t, dir))
}

func copyForTest(t testing.TB, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestSnapshotRawCopyMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	live := filepath.Join(t.TempDir(), "state.db")
	// No automatic checkpoint: the main file stays put while the WAL grows,
	// so a raw copy of db then -wal then -shm is the shape the legacy script
	// left behind — a WAL possibly torn at its tail.
	w := startWriter(t, "wal", live, writerAutoCkpEnv+"=0")
	w.waitFor(1500)
	legacy := filepath.Join(t.TempDir(), "legacy")
	if err := os.Mkdir(legacy, 0o700); err != nil {
		t.Fatal(err)
	}
	before := w.last()
	for _, s := range []string{"", "-wal", "-shm"} {
		copyForTest(t, live+s, filepath.Join(legacy, "state.db"+s))
	}
	w.kill()

	src := filepath.Join(legacy, "state.db")
	files := fileHashes(t, legacy)
	stage := stagingDir(t)
	dst := filepath.Join(stage, "state.db")
	info, err := SnapshotRawCopy(ctx, src, dst)
	if err != nil {
		t.Fatal(err)
	}
	got := checkSnapshot(t, dst, before)
	if !info.FromCopy {
		t.Fatal("FromCopy = false")
	}
	t.Logf("raw copy: committed before copy %d, recovered %d, %d pages", before, got, info.PageCount)
	assertSameFiles(t, files, fileHashes(t, legacy))
	if es, _ := os.ReadDir(stage); len(es) != 1 {
		t.Fatalf("staging directory holds %d entries, want only the snapshot", len(es))
	}

	// A WAL cut in the middle of a frame: recovery keeps the whole
	// transactions before the cut.
	wi, err := os.Stat(src + "-wal")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(src+"-wal", wi.Size()-3000); err != nil {
		t.Fatal(err)
	}
	dst2 := filepath.Join(stage, "torn.db")
	if _, err := SnapshotRawCopy(ctx, src, dst2); err != nil {
		t.Fatal(err)
	}
	torn := checkSnapshot(t, dst2, 1)
	if torn >= got || torn < got-100 {
		t.Fatalf("torn WAL recovered ids up to %d, full one %d", torn, got)
	}
}

func TestSnapshotCorrupt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	stage := stagingDir(t)
	good := filepath.Join(dir, "good.db")
	makeDB(t, good, "DELETE", 3000, 200)
	fi, _ := os.Stat(good)
	pages := fi.Size() / 4096
	if pages < 100 {
		t.Fatalf("only %d pages", pages)
	}

	corrupt := filepath.Join(dir, "corrupt.db")
	copyForTest(t, good, corrupt)
	garbage := make([]byte, 3*4096)
	for i := range garbage {
		garbage[i] = byte(i*7 + 0x5a)
	}
	f, err := os.OpenFile(corrupt, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(garbage, pages/2*4096); err != nil {
		t.Fatal(err)
	}
	f.Close()

	// A few bytes: the cell pointers of one page point out of the page.
	pointers := filepath.Join(dir, "pointers.db")
	copyForTest(t, good, pointers)
	f, err = os.OpenFile(pointers, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{0xff, 0xf0, 0xff, 0xf0, 0xff, 0xf0}, pages/3*4096+8); err != nil {
		t.Fatal(err)
	}
	f.Close()

	// Structurally sound, but quick_check reports rows: NULLs in a NOT NULL
	// column (the schema edited behind SQLite's back).
	nulls := filepath.Join(dir, "nulls.db")
	copyForTest(t, good, nulls)
	ndb, err := sql.Open("sqlite", fileURI(nulls, ""))
	if err != nil {
		t.Fatal(err)
	}
	ndb.SetMaxOpenConns(1)
	for _, q := range []string{
		"CREATE TABLE n(a TEXT)",
		"INSERT INTO n VALUES(NULL), (NULL)",
		"PRAGMA writable_schema=ON",
		"UPDATE sqlite_schema SET sql = 'CREATE TABLE n(a TEXT NOT NULL)' WHERE name = 'n'",
	} {
		if _, err := ndb.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	ndb.Close()

	truncated := filepath.Join(dir, "truncated.db")
	copyForTest(t, good, truncated)
	if err := os.Truncate(truncated, pages/2*4096); err != nil {
		t.Fatal(err)
	}

	notdb := filepath.Join(dir, "notes.db")
	if err := os.WriteFile(notdb, []byte(strings.Repeat("this is not a database\n", 400)), 0o600); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name  string
		path  string
		notDB bool
	}{{"corrupt pages", corrupt, false}, {"bad cell pointers", pointers, false}, {"NOT NULL violated", nulls, false}, {"truncated", truncated, false}, {"not a database", notdb, true}} {
		dst := filepath.Join(stage, filepath.Base(c.path))
		// A stale staging file from an earlier run must not survive either.
		copyForTest(t, good, dst)
		_, err := Snapshot(ctx, c.path, dst)
		if !errors.Is(err, ErrCorrupt) || errors.Is(err, ErrNotDatabase) != c.notDB {
			t.Fatalf("%s: Snapshot err = %v, want ErrCorrupt (ErrNotDatabase %v)", c.name, err, c.notDB)
		}
		t.Logf("%s: %v", c.name, err)
		if _, serr := os.Stat(dst); !errors.Is(serr, fs.ErrNotExist) {
			t.Fatalf("%s: failed snapshot left %s (%v)", c.name, dst, serr)
		}
		assertNoCompanions(t, dst)
		err = QuickCheck(ctx, c.path)
		if !errors.Is(err, ErrCorrupt) || errors.Is(err, ErrNotDatabase) != c.notDB {
			t.Fatalf("%s: QuickCheck err = %v", c.name, err)
		}
		if LocalIsValid(ctx, c.path) {
			t.Fatalf("%s: LocalIsValid = true", c.name)
		}
	}
	if err := QuickCheck(ctx, good); err != nil {
		t.Fatal(err)
	}
	// The healthy rollback-mode database snapshots to the same content.
	files := fileHashes(t, dir)
	dst := filepath.Join(stage, "good.db")
	if _, err := Snapshot(ctx, good, dst); err != nil {
		t.Fatal(err)
	}
	checkSnapshot(t, dst, 3000)
	if contentHash(t, dst) != contentHash(t, good) {
		t.Fatal("snapshot of a rollback-mode database differs from it")
	}
	assertSameFiles(t, files, fileHashes(t, dir))
	if !LocalIsValid(ctx, good) {
		t.Fatal("LocalIsValid(good) = false")
	}
}

// makeDB creates a database of rows rows with payloads of size bytes.
func makeDB(t testing.TB, path, journal string, rows, size int) {
	t.Helper()
	db, err := sql.Open("sqlite", fileURI(path, "_pragma=journal_mode("+journal+")"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(schema); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < ?)
		INSERT INTO t(id, txn, payload) SELECT x, (x-1)/?, randomblob(?) FROM c`, rows, rowsPerTxn, size); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
}

func contentHash(t testing.TB, path string) string {
	t.Helper()
	db, err := sql.Open("sqlite", fileURI(path, "mode=ro"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	rows, err := db.Query("SELECT id, txn, payload FROM t ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	h := sha256.New()
	for rows.Next() {
		var id, txn int64
		var p []byte
		if err := rows.Scan(&id, &txn, &p); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(h, "%d %d %x\n", id, txn, p)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

// TestSnapshotIsOneReadTransaction commits to the source between backup
// steps: the snapshot must be the database as of the start of the backup,
// not restart and chase the writer (it would if each Step took its own read
// transaction).
func TestSnapshotIsOneReadTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	src := filepath.Join(t.TempDir(), "src.db")
	makeDB(t, src, "WAL", 400, 500)
	w, err := sql.Open("sqlite", fileURI(src, "_pragma=busy_timeout(5000)"))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	steps, next := 0, 401
	dst := filepath.Join(stagingDir(t), "s.db")
	_, err = snapshot(ctx, src, dst, false, backupOpts{step: 3, afterStep: func() {
		steps++
		if _, err := w.Exec("INSERT INTO t(id, txn, payload) VALUES(?, ?, randomblob(500))", next, (next-1)/rowsPerTxn); err != nil {
			t.Error(err)
		}
		next++
	}})
	if err != nil {
		t.Fatal(err)
	}
	if got := checkSnapshot(t, dst, 400); got != 400 || steps < 20 {
		t.Fatalf("snapshot holds ids up to %d after %d steps (%d committed meanwhile), want exactly 400", got, steps, next-401)
	}
}

func TestSnapshotCancelledMidway(t *testing.T) {
	t.Parallel()
	src := filepath.Join(t.TempDir(), "src.db")
	makeDB(t, src, "WAL", 400, 500)
	stage := stagingDir(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := snapshot(ctx, src, filepath.Join(stage, "s.db"), false, backupOpts{step: 5, afterStep: cancel})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if es, _ := os.ReadDir(stage); len(es) != 0 {
		t.Fatalf("a cancelled snapshot left %d entries in staging", len(es))
	}
}

func TestSnapshotLargeDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	src := filepath.Join(t.TempDir(), "big.db")
	makeDB(t, src, "WAL", 5000, 1000)
	// Leave part of the content in the WAL, as a live harness does.
	db, err := sql.Open("sqlite", fileURI(src, "_pragma=wal_autocheckpoint(0)"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`UPDATE t SET payload = randomblob(1000) WHERE id % 50 = 0`); err != nil {
		t.Fatal(err)
	}
	want := contentHash(t, src)

	dst := filepath.Join(stagingDir(t), "big.db")
	info, err := Snapshot(ctx, src, dst)
	if err != nil {
		t.Fatal(err)
	}
	if info.PageCount < 1000 || info.PageSize != 4096 || info.Size != info.PageCount*4096 {
		t.Fatalf("info = %+v", info)
	}
	checkSnapshot(t, dst, 5000)
	if got := contentHash(t, dst); got != want {
		t.Fatal("snapshot content differs from the source")
	}
	t.Logf("%d pages (%d MiB) in %v", info.PageCount, info.Size>>20, info.Duration)

	// The page size is reported, not assumed.
	src8 := filepath.Join(t.TempDir(), "p8k.db")
	d8, err := sql.Open("sqlite", fileURI(src8, "_pragma=page_size(8192)"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d8.Exec(schema + "INSERT INTO t VALUES(1, 0, x'00');"); err != nil {
		t.Fatal(err)
	}
	d8.Close()
	info, err = Snapshot(ctx, src8, filepath.Join(filepath.Dir(dst), "p8k.db"))
	if err != nil {
		t.Fatal(err)
	}
	if info.PageSize != 8192 || info.Size != info.PageCount*8192 {
		t.Fatalf("8 KiB pages: info = %+v", info)
	}
}

func TestPlaceRestoredRemovesStaleCompanions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	home := t.TempDir()
	stage := stagingDir(t)

	// The checkpoint copy: 35 rows, verified.
	other := filepath.Join(t.TempDir(), "src.db")
	makeDB(t, other, "WAL", 35, 50)
	snap := filepath.Join(stage, "snap.db")
	if _, err := Snapshot(ctx, other, snap); err != nil {
		t.Fatal(err)
	}
	want := contentHash(t, snap)

	// The local database is a crashed harness's: db + -wal with frames of
	// committed rows + -shm, plus a stale -journal.
	mkStale := func(dst string) {
		w := startWriter(t, "wal", dst, writerAutoCkpEnv+"=0")
		w.waitFor(500)
		w.kill()
		if err := os.WriteFile(dst+"-journal", []byte("stale journal"), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, s := range []string{"-wal", "-shm"} {
			if fi, err := os.Stat(dst + s); err != nil || fi.Size() == 0 {
				t.Fatalf("no stale %s: %v", s, err)
			}
		}
	}

	// Control: renaming without removing the stale WAL gives SQLite a
	// database that is not the checkpoint (it replays the old frames).
	ctrl := filepath.Join(t.TempDir(), "state.db")
	mkStale(ctrl)
	os.Remove(ctrl + "-journal")
	staged := filepath.Join(filepath.Dir(ctrl), ".state.db.restore")
	copyForTest(t, snap, staged)
	if err := os.Rename(staged, ctrl); err != nil {
		t.Fatal(err)
	}
	if n, _, _, err := countRowsLoose(ctrl); err == nil && n == 35 {
		t.Fatal("control: SQLite ignored the stale WAL, so this test could not tell PlaceRestored's removal from none")
	} else {
		t.Logf("control: plain rename shows %d rows (err %v), not 35: the stale WAL was replayed", n, err)
	}

	dst := filepath.Join(home, "state.db")
	mkStale(dst)
	staged = filepath.Join(home, ".state.db.restore")
	copyForTest(t, snap, staged)
	if err := PlaceRestored(ctx, staged, dst); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"-wal", "-shm", "-journal"} {
		if _, err := os.Lstat(dst + s); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("%s%s still exists (%v)", dst, s, err)
		}
	}
	if _, err := os.Lstat(staged); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("staged file still exists (%v)", err)
	}
	if got := contentHash(t, dst); got != want {
		t.Fatal("restored database is not the checkpoint")
	}
	if !LocalIsValid(ctx, dst) {
		t.Fatal("LocalIsValid(restored) = false")
	}

	// Refusals: another directory, not a database.
	if err := PlaceRestored(ctx, snap, dst); err == nil {
		t.Fatal("PlaceRestored from another directory succeeded")
	}
	bogus := filepath.Join(home, ".bogus")
	if err := os.WriteFile(bogus, []byte("hello, not sqlite at all"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := PlaceRestored(ctx, bogus, dst); !errors.Is(err, ErrNotDatabase) {
		t.Fatalf("PlaceRestored(not a database) = %v", err)
	}
	if got := contentHash(t, dst); got != want {
		t.Fatal("a refused PlaceRestored changed dst")
	}
}

func countRowsLoose(path string) (n, lo, hi int64, err error) {
	db, err := sql.Open("sqlite", fileURI(path, ""))
	if err != nil {
		return
	}
	defer db.Close()
	err = db.QueryRow("SELECT count(*), coalesce(min(id), 0), coalesce(max(id), 0) FROM t").Scan(&n, &lo, &hi)
	return
}

func TestSnapshotHotJournal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	src := filepath.Join(dir, "state.db")
	w := startWriter(t, "hotjournal", src)
	w.waitReady()
	w.kill()
	if _, err := os.Stat(src + "-journal"); err != nil {
		t.Fatalf("no hot journal: %v", err)
	}
	files := fileHashes(t, dir)
	stage := stagingDir(t)

	// Just after the crash the files may still be settling: refused.
	if fi, _ := os.Stat(src); time.Since(fi.ModTime()) < racyWindow/2 {
		if _, err := Snapshot(ctx, src, filepath.Join(stage, "early.db")); !errors.Is(err, ErrSourceChanged) {
			t.Fatalf("snapshot right after the crash: %v, want ErrSourceChanged", err)
		}
	}
	time.Sleep(racyWindow + 100*time.Millisecond)

	dst := filepath.Join(stage, "state.db")
	info, err := Snapshot(ctx, src, dst)
	if err != nil {
		t.Fatal(err)
	}
	if !info.FromCopy {
		t.Fatal("FromCopy = false for a hot journal")
	}
	if got := checkSnapshot(t, dst, 100); got != 100 {
		t.Fatalf("snapshot holds %d rows, want the 100 committed", got)
	}
	if !LocalIsValid(ctx, src) {
		t.Fatal("LocalIsValid(db with hot journal) = false")
	}
	if err := QuickCheck(ctx, src); err != nil {
		t.Fatal(err)
	}
	assertSameFiles(t, files, fileHashes(t, dir))
	if es, _ := os.ReadDir(stage); len(es) != 1 {
		t.Fatalf("staging directory holds %d entries, want only the snapshot", len(es))
	}
}

func TestDBStamp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	stage := stagingDir(t)

	// A WAL database closed cleanly: no -wal, no -shm.
	closed := filepath.Join(dir, "closed.db")
	makeDB(t, closed, "WAL", 20, 10)
	// A WAL database held open by a connection with frames in its -wal.
	open := filepath.Join(dir, "open.db")
	makeDB(t, open, "WAL", 20, 10)
	db, err := sql.Open("sqlite", fileURI(open, "_pragma=wal_autocheckpoint(0)"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.Exec("INSERT INTO t VALUES(21, 4, x'01')"); err != nil {
		t.Fatal(err)
	}

	s0, err := DBStamp(open)
	if err != nil {
		t.Fatal(err)
	}
	if !s0.Racy() {
		t.Fatal("a stamp just after a write is not racy")
	}
	if s, _ := DBStamp(open); s.Unchanged(s0) || s.Key() == s0.Key() {
		t.Fatal("Unchanged after a racy stamp")
	}
	time.Sleep(racyWindow + 100*time.Millisecond)

	for _, p := range []string{closed, open} {
		s1, err := DBStamp(p)
		if err != nil {
			t.Fatal(err)
		}
		if s1.Racy() {
			t.Fatalf("%s: racy after %v", p, racyWindow)
		}
		// Our own snapshot does not make an idle database look changed
		// (even though it creates -wal and -shm beside a closed one).
		if _, err := Snapshot(ctx, p, filepath.Join(stage, filepath.Base(p))); err != nil {
			t.Fatal(err)
		}
		s2, err := DBStamp(p)
		if err != nil {
			t.Fatal(err)
		}
		if !s2.Unchanged(s1) || s2.Key() != s1.Key() {
			t.Fatalf("%s: snapshot changed the stamp:\n%+v %s\n%+v %s", p, s1, s1.Key(), s2, s2.Key())
		}
		if s1.WAL.Exists && s2.WAL.CTime != s1.WAL.CTime {
			t.Logf("%s: the snapshot moved the -wal's ctime (SQLite fchowns it when run as root): ignored", p)
		}
		if !s2.SHM {
			t.Fatalf("%s: no -shm after a snapshot", p)
		}
	}
	s1, _ := DBStamp(open)
	if !s1.WAL.Exists || s1.WAL.Size == 0 {
		t.Fatalf("open database has no -wal: %+v", s1)
	}
	if _, err := db.Exec("INSERT INTO t VALUES(22, 4, x'02')"); err != nil {
		t.Fatal(err)
	}
	if s2, _ := DBStamp(open); s2.Unchanged(s1) || s2.Key() == s1.Key() {
		t.Fatal("a commit to the WAL went unnoticed")
	}
	// A checkpoint moves the content into the main file.
	if _, err := db.Exec("PRAGMA wal_checkpoint(TRUNCATE)"); err != nil {
		t.Fatal(err)
	}
	if s3, _ := DBStamp(open); s3.Unchanged(s1) || s3.Key() == s1.Key() {
		t.Fatal("a checkpoint went unnoticed")
	}
	// A database replaced by rename (a restore) is a change.
	s4, _ := DBStamp(closed)
	repl := filepath.Join(dir, ".closed.new")
	copyForTest(t, closed, repl)
	fi, _ := os.Stat(closed)
	os.Chtimes(repl, fi.ModTime(), fi.ModTime())
	if err := os.Rename(repl, closed); err != nil {
		t.Fatal(err)
	}
	if s5, _ := DBStamp(closed); s5.Unchanged(s4) || s5.Key() == s4.Key() {
		t.Fatal("a replaced database went unnoticed")
	}
	if _, err := DBStamp(filepath.Join(dir, "missing.db")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("DBStamp(missing) = %v", err)
	}
}

func TestSnapshotRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	src := filepath.Join(dir, "a.db")
	makeDB(t, src, "WAL", 10, 10)
	stage := stagingDir(t)

	if _, err := Snapshot(ctx, filepath.Join(dir, "missing.db"), filepath.Join(stage, "x.db")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing source: %v", err)
	}
	if _, err := Snapshot(ctx, src, filepath.Join(dir, "copy.db")); err == nil {
		t.Fatal("staging in the source's directory accepted")
	}
	open := filepath.Join(t.TempDir(), "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Snapshot(ctx, src, filepath.Join(open, "x.db")); err == nil {
		t.Fatal("a 0755 staging directory accepted")
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := Snapshot(cancelled, src, filepath.Join(stage, "c.db")); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	if es, _ := os.ReadDir(stage); len(es) != 0 {
		t.Fatalf("refused snapshots left %d entries in staging", len(es))
	}
	// An empty file is an empty database: it snapshots (0 pages), but it
	// is not a local database worth keeping over a checkpoint.
	empty := filepath.Join(dir, "empty.db")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	info, err := Snapshot(ctx, empty, filepath.Join(stage, "empty.db"))
	if err != nil || info.PageCount > 1 || info.Size != int64(info.PageSize)*info.PageCount {
		t.Fatalf("empty: %+v, %v", info, err)
	}
	if LocalIsValid(ctx, empty) || LocalIsValid(ctx, filepath.Join(dir, "missing.db")) {
		t.Fatal("LocalIsValid(empty or missing) = true")
	}
}

// BenchmarkSnapshot snapshots a ~256 MiB database, idle and while a writer
// process commits into it.
func BenchmarkSnapshot(b *testing.B) {
	src := filepath.Join(b.TempDir(), "big.db")
	makeDB(b, src, "WAL", 65536, 4000)
	fi, err := os.Stat(src)
	if err != nil {
		b.Fatal(err)
	}
	stage := stagingDir(b)
	run := func(b *testing.B) {
		ctx := context.Background()
		dst := filepath.Join(stage, "snap.db")
		var d []time.Duration
		b.SetBytes(fi.Size())
		for b.Loop() {
			info, err := Snapshot(ctx, src, dst)
			if err != nil {
				b.Fatal(err)
			}
			d = append(d, info.Duration)
		}
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		b.ReportMetric(float64(d[len(d)/2].Milliseconds()), "ms/snapshot-p50")
	}
	b.Run("idle", run)
	b.Run("writer-active", func(b *testing.B) {
		w := startWriter(b, "wal", src)
		w.waitFor(w.last() + 500)
		start := time.Now()
		run(b)
		gap, n := w.maxGap(start, time.Now())
		b.ReportMetric(float64(gap.Milliseconds()), "ms-writer-max-gap")
		b.ReportMetric(float64(n), "writer-commits")
	})
}
