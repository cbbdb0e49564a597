package store

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"iter"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Names inside a Dir root that are not objects. Keys whose first segment is
// one of them are refused so an object can never shadow them.
const (
	dirTmpName  = ".tmp"
	dirLockName = ".lock"
)

// staleTempAge is how old an untouched temp file must be before OpenDir
// removes it. A put rewrites its temp file continuously, so only the litter
// of a crashed process gets this old.
const staleTempAge = 24 * time.Hour

// dirRetries bounds how often a put re-creates parent directories removed
// between mkdir and rename. The store lock prevents that among agentstate
// processes; the retry covers anything else pruning empty directories.
const dirRetries = 8

// Dir is the "dir" backend: each object is a file under a local root, named
// by its key ('/' separates directories). It is the embedded default and the
// reference the S3 backend is tested against.
//
// Writes are atomic and durable: the body goes to a temp file in <root>/.tmp,
// is fsynced, then renamed (or hard-linked, for create-only) into place and
// the parent directory is fsynced. A reader therefore sees the old object or
// the new one, never a torn one, even across a crash.
//
// Conditional puts are correct between processes: create-only uses link(2),
// which fails atomically if the name exists; If-Match holds an exclusive
// flock on <root>/.lock across check and rename, while other puts and
// deletes hold it shared, so nothing can slip in between.
//
// A key cannot be both an object and a prefix of another key at a '/'
// boundary ("a" and "a/b"): a file system cannot hold a file and a directory
// of the same name. The repository layout never needs that; such a put fails.
type Dir struct {
	root string
}

// OpenDir opens (creating with mode 0700 if needed) the dir store rooted at
// root, which must be an absolute path.
func OpenDir(root string) (*Dir, error) {
	if !filepath.IsAbs(root) {
		return nil, fmt.Errorf("open dir store %q: path must be absolute", root)
	}
	root = filepath.Clean(root)
	if err := os.MkdirAll(filepath.Join(root, dirTmpName), 0o700); err != nil {
		return nil, fmt.Errorf("open dir store %s: %w", root, err)
	}
	lock, err := os.OpenFile(filepath.Join(root, dirLockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open dir store %s: %w", root, err)
	}
	if err := lock.Close(); err != nil {
		return nil, fmt.Errorf("open dir store %s: %w", root, err)
	}
	d := &Dir{root: root}
	d.removeStaleTemps()
	return d, nil
}

// String names the store as a file URL.
func (d *Dir) String() string { return "file://" + d.root }

// Root is the absolute directory the store lives in.
func (d *Dir) Root() string { return d.root }

func (d *Dir) checkKey(key string) error {
	if err := CheckKey(key); err != nil {
		return err
	}
	first, _, _ := strings.Cut(key, "/")
	if first == dirTmpName || first == dirLockName {
		return fmt.Errorf("%w %q: %q is reserved by the dir backend", errInvalidKey, key, first)
	}
	return nil
}

func (d *Dir) path(key string) string {
	return filepath.Join(d.root, filepath.FromSlash(key))
}

// Put implements Store.
func (d *Dir) Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts PutOptions) (ObjectInfo, error) {
	if err := d.checkKey(key); err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	if err := checkPutOptions(opts); err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	if err := ctx.Err(); err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	if _, err := bodyStart(body, size); err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}

	tmp, err := d.writeTemp(ctx, body, size)
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	// The temp name is gone after a rename; after a link or any failure it
	// must be removed, and removing a missing name is harmless.
	defer os.Remove(tmp)

	fi, err := os.Lstat(tmp)
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	info := dirInfo(key, fi)

	final := d.path(key)
	// Every put holds the store lock shared from mkdir to rename, so
	// Delete's removal of empty directories (exclusive) cannot remove a
	// directory between its creation and the rename into it. If-Match
	// holds it exclusive, so nothing changes the object between the ETag
	// check and the rename.
	how := unix.LOCK_SH
	if opts.IfMatch != "" {
		how = unix.LOCK_EX
	}
	unlock, err := d.lock(how)
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	defer unlock()
	for attempt := 0; ; attempt++ {
		err = d.mkdirs(filepath.Dir(final))
		if err == nil {
			err = d.place(tmp, final, opts)
		}
		// ENOENT would mean a parent directory we had just made was
		// removed (by a process not honouring the lock): make it again.
		if errors.Is(err, fs.ErrNotExist) && attempt < dirRetries {
			continue
		}
		break
	}
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	if err := syncDir(filepath.Dir(final)); err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	return info, nil
}

// writeTemp copies exactly size bytes of body into a new fsynced temp file
// and returns its name. Its mtime is set explicitly to the current time with
// full nanosecond precision: file systems stamp writes with a coarse clock
// (a jiffy), and the ETag must differ between two writes even within one.
func (d *Dir) writeTemp(ctx context.Context, body io.Reader, size int64) (string, error) {
	f, err := os.CreateTemp(filepath.Join(d.root, dirTmpName), "put-*")
	if err != nil {
		return "", err
	}
	name := f.Name()
	fail := func(err error) (string, error) {
		_ = f.Close()
		_ = os.Remove(name)
		return "", err
	}
	n, err := io.Copy(f, &ctxReader{ctx: ctx, r: io.LimitReader(body, size)})
	if err != nil {
		return fail(fmt.Errorf("write temp file: %w", err))
	}
	if n != size {
		return fail(fmt.Errorf("body ended after %d of %d bytes", n, size))
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("fsync temp file: %w", err))
	}
	now := time.Now()
	if err := os.Chtimes(name, now, now); err != nil {
		return fail(fmt.Errorf("set mtime: %w", err))
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(name)
		return "", fmt.Errorf("close temp file: %w", err)
	}
	return name, nil
}

// place moves the finished temp file to final under the rule opts asks
// for. The caller holds the store lock.
func (d *Dir) place(tmp, final string, opts PutOptions) error {
	switch {
	case opts.CreateOnly:
		// link(2) fails with EEXIST if final exists, atomically, whoever
		// else is writing: the file-system equivalent of If-None-Match: *.
		err := os.Link(tmp, final)
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create-only: %w", ErrPrecondition)
		}
		return dirConflict(err)
	case opts.IfMatch != "":
		fi, err := os.Lstat(final)
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) || (err == nil && !fi.Mode().IsRegular()) {
			return fmt.Errorf("if-match %s: object does not exist: %w", opts.IfMatch, ErrPrecondition)
		}
		if err != nil {
			return err
		}
		if etag := dirETag(fi); etag != opts.IfMatch {
			return fmt.Errorf("if-match %s: current ETag is %s: %w", opts.IfMatch, etag, ErrPrecondition)
		}
		return os.Rename(tmp, final)
	default:
		return dirConflict(os.Rename(tmp, final))
	}
}

// dirConflict explains the one layout a file system cannot hold.
func dirConflict(err error) error {
	if errors.Is(err, syscall.EISDIR) || errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST) {
		return fmt.Errorf("key is a prefix of other keys, which the dir backend cannot also store as an object: %w", err)
	}
	return err
}

// lock takes the store-wide flock in mode how (LOCK_SH or LOCK_EX). It opens
// the lock file anew each time because flock belongs to an open file
// description: goroutines sharing one descriptor would not exclude each
// other.
func (d *Dir) lock(how int) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(d.root, dirLockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock: %w", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("flock: %w", err)
	}
	// Closing the descriptor releases the lock.
	return func() { _ = f.Close() }, nil
}

// mkdirs creates dir and its missing parents under the root with mode 0700,
// fsyncing each parent that gained an entry so the new path survives a
// crash together with the file renamed into it.
func (d *Dir) mkdirs(dir string) error {
	rel, err := filepath.Rel(d.root, dir)
	if err != nil {
		return err
	}
	if rel == "." {
		return nil
	}
	cur := d.root
	for seg := range strings.SplitSeq(rel, string(filepath.Separator)) {
		parent := cur
		cur = filepath.Join(cur, seg)
		err := os.Mkdir(cur, 0o700)
		switch {
		case err == nil:
			if err := syncDir(parent); err != nil {
				return err
			}
		case errors.Is(err, fs.ErrExist):
			fi, serr := os.Lstat(cur)
			if serr == nil && !fi.IsDir() {
				return fmt.Errorf("%s is an object, so it cannot also be a prefix in the dir backend", filepath.ToSlash(strings.TrimPrefix(cur, d.root+string(filepath.Separator))))
			}
		case errors.Is(err, syscall.ENOTDIR):
			return fmt.Errorf("a parent of %s is an object, so it cannot also be a prefix in the dir backend", filepath.ToSlash(rel))
		default:
			return err
		}
	}
	return nil
}

// Get implements Store.
func (d *Dir) Get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	if err := d.checkKey(key); err != nil {
		return nil, fmt.Errorf("get %s: %w", key, err)
	}
	if offset < 0 {
		return nil, fmt.Errorf("get %s: negative offset %d: %w", key, offset, ErrInvalidRange)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("get %s: %w", key, err)
	}
	// O_NOFOLLOW: the store only ever creates regular files, so a symlink
	// in the tree was planted by someone else and is not an object.
	f, err := os.OpenFile(d.path(key), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", key, notFound(err))
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("get %s: %w", key, err)
	}
	if !fi.Mode().IsRegular() {
		_ = f.Close()
		return nil, fmt.Errorf("get %s: %w", key, ErrNotFound)
	}
	size := fi.Size()
	if offset > size {
		_ = f.Close()
		return nil, fmt.Errorf("get %s: offset %d past end %d: %w", key, offset, size, ErrInvalidRange)
	}
	n := size - offset
	if length >= 0 && length < n {
		n = length
	}
	// Objects are replaced by rename, never written in place, so the open
	// file keeps the content it had when it was opened.
	return &fileSection{SectionReader: io.NewSectionReader(f, offset, n), f: f}, nil
}

type fileSection struct {
	*io.SectionReader
	f *os.File
}

func (s *fileSection) Close() error { return s.f.Close() }

// Stat implements Store.
func (d *Dir) Stat(ctx context.Context, key string) (ObjectInfo, error) {
	if err := d.checkKey(key); err != nil {
		return ObjectInfo{}, fmt.Errorf("stat %s: %w", key, err)
	}
	if err := ctx.Err(); err != nil {
		return ObjectInfo{}, fmt.Errorf("stat %s: %w", key, err)
	}
	fi, err := os.Lstat(d.path(key))
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("stat %s: %w", key, notFound(err))
	}
	if !fi.Mode().IsRegular() {
		return ObjectInfo{}, fmt.Errorf("stat %s: %w", key, ErrNotFound)
	}
	return dirInfo(key, fi), nil
}

// List implements Store. It walks the tree depth-first, reading one
// directory at a time, so memory is bounded by the largest directory rather
// than the store. Entries are visited in the order of their names with a
// directory named "a" sorting as "a/": every key below it starts with "a/",
// so this yields keys in exactly the byte order S3 lists them in ("a-c" <
// "a/b" < "a0"), which a plain sorted walk would not.
func (d *Dir) List(ctx context.Context, prefix string) iter.Seq2[ObjectInfo, error] {
	return func(yield func(ObjectInfo, error) bool) {
		if err := checkPrefix(prefix); err != nil {
			yield(ObjectInfo{}, fmt.Errorf("list %s: %w", prefix, err))
			return
		}
		// Start at the deepest directory the prefix names completely.
		start := prefix[:strings.LastIndex(prefix, "/")+1]
		d.walk(ctx, start, prefix, yield)
	}
}

// walk lists directory rel (a key prefix, "" or ending in '/') and reports
// whether the consumer wants more.
func (d *Dir) walk(ctx context.Context, rel, prefix string, yield func(ObjectInfo, error) bool) bool {
	if err := ctx.Err(); err != nil {
		return yield(ObjectInfo{}, fmt.Errorf("list %s: %w", prefix, err))
	}
	entries, err := os.ReadDir(filepath.Join(d.root, filepath.FromSlash(rel)))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
			// Nothing under a prefix that is not there (or was just
			// deleted): an empty listing, as in S3.
			return true
		}
		return yield(ObjectInfo{}, fmt.Errorf("list %s: %w", prefix, err))
	}
	sortName := func(e fs.DirEntry) string {
		if e.IsDir() {
			return e.Name() + "/"
		}
		return e.Name()
	}
	slices.SortFunc(entries, func(a, b fs.DirEntry) int { return cmp.Compare(sortName(a), sortName(b)) })
	for _, e := range entries {
		name := e.Name()
		if rel == "" && (name == dirTmpName || name == dirLockName) {
			continue
		}
		if checkChars(name) != nil || checkSegment(name, name) != nil {
			// Not something a key could have produced: not an object.
			continue
		}
		key := rel + name
		if e.IsDir() {
			sub := key + "/"
			if strings.HasPrefix(sub, prefix) || strings.HasPrefix(prefix, sub) {
				if !d.walk(ctx, sub, prefix, yield) {
					return false
				}
			}
			continue
		}
		if !e.Type().IsRegular() || !strings.HasPrefix(key, prefix) {
			continue
		}
		fi, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted since ReadDir
		}
		if err != nil {
			return yield(ObjectInfo{}, fmt.Errorf("list %s: %w", prefix, err))
		}
		if !yield(dirInfo(key, fi), nil) {
			return false
		}
	}
	return true
}

// Delete implements Store. It removes directories that become empty (never
// the root), so deleted prefixes do not pile up as empty directories. It
// does not fsync: a deletion lost in a crash leaves an object GC deletes
// again, which is harmless, and bulk deletes of thousands of keys would pay
// one fsync each.
func (d *Dir) Delete(ctx context.Context, keys []string) error {
	if len(keys) == 0 {
		return nil
	}
	var errs []error
	dirs := map[string]bool{}
	// Files go under the shared lock, like puts: S3 orders a delete and
	// an If-Match put, and so must the exclusive If-Match section here.
	unlock, err := d.lock(unix.LOCK_SH)
	if err != nil {
		return fmt.Errorf("delete %d keys: %w", len(keys), err)
	}
	for _, key := range keys {
		if err := ctx.Err(); err != nil {
			errs = append(errs, fmt.Errorf("delete %d keys: %w", len(keys), err))
			break
		}
		removed, err := d.deleteOne(key)
		if err != nil {
			errs = append(errs, fmt.Errorf("delete %s: %w", key, err))
		}
		if removed {
			dirs[filepath.Dir(d.path(key))] = true
		}
	}
	unlock()
	if len(dirs) > 0 {
		// Empty directories go under the exclusive lock, so no put is
		// between making a directory and renaming a file into it.
		unlock, err := d.lock(unix.LOCK_EX)
		if err != nil {
			return errors.Join(append(errs, fmt.Errorf("delete %d keys: remove empty directories: %w", len(keys), err))...)
		}
		for dir := range dirs {
			d.removeEmptyDirs(dir)
		}
		unlock()
	}
	return errors.Join(errs...)
}

// deleteOne removes the file of key and reports whether there was one.
func (d *Dir) deleteOne(key string) (bool, error) {
	if err := d.checkKey(key); err != nil {
		return false, err
	}
	p := d.path(key)
	// unlink(2), not os.Remove: a key that names a directory (a prefix of
	// other keys) is not an object and must not be rmdir'ed.
	err := unix.Unlink(p)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.EISDIR), errors.Is(err, unix.EPERM) && isDir(p):
		return false, nil // missing is not an error
	default:
		return false, err
	}
}

// removeEmptyDirs removes dir and its parents up to (not including) the
// root while they are empty.
func (d *Dir) removeEmptyDirs(dir string) {
	for ; dir != d.root && strings.HasPrefix(dir, d.root+string(filepath.Separator)); dir = filepath.Dir(dir) {
		if err := unix.Rmdir(dir); err != nil && !errors.Is(err, unix.ENOENT) {
			return // not empty: stop climbing
		}
	}
}

func isDir(p string) bool {
	fi, err := os.Lstat(p)
	return err == nil && fi.IsDir()
}

// removeStaleTemps deletes temp files a crashed process left behind. It is
// best effort: a failure costs disk space, not correctness.
func (d *Dir) removeStaleTemps() {
	dir := filepath.Join(d.root, dirTmpName)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	cutoff := time.Now().Add(-staleTempAge)
	for _, e := range entries {
		if fi, err := e.Info(); err == nil && fi.ModTime().Before(cutoff) {
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}

// dirInfo describes a file as an object.
func dirInfo(key string, fi fs.FileInfo) ObjectInfo {
	return ObjectInfo{Key: key, Size: fi.Size(), ETag: dirETag(fi), LastModified: fi.ModTime()}
}

// dirETag identifies one write of a file: every put creates a new inode
// (temp file, then rename or link) and stamps a nanosecond mtime, so the
// triple (size, mtime, inode) changes on every write even when the content
// does not. Reading the content to hash it would make Stat and List cost
// the object's size.
func dirETag(fi fs.FileInfo) string {
	var ino uint64
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		ino = uint64(st.Ino)
	}
	return fmt.Sprintf("%x-%x-%x", fi.Size(), fi.ModTime().UnixNano(), ino)
}

func notFound(err error) error {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ELOOP) {
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	return err
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("fsync dir: %w", err)
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	return nil
}

// ctxReader stops a long copy when its context is cancelled.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
