package adapters

// SQLite capture, validation and restore placement (issue #3, design
// invariant 7).
//
// How the live source is opened. Snapshot opens the harness's database as
// file:<path>?mode=ro with a 5 s busy timeout and copies it with SQLite's
// online backup API. mode=ro opens the database file O_RDONLY, so nothing
// this package does can write it: a read-only connection cannot checkpoint
// the WAL into the main file, and because the WAL is deleted only after a
// successful checkpoint, it leaves the -wal alone too (readers never write
// the WAL). What a read-only connection still writes is the -shm, the
// shared-memory wal-index every WAL reader must use to take a read mark:
// that is how our snapshot stays consistent while the harness keeps
// committing, and it holds no data (SQLite rebuilds it from the WAL). If no
// other connection has the database open (the harness was SIGKILLed), the
// first opener truncates and rebuilds the -shm from the WAL — the harness
// would do the same on its next start. On a WAL database that was closed
// cleanly (no -wal beside it) a read-only open creates an empty -wal and a
// -shm and leaves them; DBStamp treats "no -wal" and "empty -wal" as the
// same content so this does not look like a change.
//
// The alternatives are worse: a read-write connection that happens to be the
// last one to close checkpoints the WAL into the source and deletes it (and
// one that meets a hot journal rolls it back into the source); immutable=1
// takes no locks and promises SQLite that nobody changes the file, so it can
// read pages a checkpoint is rewriting; readonly_shm=1 cannot take read
// marks, so SQLite must fall back to a slower, retrying read path.
//
// Checked by the tests: after a SIGKILLed writer (db + -wal + -shm, nobody
// attached) a Snapshot leaves the db and the -wal byte-identical and the
// -wal in place; a hot journal is left in place, untouched.
//
// Consistency. Snapshot opens one read transaction on the source (BEGIN and
// a read of the schema) before the backup starts, and every Backup.Step runs
// inside it (sqlite3_backup_step only opens, and then closes, a read
// transaction of its own when the source has none). So the copy is exactly
// the database as of that read transaction: every transaction committed
// before Snapshot was called is in it, nothing half-committed is, and it
// stays so even though Step is called in chunks so that ctx is honoured
// (a backup whose own read transaction ended between steps would restart,
// or under a steady writer never finish). In WAL mode the read transaction
// never blocks the writer; it only keeps checkpoints from passing our
// snapshot until we finish. In rollback (DELETE) mode — Hermes on network
// or FUSE file systems — the read transaction is a SHARED lock, so a writer
// waits (on its own busy timeout, 5 s for opencode/Hermes) until the
// backup ends; BenchmarkSnapshot measures how long that is.
//
// Busy timeout 5 s, as opencode uses: it covers the moments a WAL reader can
// meet SQLITE_BUSY (another connection running WAL recovery) and a
// rollback-mode writer holding its lock while it commits.
//
// When the read-only open cannot work — a rollback-mode database with a hot
// journal (the harness crashed mid-transaction; rolling it back would write
// the source, so SQLite answers SQLITE_READONLY_ROLLBACK), or a WAL that
// cannot be recovered read-only — Snapshot falls back to a private copy: db,
// -wal and -journal are copied into a 0700 temporary directory inside the
// staging directory, stamped before and after so that a copy some process
// wrote to meanwhile is refused (ErrSourceChanged), and SQLite recovers the
// copy there (rolls back the journal / replays the WAL) before the backup.
// SnapshotRawCopy takes the same path for the legacy raw copies made by the
// old rsync script. The -shm is never copied: it is a cache SQLite rebuilds
// from the WAL, and a torn copy of it could only mislead.
//
// The copy. The backup destination is a fresh 0600 file in a 0700 staging
// directory (Snapshot refuses anything else), written with journal_mode=OFF
// and synchronous=OFF: it is scratch until checked, and discarded on any
// failure, so a rollback journal and per-commit fsyncs would only cost time
// (the final fsync makes it durable). The backup copies page 1
// verbatim, so the copy still says "WAL" in its header; Snapshot reopens it,
// switches it to journal_mode=DELETE (which leaves one self-contained file),
// runs PRAGMA quick_check (exactly one row "ok", else ErrCorrupt), checks
// that no -wal, -shm or -journal is left beside it, and fsyncs the file and
// the directory. A failed snapshot removes its destination, so a corrupt
// live database can never produce a file that passes.
//
// What modernc.org/sqlite v1.62 offers: the driver connection (reached with
// (*sql.Conn).Raw) has NewBackup(dstURI) (*sqlite.Backup, error), which opens
// dstURI as a second, private connection; Backup.Step(n) returns (more,
// err), with n<0 meaning all remaining pages; Backup.Finish releases the
// backup and closes the destination connection (Commit keeps it open and
// hands it back as a driver.Conn); PageCount/Remaining report progress.
// Errors are *sqlite.Error with extended result codes (Code()&0xff is the
// primary code). Step's error is reported from the source connection even
// when the destination failed. NewBackup's URI goes through the driver's DSN
// parsing, so _pragma parameters apply to the destination connection.
//
// Running as root, SQLite fchowns a -wal or -journal to the database's owner
// each time it opens one, which moves the file's ctime: any reader, ours
// included, does it. Change detection therefore ignores the companions'
// ctime (their mtime moves on every write).

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

// ErrCorrupt reports a database that fails PRAGMA quick_check or that SQLite
// reports as malformed. A snapshot that returns it has left no destination
// file; the previous good checkpoint of the database must stay.
var ErrCorrupt = errors.New("sqlite database is corrupt")

// ErrNotDatabase reports a file that is not a SQLite database at all (bad
// header: SQLITE_NOTADB). errors.Is(err, ErrCorrupt) is true for it as well,
// so callers that only ask "is this database usable" check ErrCorrupt;
// callers that want to treat a mis-matched file as a plain file check
// ErrNotDatabase.
var ErrNotDatabase error = notDatabaseError{}

// ErrSourceChanged reports that the database changed while it was being
// copied for private recovery (hot journal, or a raw copy being written to).
// It is transient: retry at the next checkpoint.
var ErrSourceChanged = errors.New("sqlite database changed while it was copied")

type notDatabaseError struct{}

func (notDatabaseError) Error() string        { return "file is not a sqlite database" }
func (notDatabaseError) Is(target error) bool { return target == ErrCorrupt }

const (
	// busyTimeoutMS is the busy timeout on every connection we open.
	busyTimeoutMS = 5000
	// defaultStepPages is how many pages one Backup.Step copies before ctx is
	// checked again (16 MiB at 4 KiB pages).
	defaultStepPages = 4096
	// racyWindow: a file modified this close to the moment it was stat'ed may
	// change again within the same mtime tick, so its stamp proves nothing
	// (the engine's rule too).
	racyWindow = time.Second
)

var sqliteMagic = []byte("SQLite format 3\x00")

// SnapshotInfo describes a snapshot written by Snapshot.
type SnapshotInfo struct {
	PageSize  int           // bytes per page (segments chunk on this boundary)
	PageCount int64         // pages in the snapshot
	Size      int64         // bytes of the snapshot file (PageSize*PageCount)
	Duration  time.Duration // wall time of the whole snapshot, checks included
	// Source is the stamp of the source taken just before the backup's read
	// transaction began: every change after it is either in this snapshot or
	// makes a later DBStamp differ. Store it to skip the next checkpoint of
	// an idle database (Stamp.Unchanged).
	Source Stamp
	// FromCopy is true when SQLite recovered a private copy of the files
	// (SnapshotRawCopy, or a hot journal) rather than reading the database
	// in place.
	FromCopy bool
}

// Snapshot captures the live database at src into dst with SQLite's online
// backup API. src may be open in another process that keeps writing it; it
// is opened read-only and never modified (see the file comment for the one
// exception, the -shm wal-index). dst must be a path in an owner-only (0700)
// staging directory other than src's directory; any old dst and its
// companions are removed first and dst is created 0600. On success dst is a
// single self-contained file in rollback (DELETE) journal mode that passed
// quick_check and is fsynced. On failure dst does not exist. Corruption is
// reported as ErrCorrupt (or ErrNotDatabase).
func Snapshot(ctx context.Context, src, dst string) (SnapshotInfo, error) {
	return snapshot(ctx, src, dst, false, backupOpts{})
}

// SnapshotRawCopy is Snapshot for a database whose files were copied raw (db,
// -wal, -shm copied as plain files, possibly torn, by the legacy script) and
// that nothing writes any more: a one-time migration source. The files are
// copied into a private temporary directory beside dst and SQLite recovers
// that copy (replays the -wal, rolls back a -journal), so the raw files are
// never modified; the result is then backed up and validated like Snapshot's.
// A torn copy that SQLite cannot make sense of is ErrCorrupt.
func SnapshotRawCopy(ctx context.Context, src, dst string) (SnapshotInfo, error) {
	return snapshot(ctx, src, dst, true, backupOpts{})
}

// backupOpts are knobs for tests: pages per Backup.Step (0: the default),
// and a function called after every step.
type backupOpts struct {
	step      int32
	afterStep func()
}

func snapshot(ctx context.Context, src, dst string, raw bool, o backupOpts) (_ SnapshotInfo, err error) {
	if o.step == 0 {
		o.step = defaultStepPages
	}
	start := time.Now()
	op := "snapshot"
	if raw {
		op = "snapshot raw copy"
	}
	wrap := func(err error) error { return fmt.Errorf("adapters: %s %s: %w", op, src, err) }
	if err := ctx.Err(); err != nil {
		return SnapshotInfo{}, wrap(err)
	}
	src, dst, err = checkPaths(src, dst)
	if err != nil {
		return SnapshotInfo{}, wrap(err)
	}
	// Whatever happens, no old or partial staging file survives a failure.
	if err := removeDB(dst); err != nil {
		return SnapshotInfo{}, wrap(fmt.Errorf("remove old staging file: %w", err))
	}
	defer func() {
		if err != nil {
			removeDB(dst) //nolint:errcheck // best effort; err is what matters
		}
	}()
	stamp, err := DBStamp(src)
	if err != nil {
		return SnapshotInfo{}, wrap(err)
	}
	var info SnapshotInfo
	if raw {
		info, err = snapshotViaCopy(ctx, src, dst, false, o)
	} else {
		info, err = backupTo(ctx, sourceURI(src, true), dst, o)
		if isReadOnlyErr(err) {
			// A hot journal or a WAL that can only be recovered by writing:
			// let SQLite do that on a private copy instead of the source.
			info, err = snapshotViaCopy(ctx, src, dst, true, o)
		}
	}
	if err != nil {
		return SnapshotInfo{}, wrap(err)
	}
	info.Source = stamp
	info.Duration = time.Since(start)
	return info, nil
}

// checkPaths cleans both paths and refuses a staging file that could touch
// the source: same directory, the source or one of its companions, or a
// staging directory other users can read.
func checkPaths(src, dst string) (string, string, error) {
	src, err := filepath.Abs(src)
	if err != nil {
		return "", "", err
	}
	dst, err = filepath.Abs(dst)
	if err != nil {
		return "", "", err
	}
	fi, err := os.Lstat(src)
	if err != nil {
		return "", "", fmt.Errorf("stat source: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return "", "", fmt.Errorf("source is not a regular file (%s)", fi.Mode().Type())
	}
	dir := filepath.Dir(dst)
	if dir == filepath.Dir(src) {
		return "", "", fmt.Errorf("staging file %s is in the source's directory", dst)
	}
	di, err := os.Stat(dir)
	if err != nil {
		return "", "", fmt.Errorf("stat staging directory: %w", err)
	}
	if !di.IsDir() {
		return "", "", fmt.Errorf("staging directory %s is not a directory", dir)
	}
	if di.Mode().Perm()&0o077 != 0 {
		return "", "", fmt.Errorf("staging directory %s has mode %04o, want owner-only (0700)", dir, di.Mode().Perm())
	}
	if dfi, err := os.Stat(dst); err == nil && os.SameFile(fi, dfi) {
		return "", "", fmt.Errorf("staging file %s is the source", dst)
	}
	return src, dst, nil
}

// sourceURI is the SQLite URI of path, read-only or not, with our busy
// timeout. The path is escaped, so '?', '#' and '%' in names are safe.
func sourceURI(path string, readOnly bool) string {
	q := "_pragma=busy_timeout(" + fmt.Sprint(busyTimeoutMS) + ")"
	if readOnly {
		q = "mode=ro&" + q
	}
	return fileURI(path, q)
}

func fileURI(path, query string) string {
	return (&url.URL{Scheme: "file", Path: path, RawQuery: query}).String()
}

// backuper is what modernc.org/sqlite's driver connection offers for the
// online backup API.
type backuper interface {
	NewBackup(dstURI string) (*sqlite.Backup, error)
}

// backupTo copies the database at srcURI into a fresh dst and finishes it
// (DELETE journal mode, quick_check, fsync). dst is removed on failure.
func backupTo(ctx context.Context, srcURI, dst string, o backupOpts) (info SnapshotInfo, err error) {
	db, err := sql.Open("sqlite", srcURI)
	if err != nil {
		return info, fmt.Errorf("open source: %w", err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	conn, err := db.Conn(ctx)
	if err != nil {
		return info, classify("open source", err)
	}
	defer conn.Close()

	// One read transaction for the whole backup: see the file comment.
	if _, err := conn.ExecContext(ctx, "BEGIN"); err != nil {
		return info, classify("begin read transaction", err)
	}
	defer conn.ExecContext(context.Background(), "ROLLBACK") //nolint:errcheck // read-only; ends with the connection anyway
	var n int64
	if err := conn.QueryRowContext(ctx, "SELECT count(*) FROM sqlite_schema").Scan(&n); err != nil {
		return info, classify("read source schema", err)
	}

	if err := removeDB(dst); err != nil {
		return info, fmt.Errorf("remove old staging file: %w", err)
	}
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return info, fmt.Errorf("create staging file: %w", err)
	}
	if err := f.Close(); err != nil {
		return info, fmt.Errorf("create staging file: %w", err)
	}
	defer func() {
		if err != nil {
			removeDB(dst) //nolint:errcheck // best effort; the error that matters is err
		}
	}()

	err = conn.Raw(func(dc any) error {
		bk, ok := dc.(backuper)
		if !ok {
			return fmt.Errorf("driver connection %T has no backup API", dc)
		}
		// The destination is a private scratch file until finishCopy has
		// checked and fsynced it, and it is discarded on any failure: no
		// rollback journal and no fsync per commit while copying.
		b, err := bk.NewBackup(fileURI(dst, "_pragma=journal_mode(OFF)&_pragma=synchronous(OFF)"))
		if err != nil {
			return classify("start backup to "+dst, err)
		}
		for {
			if err := ctx.Err(); err != nil {
				b.Finish() //nolint:errcheck // cancelled: ctx's error is the one to report
				return err
			}
			more, err := b.Step(o.step)
			if err != nil {
				b.Finish() //nolint:errcheck // the step error is the one to report
				return classify("backup step", err)
			}
			if o.afterStep != nil {
				o.afterStep()
			}
			if !more {
				break
			}
		}
		if err := b.Finish(); err != nil {
			return classify("finish backup", err)
		}
		return nil
	})
	if err != nil {
		return info, err
	}
	// The source is no longer needed: end the read transaction now so a
	// rollback-mode writer is not kept waiting during our checks.
	conn.ExecContext(context.Background(), "ROLLBACK") //nolint:errcheck // see defer above
	conn.Close()
	db.Close()

	return finishCopy(ctx, dst)
}

// finishCopy turns the backup at dst into one self-contained, checked,
// durable file.
func finishCopy(ctx context.Context, dst string) (SnapshotInfo, error) {
	var info SnapshotInfo
	db, err := sql.Open("sqlite", fileURI(dst, ""))
	if err != nil {
		return info, fmt.Errorf("open copy %s: %w", dst, err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	var mode string
	if err := db.QueryRowContext(ctx, "PRAGMA journal_mode=DELETE").Scan(&mode); err != nil {
		return info, classify("set journal_mode=DELETE on copy "+dst, err)
	}
	if !strings.EqualFold(mode, "delete") {
		return info, fmt.Errorf("set journal_mode=DELETE on copy %s: still %q", dst, mode)
	}
	if err := quickCheck(ctx, db); err != nil {
		return info, fmt.Errorf("copy %s: %w", dst, err)
	}
	if err := db.QueryRowContext(ctx, "PRAGMA page_size").Scan(&info.PageSize); err != nil {
		return info, classify("read page size of copy "+dst, err)
	}
	if err := db.QueryRowContext(ctx, "PRAGMA page_count").Scan(&info.PageCount); err != nil {
		return info, classify("read page count of copy "+dst, err)
	}
	if err := db.Close(); err != nil {
		return info, fmt.Errorf("close copy %s: %w", dst, err)
	}
	for _, suffix := range []string{"-wal", "-shm", "-journal"} {
		if _, err := os.Lstat(dst + suffix); !errors.Is(err, fs.ErrNotExist) {
			return info, fmt.Errorf("copy %s is not self-contained: %s%s is left beside it (%v)", dst, dst, suffix, err)
		}
	}
	f, err := os.Open(dst)
	if err != nil {
		return info, fmt.Errorf("fsync copy: %w", err)
	}
	err = f.Sync()
	fi, serr := f.Stat()
	f.Close()
	if err != nil {
		return info, fmt.Errorf("fsync copy %s: %w", dst, err)
	}
	if serr != nil {
		return info, fmt.Errorf("stat copy: %w", serr)
	}
	if err := syncDir(filepath.Dir(dst)); err != nil {
		return info, err
	}
	info.Size = fi.Size()
	if info.Size != int64(info.PageSize)*info.PageCount {
		return info, fmt.Errorf("copy %s: %d bytes, want %d pages of %d", dst, info.Size, info.PageCount, info.PageSize)
	}
	return info, nil
}

// quickCheck runs PRAGMA quick_check on db: exactly one row "ok" passes.
func quickCheck(ctx context.Context, db *sql.DB) error {
	rows, err := db.QueryContext(ctx, "PRAGMA quick_check")
	if err != nil {
		return classify("quick_check", err)
	}
	defer rows.Close()
	var msgs []string
	total := 0
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return classify("quick_check", err)
		}
		total++
		if len(msgs) < 8 {
			msgs = append(msgs, strings.ReplaceAll(s, "\n", " "))
		}
	}
	if err := rows.Err(); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("quick_check: %w", err)
		}
		// An error while checking is a failed check, whatever its code.
		if e := classify("quick_check", err); errors.Is(e, ErrCorrupt) {
			return e
		}
		return fmt.Errorf("%w: quick_check: %w", ErrCorrupt, err)
	}
	if total == 1 && msgs[0] == "ok" {
		return nil
	}
	if total == 0 {
		return fmt.Errorf("%w: quick_check returned no rows", ErrCorrupt)
	}
	more := ""
	if total > len(msgs) {
		more = fmt.Sprintf(" (and %d more)", total-len(msgs))
	}
	return fmt.Errorf("%w: quick_check: %s%s", ErrCorrupt, strings.Join(msgs, "; "), more)
}

// classify wraps err with what was done, mapping SQLite's corruption codes
// to ErrCorrupt and ErrNotDatabase.
func classify(what string, err error) error {
	var se *sqlite.Error
	if errors.As(err, &se) {
		switch se.Code() & 0xff {
		case sqlite3.SQLITE_CORRUPT:
			return fmt.Errorf("%s: %w: %w", what, ErrCorrupt, err)
		case sqlite3.SQLITE_NOTADB:
			return fmt.Errorf("%s: %w: %w", what, ErrNotDatabase, err)
		}
	}
	return fmt.Errorf("%s: %w", what, err)
}

// isReadOnlyErr: SQLite needs to write to open this database (hot journal
// rollback, WAL recovery without a writable -shm).
func isReadOnlyErr(err error) bool {
	var se *sqlite.Error
	return errors.As(err, &se) && se.Code()&0xff == sqlite3.SQLITE_READONLY
}

// snapshotViaCopy copies src's files into a private directory, lets SQLite
// recover them there, and backs the recovered copy up into dst. quiet: see
// copyStable.
func snapshotViaCopy(ctx context.Context, src, dst string, quiet bool, o backupOpts) (SnapshotInfo, error) {
	tmp, err := os.MkdirTemp(filepath.Dir(dst), ".recover-")
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("make recovery directory: %w", err)
	}
	defer os.RemoveAll(tmp)
	cp := filepath.Join(tmp, "db")
	if err := copyStable(ctx, src, cp, quiet); err != nil {
		return SnapshotInfo{}, err
	}
	// Read-write: the copy is ours, and recovering it means writing it.
	info, err := backupTo(ctx, sourceURI(cp, false), dst, o)
	if err != nil {
		return info, fmt.Errorf("recovered copy: %w", err)
	}
	info.FromCopy = true
	return info, nil
}

// copyStable copies db, -wal and -journal of src to cp (0600) and fails with
// ErrSourceChanged unless their stat is the same before and after the copy.
// With quiet — files in a live harness directory, where a harness may start
// and write at any moment — they must also have been untouched for
// racyWindow before the copy, so that a write in the same mtime tick cannot
// hide. A legacy raw copy is at rest by contract and may be fresh.
func copyStable(ctx context.Context, src, cp string, quiet bool) error {
	before, err := filesStamp(src)
	if err != nil {
		return err
	}
	if t := before.newest(); quiet && t >= time.Now().Add(-racyWindow).UnixNano() {
		return fmt.Errorf("%w: modified %s ago", ErrSourceChanged, time.Since(time.Unix(0, t)).Round(time.Millisecond))
	}
	for i, suffix := range []string{"", "-wal", "-journal"} {
		if !before[i].Exists {
			continue
		}
		if err := copyFile(ctx, src+suffix, cp+suffix); err != nil {
			return err
		}
	}
	after, err := filesStamp(src)
	if err != nil {
		return err
	}
	if after != before {
		return fmt.Errorf("%w: stat before and after the copy differ", ErrSourceChanged)
	}
	return nil
}

type threeStamps [3]FileStamp // db, -wal, -journal

func filesStamp(src string) (threeStamps, error) {
	var s threeStamps
	for i, suffix := range []string{"", "-wal", "-journal"} {
		f, err := fileStamp(src + suffix)
		if err != nil {
			return s, err
		}
		s[i] = f
	}
	if !s[0].Exists {
		return s, fmt.Errorf("stat %s: %w", src, fs.ErrNotExist)
	}
	return s, nil
}

// newest is the last modification of any of the files: mtime, and the main
// file's ctime (the companions' ctime moves whenever SQLite opens them as
// root, see Stamp.Unchanged, so it says nothing about writes).
func (s threeStamps) newest() int64 {
	t := max(s[0].MTime, s[0].CTime)
	for _, f := range s[1:] {
		t = max(t, f.MTime)
	}
	return t
}

func copyFile(ctx context.Context, from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return fmt.Errorf("copy %s: %w", from, err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("copy %s: %w", from, err)
	}
	_, err = io.Copy(out, ctxReader{ctx, in})
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("copy %s to %s: %w", from, to, err)
	}
	return nil
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (r ctxReader) Read(p []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	return r.r.Read(p)
}

// QuickCheck opens the database at path read-only, as SQLite would see it
// (its -wal included), and runs PRAGMA quick_check. It fails with
// ErrCorrupt (ErrNotDatabase for a file that is not SQLite at all); other
// errors (missing file, I/O) are returned wrapped. It is meant for files at
// rest — staged snapshots, downloaded checkpoint copies, the database of a
// stopped harness — and modifies none of them: a file with no -wal beside it
// is opened immutable (no lock, no side files); one with a -wal is opened
// read-only, which at most rebuilds the -shm; one that SQLite could only
// open by writing (a hot journal) is checked on a private copy.
func QuickCheck(ctx context.Context, path string) error {
	_, err := check(ctx, path)
	if err != nil {
		return fmt.Errorf("adapters: quick_check %s: %w", path, err)
	}
	return nil
}

// LocalIsValid reports whether path is a database a hot restart must keep:
// a regular, non-empty file that passes QuickCheck and holds at least one
// page. An empty or unreadable file is not worth protecting, so the
// checkpoint copy is restored over it.
func LocalIsValid(ctx context.Context, path string) bool {
	fi, err := os.Lstat(path)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() == 0 {
		return false
	}
	pages, err := check(ctx, path)
	return err == nil && pages > 0
}

// check is QuickCheck returning the page count.
func check(ctx context.Context, path string) (int64, error) {
	path, err := filepath.Abs(path)
	if err != nil {
		return 0, err
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return 0, err
	}
	if !fi.Mode().IsRegular() {
		return 0, fmt.Errorf("not a regular file (%s)", fi.Mode().Type())
	}
	if fi.Size() > 0 && fi.Size() < 100 {
		return 0, fmt.Errorf("%w: %d bytes is shorter than a database header", ErrNotDatabase, fi.Size())
	}
	hasCompanion := false
	for _, suffix := range []string{"-wal", "-journal"} {
		if _, err := os.Lstat(path + suffix); err == nil {
			hasCompanion = true
		}
	}
	uri := fileURI(path, "mode=ro&immutable=1")
	if hasCompanion {
		uri = sourceURI(path, true)
	}
	pages, err := checkURI(ctx, uri)
	if isReadOnlyErr(err) {
		pages, err = checkCopy(ctx, path)
	}
	return pages, err
}

func checkURI(ctx context.Context, uri string) (int64, error) {
	db, err := sql.Open("sqlite", uri)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	var pages int64
	if err := db.QueryRowContext(ctx, "PRAGMA page_count").Scan(&pages); err != nil {
		return 0, classify("read page count", err)
	}
	if err := quickCheck(ctx, db); err != nil {
		return 0, err
	}
	return pages, db.Close()
}

func checkCopy(ctx context.Context, path string) (int64, error) {
	tmp, err := os.MkdirTemp("", "agentstate-sqlite-check-")
	if err != nil {
		return 0, fmt.Errorf("make check directory: %w", err)
	}
	defer os.RemoveAll(tmp)
	cp := filepath.Join(tmp, "db")
	if err := copyStable(ctx, path, cp, true); err != nil {
		return 0, err
	}
	pages, err := checkURI(ctx, sourceURI(cp, false))
	if err != nil {
		return 0, fmt.Errorf("recovered copy: %w", err)
	}
	return pages, nil
}

// PlaceRestored puts staged — a verified, self-contained checkpoint copy of
// a database — at dst, in the same directory. Any -wal, -shm and -journal
// beside dst are removed first and that removal is made durable: SQLite
// would otherwise replay a stale WAL (or roll back a stale journal) onto the
// restored file. Then staged is renamed over dst and the directory fsynced.
// The harness must not be running.
func PlaceRestored(ctx context.Context, staged, dst string) error {
	wrap := func(err error) error { return fmt.Errorf("adapters: place restored database %s: %w", dst, err) }
	if err := ctx.Err(); err != nil {
		return wrap(err)
	}
	staged, err := filepath.Abs(staged)
	if err != nil {
		return wrap(err)
	}
	dst, err = filepath.Abs(dst)
	if err != nil {
		return wrap(err)
	}
	dir := filepath.Dir(dst)
	if filepath.Dir(staged) != dir {
		return wrap(fmt.Errorf("staged file %s is not in the same directory", staged))
	}
	if staged == dst {
		return wrap(errors.New("staged file is the destination"))
	}
	fi, err := os.Lstat(staged)
	if err != nil {
		return wrap(fmt.Errorf("stat staged file: %w", err))
	}
	if !fi.Mode().IsRegular() {
		return wrap(fmt.Errorf("staged file %s is not a regular file", staged))
	}
	if err := checkHeader(staged, fi.Size()); err != nil {
		return wrap(err)
	}
	if wi, err := os.Lstat(staged + "-wal"); err == nil && wi.Size() > 0 {
		return wrap(fmt.Errorf("staged file %s is not self-contained: it has a -wal", staged))
	}
	if di, err := os.Lstat(dst); err == nil && di.IsDir() {
		return wrap(errors.New("destination is a directory"))
	}
	removed, err := removeCompanions(dst)
	if err != nil {
		return wrap(err)
	}
	if removed {
		if err := syncDir(dir); err != nil {
			return wrap(err)
		}
	}
	if err := ctx.Err(); err != nil {
		return wrap(err)
	}
	if err := os.Rename(staged, dst); err != nil {
		return wrap(err)
	}
	if err := syncDir(dir); err != nil {
		return wrap(err)
	}
	return nil
}

// checkHeader refuses a staged file that does not start like a database (an
// empty file is an empty database and passes).
func checkHeader(path string, size int64) error {
	if size == 0 {
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("read staged header: %w", err)
	}
	defer f.Close()
	hdr := make([]byte, len(sqliteMagic))
	if _, err := io.ReadFull(f, hdr); err != nil || !bytes.Equal(hdr, sqliteMagic) {
		return fmt.Errorf("staged file %s: %w", path, ErrNotDatabase)
	}
	return nil
}

// removeCompanions removes path's -wal, -shm and -journal; it reports
// whether any existed.
func removeCompanions(path string) (bool, error) {
	removed := false
	for _, suffix := range []string{"-wal", "-shm", "-journal"} {
		err := os.Remove(path + suffix)
		switch {
		case err == nil:
			removed = true
		case !errors.Is(err, fs.ErrNotExist):
			return removed, fmt.Errorf("remove stale %s%s: %w", path, suffix, err)
		}
	}
	return removed, nil
}

// removeDB removes a staging database and its companions.
func removeDB(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	_, err := removeCompanions(path)
	return err
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("fsync directory: %w", err)
	}
	err = d.Sync()
	d.Close()
	if err != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, err)
	}
	return nil
}

// FileStamp is what a stat says about one file. Times are Unix nanoseconds.
type FileStamp struct {
	Exists bool   `json:"e,omitempty"`
	Size   int64  `json:"s,omitempty"`
	MTime  int64  `json:"mt,omitempty"`
	CTime  int64  `json:"ct,omitempty"`
	Ino    uint64 `json:"i,omitempty"`
	Dev    uint64 `json:"d,omitempty"`
}

// Stamp is the change-detection state of a database: its main file and its
// -wal, and whether a -shm is present, from stat alone (the database is not
// opened). Taken is when the stat ran.
type Stamp struct {
	DB    FileStamp `json:"db"`
	WAL   FileStamp `json:"wal"`
	SHM   bool      `json:"shm,omitempty"`
	Taken int64     `json:"at"`
}

// DBStamp stats the database at path and its -wal and -shm. A missing
// database is an error (errors.Is fs.ErrNotExist); a missing -wal or -shm is
// normal. It does not open the database.
func DBStamp(path string) (Stamp, error) {
	s := Stamp{Taken: time.Now().UnixNano()}
	var err error
	if s.DB, err = fileStamp(path); err != nil {
		return Stamp{}, fmt.Errorf("adapters: stamp %s: %w", path, err)
	}
	if !s.DB.Exists {
		return Stamp{}, fmt.Errorf("adapters: stamp %s: %w", path, fs.ErrNotExist)
	}
	if s.WAL, err = fileStamp(path + "-wal"); err != nil {
		return Stamp{}, fmt.Errorf("adapters: stamp %s: %w", path, err)
	}
	shm, err := fileStamp(path + "-shm")
	if err != nil {
		return Stamp{}, fmt.Errorf("adapters: stamp %s: %w", path, err)
	}
	s.SHM = shm.Exists
	return s, nil
}

// Unchanged reports whether the database provably holds the same content as
// when prev was taken, so a checkpoint may skip it without opening it: the
// main file has the same size, mtime, ctime, inode and device, the -wal the
// same size, mtime, inode and device, and prev was not racy. An absent -wal
// and an empty one are the same content (a read-only open of a cleanly
// closed WAL database creates an empty one). The -wal's ctime is not
// compared: SQLite running as root fchowns the -wal (and -journal) to the
// database's owner every time it opens it, so every reader — our snapshots
// included — bumps it; every write to the -wal moves its mtime. The -shm is
// ignored: it is an index SQLite rebuilds and holds no data.
func (s Stamp) Unchanged(prev Stamp) bool {
	if !prev.DB.Exists || prev.Racy() || s.DB != prev.DB {
		return false
	}
	if s.WAL.Size == 0 && prev.WAL.Size == 0 {
		return true
	}
	a, b := s.WAL, prev.WAL
	a.CTime, b.CTime = 0, 0
	return a == b
}

// Key is a canonical string of exactly what Unchanged compares, for callers
// that persist stamps as strings: when prev is not racy, s.Key() ==
// prev.Key() if and only if s.Unchanged(prev) (equal keys may be taken as
// "unchanged"). A racy stamp's key carries the time it was taken, so it
// equals no later key and that database is captured again.
func (s Stamp) Key() string {
	wal := "-"
	if s.WAL.Exists && s.WAL.Size > 0 {
		wal = fmt.Sprintf("%d:%d:%d:%d", s.WAL.Size, s.WAL.MTime, s.WAL.Ino, s.WAL.Dev)
	}
	k := fmt.Sprintf("db=%d:%d:%d:%d:%d wal=%s", s.DB.Size, s.DB.MTime, s.DB.CTime, s.DB.Ino, s.DB.Dev, wal)
	if !s.DB.Exists {
		k = "db=- wal=" + wal
	}
	if s.Racy() || !s.DB.Exists {
		k += fmt.Sprintf(" racy@%d", s.Taken)
	}
	return k
}

// Racy reports whether a file of s was modified so shortly before s was
// taken that a later change could leave the same mtime: such a stamp cannot
// prove a database unchanged, so the next checkpoint snapshots it again.
// An empty -wal counts for nothing here either: a write to it changes its
// size.
func (s Stamp) Racy() bool {
	limit := s.Taken - int64(racyWindow)
	return s.DB.Exists && (s.DB.MTime >= limit || s.DB.CTime >= limit) ||
		s.WAL.Size > 0 && s.WAL.MTime >= limit
}

func fileStamp(path string) (FileStamp, error) {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return FileStamp{}, nil
	}
	if err != nil {
		return FileStamp{}, err
	}
	if !fi.Mode().IsRegular() {
		return FileStamp{}, fmt.Errorf("%s is not a regular file (%s)", path, fi.Mode().Type())
	}
	s := FileStamp{Exists: true, Size: fi.Size(), MTime: fi.ModTime().UnixNano()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		s.CTime = st.Ctim.Nano()
		s.Ino = st.Ino
		s.Dev = uint64(st.Dev)
	}
	return s, nil
}
