package engine

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

// RestoreOptions names what to restore where.
type RestoreOptions struct {
	Lineage string
	Dir     string
	// Seq restores exactly this sequence (no fallback); 0 takes the newest
	// manifest that verifies.
	Seq uint64
	// IncludeDeleted also brings back the deletion tombstones the
	// checkpoint keeps (paths deleted within the retention window).
	IncludeDeleted bool
	// Path, if set, restores only this path (slash-separated, relative to
	// Dir) and what is below it, deleted or not; the rest of Dir and the
	// local index are left alone.
	Path string
}

// ErrPathNotFound: RestoreOptions.Path is not in the checkpoint.
var ErrPathNotFound = errors.New("path not in the checkpoint")

// PathError is one path restore could not write.
type PathError struct {
	Path string `json:"path"`
	Err  string `json:"error"`
}

// RestoreResult is what a restore did.
type RestoreResult struct {
	Lineage string `json:"lineage"`
	// Seq is the restored sequence; 0 with Empty for a lineage with no
	// checkpoint yet (a normal first start).
	Seq   uint64 `json:"seq"`
	Empty bool   `json:"empty"`
	// Rejected names each newer manifest that did not verify, and why.
	Rejected []string `json:"rejected,omitempty"`
	Files    int      `json:"files"`
	Dirs     int      `json:"dirs"`
	Symlinks int      `json:"symlinks"`
	// Written files were downloaded; Unchanged already matched locally;
	// KeptNewer are local files newer than the checkpoint, left alone.
	Written   int           `json:"written"`
	Unchanged int           `json:"unchanged"`
	KeptNewer []string      `json:"kept_newer,omitempty"`
	Failed    []PathError   `json:"failed,omitempty"`
	Bytes     int64         `json:"bytes_downloaded"`
	Requests  int64         `json:"requests"`
	Duration  time.Duration `json:"duration_ns"`
}

// Restore brings opts.Dir to the newest complete checkpoint. Nothing is
// placed until every byte it needs has been downloaded and verified, so a
// checkpoint that turns out bad leaves the target untouched and the one
// before it is tried instead.
func (e *Engine) Restore(ctx context.Context, opts RestoreOptions) (*RestoreResult, error) {
	start := time.Now()
	before := e.st.Stats()
	res := &RestoreResult{Lineage: opts.Lineage}
	defer func() {
		after := e.st.Stats()
		res.Requests = after.Requests() - before.Requests()
		res.Bytes = after.BytesDownloaded - before.BytesDownloaded
		res.Duration = time.Since(start)
	}()
	if err := manifest.ValidLineage(opts.Lineage); err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, fmt.Errorf("restore into %s: %w", opts.Dir, err)
	}
	if opts.Path != "" {
		p := path.Clean(filepath.ToSlash(opts.Path))
		if p == "." || path.IsAbs(p) || p == ".." || strings.HasPrefix(p, "../") {
			return nil, fmt.Errorf("restore path %q: name a path inside the directory, relative to it", opts.Path)
		}
		opts.Path = p
	}
	unlock, err := e.state.lock(ctx, opts.Lineage)
	if err != nil {
		return nil, err
	}
	defer unlock()

	seqs, err := manifest.Sequences(ctx, e.st, opts.Lineage)
	if err != nil {
		return res, fmt.Errorf("restore %q: %w", opts.Lineage, err)
	}
	// Even a first start gets its directory: the harness writes into it.
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return res, fmt.Errorf("restore into %s: %w", dir, err)
	}
	if len(seqs) == 0 {
		if opts.Seq != 0 {
			return res, fmt.Errorf("restore %q: sequence %d: %w", opts.Lineage, opts.Seq, ErrNoValidManifest)
		}
		res.Empty = true
		return res, nil
	}
	newest := seqs[0]
	if opts.Seq != 0 {
		if !slices.Contains(seqs, opts.Seq) {
			return res, fmt.Errorf("restore %q: no sequence %d (newest is %d)", opts.Lineage, opts.Seq, newest)
		}
		seqs = []uint64{opts.Seq}
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return res, fmt.Errorf("restore into %s: %w", dir, err)
	}
	defer root.Close()
	removeStaleStaging(root, e)

	for _, seq := range seqs {
		m, err := manifest.Load(ctx, e.st, opts.Lineage, seq)
		if err == nil {
			err = e.restoreManifest(ctx, m, root, dir, newest, opts, res)
		}
		if err == nil {
			if len(res.Failed) > 0 {
				return res, fmt.Errorf("restore %q into %s: %w: %s", opts.Lineage, dir, ErrIncomplete, describeFailures(res.Failed))
			}
			return res, nil
		}
		if !isCandidateError(err) {
			return res, fmt.Errorf("restore %q into %s: %w", opts.Lineage, dir, err)
		}
		e.log.Warn("checkpoint does not verify; falling back to the one before", "lineage", opts.Lineage, "seq", seq, "err", err)
		res.Rejected = append(res.Rejected, fmt.Sprintf("%d: %v", seq, err))
	}
	return res, fmt.Errorf("restore %q: %w: %s", opts.Lineage, ErrNoValidManifest, strings.Join(res.Rejected, "; "))
}

func describeFailures(f []PathError) string {
	var b strings.Builder
	for i, p := range f {
		if i == 20 {
			fmt.Fprintf(&b, " and %d more", len(f)-i)
			break
		}
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s: %s", p.Path, p.Err)
	}
	return b.String()
}

func removeStaleStaging(root *os.Root, e *Engine) {
	ents, err := fs.ReadDir(root.FS(), ".")
	if err != nil {
		return
	}
	for _, d := range ents {
		if strings.HasPrefix(d.Name(), stagingPrefix) {
			if err := root.RemoveAll(d.Name()); err != nil {
				e.log.Warn("cannot remove staging left by an interrupted restore", "path", d.Name(), "err", err)
			}
		}
	}
}

type restoreItem struct {
	rel    string
	en     manifest.Entry
	staged string
	action int
	// ancestor: a directory on the way to RestoreOptions.Path, created if
	// missing but otherwise left as it is.
	ancestor bool
}

const (
	actWrite = iota
	actUnchanged
	actKeep
)

type chunkTarget struct {
	item *restoreItem
	off  int64
}

func (e *Engine) restoreManifest(ctx context.Context, m *manifest.Manifest, root *os.Root, dir string, newest uint64, opts RestoreOptions, res *RestoreResult) error {
	sizes, err := e.checkSegments(ctx, m)
	if err != nil {
		return err
	}
	var dirs, items []*restoreItem
	dirRefs := map[string]dirState{}
	kept := map[string]fileState{} // tombstones not restored, for the index
	matched := false
	trees := newTreeCache(e.st, sizes)
	err = e.walkVia(ctx, trees, m.Root, func(rel string, en *manifest.Entry) error {
		inPath := opts.Path == "" || rel == opts.Path || strings.HasPrefix(rel, opts.Path+"/")
		matched = matched || (opts.Path != "" && rel == opts.Path)
		switch {
		case opts.Path != "" && !inPath:
			// Only the directories on the way to it.
			if en.Type != manifest.TypeDir || !strings.HasPrefix(opts.Path, rel+"/") {
				return nil
			}
		case en.Deleted != 0 && !opts.IncludeDeleted && opts.Path == "":
			if en.Type != manifest.TypeDir {
				kept[rel] = storedState(en)
			}
			return nil
		}
		it := &restoreItem{rel: rel, en: *en, ancestor: !inPath}
		if en.Type == manifest.TypeDir {
			dirs = append(dirs, it)
		} else {
			items = append(items, it)
		}
		return nil
	}, func(rel string, ref segments.Ref, key segments.ID) {
		dirRefs[rel] = dirState{Tree: ref, Key: key}
	})
	if err != nil {
		return err
	}
	if opts.Path != "" && !matched {
		return fmt.Errorf("%w: %q in seq %d (see 'agentstate ls --deleted' for deleted paths)", ErrPathNotFound, opts.Path, m.Seq)
	}

	staging := stagingPrefix + randomHex()
	if err := root.Mkdir(staging, 0o700); err != nil {
		return fmt.Errorf("create staging directory: %w", err)
	}
	defer func() {
		if err := root.RemoveAll(staging); err != nil {
			e.log.Warn("cannot remove staging directory", "path", filepath.Join(dir, staging), "err", err)
		}
	}()

	// Decide per file, then stage every file that must be written.
	bySeg := map[segments.ID]map[int64][]chunkTarget{}
	refsOf := map[segments.ID][]segments.Ref{}
	for i, it := range items {
		it.action = e.decide(ctx, root, dir, it)
		if it.action != actWrite {
			continue
		}
		it.staged = fmt.Sprintf("%s/%d", staging, i)
		if it.en.Type != manifest.TypeFile {
			continue
		}
		f, err := root.OpenFile(it.staged, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("stage %s: %w", it.rel, err)
		}
		f.Close()
		var off int64
		for _, r := range it.en.Content {
			t := bySeg[r.Segment]
			if t == nil {
				t = map[int64][]chunkTarget{}
				bySeg[r.Segment] = t
			}
			if len(t[r.Offset]) == 0 {
				refsOf[r.Segment] = append(refsOf[r.Segment], r)
			}
			t[r.Offset] = append(t[r.Offset], chunkTarget{item: it, off: off})
			off += r.Size
		}
	}
	// Metadata segments the walk read by ranges (past the tree cache's
	// bound) are read whole too, so damage anywhere in them is found before
	// anything is placed.
	meta := map[segments.ID]bool{}
	for _, d := range dirRefs {
		meta[d.Tree.Segment] = true
	}
	for _, it := range items {
		if it.en.Chunks != nil {
			meta[it.en.Chunks.Segment] = true
		}
		for _, p := range it.en.Pages {
			meta[p.Segment] = true
		}
	}
	for seg := range meta {
		if trees.verified(seg) {
			continue // read whole and checked by the walk already
		}
		if _, ok := refsOf[seg]; !ok {
			refsOf[seg] = nil
		}
	}
	if err := e.download(ctx, root, sizes, refsOf, bySeg); err != nil {
		return err
	}

	// Everything verified: place it. From here on, errors are per path.
	res.Seq = m.Seq
	bad := map[string]bool{}
	failed := func(rel string, err error) {
		res.Failed = append(res.Failed, PathError{Path: rel, Err: err.Error()})
	}
	parentBad := func(rel string) bool {
		for p := path.Dir(rel); p != "." && p != ""; p = path.Dir(p) {
			if bad[p] {
				return true
			}
		}
		return false
	}
	for _, d := range dirs {
		if !d.ancestor {
			res.Dirs++
		}
		if parentBad(d.rel) {
			bad[d.rel] = true
			failed(d.rel, errors.New("parent directory could not be restored"))
			continue
		}
		if err := ensureDir(root, d.rel); err != nil {
			bad[d.rel] = true
			failed(d.rel, err)
		}
	}
	placed := map[string]fileState{}
	for _, it := range items {
		if it.en.Type == manifest.TypeFile {
			res.Files++
		} else {
			res.Symlinks++
		}
		if parentBad(it.rel + "/x") {
			failed(it.rel, errors.New("parent directory could not be restored"))
			continue
		}
		switch it.action {
		case actKeep:
			res.KeptNewer = append(res.KeptNewer, it.rel)
			continue
		case actUnchanged:
			res.Unchanged++
		case actWrite:
			if err := place(root, it); err != nil {
				failed(it.rel, err)
				continue
			}
			res.Written++
		}
		if st, ok := e.restoredState(root, dir, it); ok {
			placed[it.rel] = st
		}
	}
	// Directory times last, deepest first, once nothing more is put in them.
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		if bad[d.rel] || d.ancestor {
			continue
		}
		if err := root.Chmod(d.rel, fileMode(d.en.Mode)); err != nil {
			failed(d.rel, err)
			continue
		}
		mt := time.Unix(0, d.en.MTime)
		if err := root.Chtimes(d.rel, mt, mt); err != nil {
			failed(d.rel, err)
		}
	}
	if err := syncFS(root); err != nil {
		return fmt.Errorf("flush restored files to disk: %w", err)
	}
	if len(res.Failed) > 0 || opts.Path != "" {
		return nil
	}
	maps.Copy(placed, kept)
	ix := newIndex(e.st.String(), m.Lineage, dir)
	ix.Seq, ix.Base, ix.Root, ix.Files, ix.Dirs, ix.Restored = newest, m.Seq, m.Root, placed, dirRefs, true
	if err := e.state.saveIndex(ix); err != nil {
		e.log.Warn("restored, but cannot save local index", "lineage", m.Lineage, "err", err)
	}
	return nil
}

// restoredState is the index entry for a file restore placed (or found
// equal), so the next checkpoint starts from it without re-reading.
func (e *Engine) restoredState(root *os.Root, dir string, it *restoreItem) (fileState, bool) {
	fi, err := root.Lstat(it.rel)
	if err != nil {
		return fileState{}, false
	}
	ctime, ino, dev := statOf(fi)
	st := fileState{Type: it.en.Type, Mode: it.en.Mode, Size: fi.Size(),
		MTime: fi.ModTime().UnixNano(), CTime: ctime, Ino: ino, Dev: dev,
		Target: it.en.Target, Content: it.en.Content, Chunks: it.en.Chunks, Pages: it.en.Pages,
		Format: it.en.Format, Shipped: it.en.Size}
	abs := filepath.Join(dir, filepath.FromSlash(it.rel))
	switch it.en.Format {
	case manifest.FormatLines:
		f, err := os.Open(abs)
		if err != nil {
			return fileState{}, false
		}
		defer f.Close()
		if st.TailHash, err = tailHash(f, it.en.Size); err != nil {
			return fileState{}, false
		}
	case manifest.FormatSQLite:
		if e.dbs == nil {
			return fileState{}, false
		}
		if st.Stamp, err = e.dbs.Stamp(abs); err != nil {
			return fileState{}, false
		}
	}
	return st, true
}

// checkSegments confirms that every segment the manifest lists exists, so
// a manifest whose objects are gone is rejected before anything downloads.
func (e *Engine) checkSegments(ctx context.Context, m *manifest.Manifest) (map[segments.ID]int64, error) {
	sem := make(chan struct{}, e.par*2)
	var mu sync.Mutex
	var first error
	sizes := make(map[segments.ID]int64, len(m.Segments))
	var wg sync.WaitGroup
	for _, s := range m.Segments {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			info, err := e.st.Stat(ctx, segments.Key(s))
			mu.Lock()
			defer mu.Unlock()
			if err != nil && first == nil {
				first = fmt.Errorf("segment %s: %w", s, err)
			}
			sizes[s] = info.Size
		}()
	}
	wg.Wait()
	return sizes, first
}

// maxGap: needed records closer than this are read with one ranged GET;
// farther apart, two GETs cost less than downloading the gap.
const maxGap = 1 << 20

// download fetches every needed record with a bounded number of GETs in
// flight, verifies each blob and writes it at its offsets in staged files.
// A segment restore needs most of is read whole and checked against its
// name, so damage anywhere in it is caught, not only in the blobs read;
// from a segment it needs little of, only ranges are read.
func (e *Engine) download(ctx context.Context, root *os.Root, sizes map[segments.ID]int64, refsOf map[segments.ID][]segments.Ref, targets map[segments.ID]map[int64][]chunkTarget) error {
	type job struct {
		seg   segments.ID
		refs  []segments.Ref
		whole int64 // segment size when read whole, else -1
	}
	var jobs []job
	for seg, refs := range refsOf {
		slices.SortFunc(refs, func(a, b segments.Ref) int { return cmp.Compare(a.Offset, b.Offset) })
		var need int64
		for _, r := range refs {
			need += r.Length
		}
		if size := sizes[seg]; need*2 >= size || len(refs) == 0 {
			jobs = append(jobs, job{seg, refs, size})
			continue
		}
		startI := 0
		for i := 1; i <= len(refs); i++ {
			if i == len(refs) || refs[i].Offset-(refs[i-1].Offset+refs[i-1].Length) > maxGap {
				jobs = append(jobs, job{seg, refs[startI:i], -1})
				startI = i
			}
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	var first error
	fail := func(err error) {
		mu.Lock()
		if first == nil {
			first = err
			cancel()
		}
		mu.Unlock()
	}
	ch := make(chan job)
	var wg sync.WaitGroup
	for range e.par {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range ch {
				write := func(r segments.Ref, b []byte) error {
					for _, t := range targets[j.seg][r.Offset] {
						if err := writeAt(root, t.item.staged, b, t.off); err != nil {
							return &localError{fmt.Errorf("stage %s: %w", t.item.rel, err)}
						}
					}
					return nil
				}
				var err error
				if j.whole >= 0 {
					err = e.codec.ReadSegment(ctx, e.st, j.seg, j.whole, j.refs, write)
				} else {
					err = e.codec.ReadBlobs(ctx, e.st, j.seg, j.refs, write)
				}
				if err != nil {
					fail(err)
				}
			}
		}()
	}
	for _, j := range jobs {
		select {
		case ch <- j:
		case <-ctx.Done():
		}
	}
	close(ch)
	wg.Wait()
	if first != nil {
		var le *localError
		if errors.As(first, &le) {
			return le.err // a local disk problem is not a bad checkpoint
		}
		return first
	}
	return ctx.Err()
}

type localError struct{ err error }

func (l *localError) Error() string { return l.err.Error() }

func writeAt(root *os.Root, name string, b []byte, off int64) error {
	f, err := root.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(b, off); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// decide what restore does with one file or symlink: never overwrite a
// local file newer than the checkpoint (a hot restart keeps newer work). A
// local database that passes quick_check is authoritative and left alone;
// a corrupt one is replaced by the checkpointed copy.
func (e *Engine) decide(ctx context.Context, root *os.Root, dir string, it *restoreItem) int {
	fi, err := root.Lstat(it.rel)
	if err != nil {
		return actWrite
	}
	if it.en.Format == manifest.FormatSQLite && fi.Mode().IsRegular() {
		if e.dbs != nil && e.dbs.Valid(ctx, filepath.Join(dir, filepath.FromSlash(it.rel))) {
			return actKeep
		}
		return actWrite
	}
	mt := fi.ModTime().UnixNano()
	if mt > it.en.MTime {
		return actKeep
	}
	switch it.en.Type {
	case manifest.TypeFile:
		if fi.Mode().IsRegular() && fi.Size() == it.en.Size && mt == it.en.MTime {
			return actUnchanged
		}
	case manifest.TypeSymlink:
		if fi.Mode()&os.ModeSymlink != 0 && mt == it.en.MTime {
			if t, err := root.Readlink(it.rel); err == nil && t == it.en.Target {
				return actUnchanged
			}
		}
	}
	return actWrite
}

// ensureDir makes rel a real directory. A symlink or a file in its place is
// refused: restore never writes through a link, whatever the manifest says.
func ensureDir(root *os.Root, rel string) error {
	fi, err := root.Lstat(rel)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := root.Mkdir(rel, 0o700); err != nil {
			return fmt.Errorf("create directory: %w", err)
		}
		return nil
	case err != nil:
		return err
	case fi.Mode()&os.ModeSymlink != 0:
		return errors.New("refusing to restore through a symlink in the target")
	case !fi.IsDir():
		return errors.New("a non-directory is in the way")
	}
	return nil
}

// place moves a staged file (or a new symlink) into its final path
// atomically, with its mode and mtime already set.
func place(root *os.Root, it *restoreItem) error {
	if fi, err := root.Lstat(it.rel); err == nil && fi.IsDir() {
		return errors.New("a directory is in the way")
	}
	switch it.en.Type {
	case manifest.TypeFile:
		if err := root.Chmod(it.staged, fileMode(it.en.Mode)); err != nil {
			return err
		}
		if it.en.Format == manifest.FormatSQLite {
			// A stale -wal beside the restored file would be replayed into
			// it by the next opener: remove companions first.
			for _, suf := range []string{"-wal", "-shm", "-journal"} {
				if err := root.Remove(it.rel + suf); err != nil && !errors.Is(err, fs.ErrNotExist) {
					return fmt.Errorf("remove stale %s: %w", it.rel+suf, err)
				}
			}
		}
		mt := time.Unix(0, it.en.MTime)
		if err := root.Chtimes(it.staged, mt, mt); err != nil {
			return err
		}
	case manifest.TypeSymlink:
		if err := root.Symlink(it.en.Target, it.staged); err != nil {
			return err
		}
		// os.Root has no Lchtimes; set the link's own times by fd-relative
		// utimensat on the staging directory, which cannot leave the root.
		if err := lchtimes(root, it.staged, it.en.MTime); err != nil {
			return err
		}
	}
	return root.Rename(it.staged, it.rel)
}

func lchtimes(root *os.Root, rel string, mtime int64) error {
	d, err := root.Open(path.Dir(rel))
	if err != nil {
		return err
	}
	defer d.Close()
	ts := []unix.Timespec{unix.NsecToTimespec(mtime), unix.NsecToTimespec(mtime)}
	return unix.UtimesNanoAt(int(d.Fd()), path.Base(rel), ts, unix.AT_SYMLINK_NOFOLLOW)
}

func syncFS(root *os.Root) error {
	d, err := root.Open(".")
	if err != nil {
		return err
	}
	defer d.Close()
	return unix.Syncfs(int(d.Fd()))
}

func fileMode(m uint32) os.FileMode {
	fm := os.FileMode(m & 0o777)
	if m&0o4000 != 0 {
		fm |= os.ModeSetuid
	}
	if m&0o2000 != 0 {
		fm |= os.ModeSetgid
	}
	if m&0o1000 != 0 {
		fm |= os.ModeSticky
	}
	return fm
}

func randomHex() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
