package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

// CheckpointOptions names what to checkpoint.
type CheckpointOptions struct {
	Lineage string
	Dir     string
	// Exclude, if set, drops a path (slash-separated, relative to Dir)
	// from the checkpoint; a directory is dropped with everything below it.
	Exclude func(rel string, isDir bool) bool
	// AppendOnly marks append-only transcripts: each checkpoint ships only
	// the complete lines appended since the last one (a rewrite is detected
	// and shipped whole).
	AppendOnly func(rel string) bool
	// SQLite marks databases, captured through Options.Databases.
	SQLite func(rel string) bool
	// Authoritative lets a checkpoint commit a tree this machine never
	// restored, for a lineage that already has checkpoints.
	Authoritative bool
	// KeepDeleted is how long a path deleted from the tree stays in the
	// checkpoints as a deletion tombstone, restorable (default
	// DefaultKeepDeleted; negative keeps none).
	KeepDeleted time.Duration
}

// DefaultKeepDeleted is how long deleted paths stay restorable.
const DefaultKeepDeleted = 7 * 24 * time.Hour

// CheckpointResult is what one checkpoint did and cost.
type CheckpointResult struct {
	Lineage string `json:"lineage"`
	// Seq is the committed sequence, or the current one when nothing changed.
	Seq       uint64 `json:"seq"`
	Committed bool   `json:"committed"`
	Files     int    `json:"files"`
	// FilesRead were read because their stat changed; FilesChanged are the
	// paths whose content or metadata differs from the previous checkpoint.
	FilesRead        int   `json:"files_read"`
	FilesChanged     int   `json:"files_changed"`
	BlobsUploaded    int   `json:"blobs_uploaded"`
	SegmentsUploaded int   `json:"segments_uploaded"`
	BytesUploaded    int64 `json:"bytes_uploaded"`
	// SegmentsCompacted were retired by compaction this time (their live
	// blobs, BytesCompacted of records, were copied into new segments).
	SegmentsCompacted int           `json:"segments_compacted,omitempty"`
	BytesCompacted    int64         `json:"bytes_compacted,omitempty"`
	Requests          int64         `json:"requests"`
	Duration          time.Duration `json:"duration_ns"`
	Skipped           []string      `json:"skipped,omitempty"`
	// Tombstones is how many deleted paths the committed tree keeps
	// restorable.
	Tombstones int `json:"tombstones,omitempty"`
	// DatabaseErrors names databases that could not be captured; each kept
	// its previous checkpointed copy.
	DatabaseErrors []string `json:"database_errors,omitempty"`
}

// stagingPrefix names restore's staging directories inside a target; a
// checkpoint never takes them.
const stagingPrefix = ".agentstate-restore-"

// lazyRef is a reference that may still wait for its segment to be sealed.
type lazyRef struct {
	ref  segments.Ref
	pend *segments.Pending
}

func (l lazyRef) get() segments.Ref {
	if l.pend != nil {
		r, _ := l.pend.Ref()
		return r
	}
	return l.ref
}

type node struct {
	name     string
	rel      string
	typ      manifest.Type
	mode     uint32
	mtime    int64
	size     int64
	target   string
	format   string
	content  []lazyRef
	list     *lazyRef  // chunk list blob, for files of many chunks
	pages    []lazyRef // its pages, when the list is paged
	children []*node
	state    fileState
	tree     lazyRef
	key      segments.ID // location-free, see manifest.TreeKey
	// deleted is the deletion time of a tombstone (Unix ns); ghost marks a
	// directory made only to hold tombstones, deleted when its newest
	// tombstone was.
	deleted int64
	ghost   bool
}

type checkpointRun struct {
	e        *Engine
	ctx      context.Context
	opts     CheckpointOptions
	ix       *index
	known    map[segments.ID]segments.Ref
	pending  map[segments.ID]*segments.Pending
	up       *segments.Uploader
	data     *segments.Packer
	trees    *segments.Packer
	lines    *segments.Packer
	params   segments.ChunkParams
	started  time.Time
	res      *CheckpointResult
	blobsNew int
}

// Checkpoint uploads what changed in opts.Dir and commits a manifest last.
// An unchanged tree costs no request at all.
func (e *Engine) Checkpoint(ctx context.Context, opts CheckpointOptions) (*CheckpointResult, error) {
	start := time.Now()
	before := e.st.Stats().Requests()
	res := &CheckpointResult{Lineage: opts.Lineage}
	if err := manifest.ValidLineage(opts.Lineage); err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", opts.Dir, err)
	}
	if fi, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", dir, err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("checkpoint %s: not a directory", dir)
	}
	opts.Dir = dir
	unlock, err := e.state.lock(ctx, opts.Lineage)
	if err != nil {
		return nil, err
	}
	defer unlock()

	err = e.checkpointLocked(ctx, opts, res)
	res.Requests = e.st.Stats().Requests() - before
	res.Duration = time.Since(start)
	e.recordStatus(res, err)
	if err != nil {
		return res, fmt.Errorf("checkpoint %s of %q: %w", dir, opts.Lineage, err)
	}
	return res, nil
}

func (e *Engine) checkpointLocked(ctx context.Context, opts CheckpointOptions, res *CheckpointResult) error {
	cfg, err := e.config(ctx, true)
	if err != nil {
		return err
	}
	writer, err := e.state.writerID()
	if err != nil {
		return err
	}
	ix, err := e.currentIndex(ctx, opts.Lineage, opts.Dir)
	if err != nil {
		return err
	}
	if ix.Seq > 0 && !ix.Restored && !e.state.initialized(opts.Lineage) && !opts.Authoritative {
		return fmt.Errorf("%w: lineage %q has checkpoints (newest seq %d) that were never restored here; "+
			"run 'agentstate restore' first, or pass --authoritative to commit this tree as the new truth",
			ErrNotRestored, opts.Lineage, ix.Seq)
	}
	if ix.Base != ix.Seq {
		// After a restore fell back past a bad manifest, reuse nothing: the
		// base is older than the newest manifest, and GC keeps alive only
		// what retained manifests list, so this commit stands on its own.
		ix.Files, ix.Dirs = map[string]fileState{}, map[string]dirState{}
	}
	if opts.SQLite != nil && e.dbs == nil {
		return errors.New("checkpoint: databases are configured but the engine has no SQLite support")
	}
	r := e.newRun(ctx, opts, ix, cfg, time.Now(), res)

	root := &node{typ: manifest.TypeDir}
	scanErr := r.compact(cfg.SegmentSize)
	r.known = ix.known() // after compaction moved blobs
	if scanErr == nil {
		scanErr = r.scanDir(root, opts.Dir)
	}
	if scanErr == nil {
		r.tombstones(root)
	}
	if scanErr == nil {
		// Data references must be final before trees that hold them encode.
		r.data.Flush(ctx)
		r.lines.Flush(ctx)
		r.buildTree(root)
		r.trees.Flush(ctx)
	}
	upErr := r.up.Wait()
	st := r.up.Stats()
	res.SegmentsUploaded, res.BytesUploaded, res.BlobsUploaded = int(st.Segments), st.Bytes, r.blobsNew
	if scanErr != nil {
		return scanErr
	}
	if upErr != nil {
		return fmt.Errorf("upload segments (no manifest committed): %w", upErr)
	}
	if err := ctx.Err(); err != nil {
		return err
	}

	files, dirs, segs, totals := r.collect(root)
	rootRef := root.tree.get()
	res.Files = int(totals.Files)
	for rel, old := range ix.Files {
		if now, ok := files[rel]; old.Deleted == 0 && (!ok || now.Deleted != 0) {
			res.FilesChanged++ // deleted
		}
	}
	res.Seq = ix.Seq
	dbErr := func() error {
		if len(res.DatabaseErrors) == 0 {
			return nil
		}
		return fmt.Errorf("%w: %s (each kept its previous checkpointed copy)", ErrDatabase, strings.Join(res.DatabaseErrors, "; "))
	}
	if ix.Seq > 0 && ix.Base == ix.Seq && root.key == ix.Dirs[""].Key {
		// Nothing to commit; keep refreshed stat data so the next idle
		// checkpoint does not re-read files (a local write, no request).
		if res.FilesRead > 0 {
			ix.Files = files
			if err := e.state.saveIndex(ix); err != nil {
				e.log.Warn("cannot save local index", "lineage", opts.Lineage, "err", err)
			}
		}
		return dbErr()
	}
	m := &manifest.Manifest{Version: manifest.Version, Lineage: opts.Lineage,
		Seq: ix.Seq + 1, Parent: ix.Seq, Time: e.now().UTC(), Writer: writer,
		Root: rootRef, Totals: totals, Segments: segs}
	if err := e.commit(ctx, m, writer); err != nil {
		return err
	}
	res.Seq, res.Committed = m.Seq, true
	ix.Seq, ix.Base, ix.Root, ix.Files, ix.Dirs = m.Seq, m.Seq, rootRef, files, dirs
	if err := e.state.saveIndex(ix); err != nil {
		// The commit stands; a lost index is rebuilt from it next time.
		e.log.Warn("committed, but cannot save local index", "lineage", opts.Lineage, "err", err)
	}
	return dbErr()
}

// newRun sets up one checkpoint's work on ix: an uploader and a packer per
// segment kind.
func (e *Engine) newRun(ctx context.Context, opts CheckpointOptions, ix *index, cfg *manifest.Config, started time.Time, res *CheckpointResult) *checkpointRun {
	r := &checkpointRun{e: e, ctx: ctx, opts: opts, ix: ix,
		pending: map[segments.ID]*segments.Pending{}, params: e.chunkParams(cfg),
		started: started, res: res}
	r.up = segments.NewUploader(e.st, e.par, e.log)
	r.data = segments.NewPacker(r.up, segments.KindData, cfg.SegmentSize)
	r.trees = segments.NewPacker(r.up, segments.KindTree, cfg.SegmentSize)
	r.lines = segments.NewPacker(r.up, segments.KindLines, cfg.SegmentSize)
	return r
}

// recordStatus keeps the outcome for `agentstate status`.
func (e *Engine) recordStatus(res *CheckpointResult, err error) {
	st := e.state.loadStatus(res.Lineage)
	now := time.Now().UTC()
	st.LastAttempt, st.LastError = now, ""
	if err != nil {
		st.LastError = err.Error()
	}
	if res.Committed {
		st.Seq, st.LastCommit, st.BytesUploaded = res.Seq, now, res.BytesUploaded
	}
	if err == nil {
		st.LastSuccess, st.Files = now, res.Files
		if res.Seq > st.Seq {
			st.Seq = res.Seq
		}
	}
	e.state.saveStatus(st)
}

// Status returns the lineage's last checkpoint outcome on this machine.
func (e *Engine) Status(lineage string) (Status, error) {
	if err := manifest.ValidLineage(lineage); err != nil {
		return Status{}, err
	}
	return e.state.loadStatus(lineage), nil
}

// commit writes m. Two conflicts are not another writer, and m is
// committed at the next sequence once instead: a manifest our own writer
// committed (we crashed after the commit, before saving the index), and a
// GC compaction of our parent (the same tree re-packed while we were idle;
// m stands on its own, listing every segment its tree needs).
//
// Both may repeat (GC compacted twice while we were away; we crashed after
// a rebased commit), so this goes on along that chain, boundedly.
func (e *Engine) commit(ctx context.Context, m *manifest.Manifest, writer string) error {
	for range maxRebases {
		err := manifest.Commit(ctx, e.st, m)
		if !errors.Is(err, manifest.ErrConflict) {
			return err
		}
		other, lerr := manifest.Load(ctx, e.st, m.Lineage, m.Seq)
		switch {
		case lerr != nil:
			return err
		case other.Compacts != 0 && other.Compacts == m.Parent:
			e.log.Info("GC compacted the checkpoint this one builds on; committing after it",
				"lineage", m.Lineage, "seq", m.Seq+1)
		case other.Writer != writer:
			return err
		default:
			e.log.Info("sequence already committed by this writer before a crash; committing the next one",
				"lineage", m.Lineage, "seq", m.Seq)
		}
		m.Parent, m.Seq = m.Seq, m.Seq+1
	}
	return fmt.Errorf("commit %q seq %d: %w (more than %d compactions or own commits ahead)", m.Lineage, m.Seq, manifest.ErrConflict, maxRebases)
}

// maxRebases bounds how far commit follows compactions and its own
// earlier commits.
const maxRebases = 64

// currentIndex returns the local index, rebuilt from the newest manifest
// that verifies when it is missing, corrupt or of another tree.
func (e *Engine) currentIndex(ctx context.Context, lineage, dir string) (*index, error) {
	ix, err := e.state.loadIndex(lineage, e.st.String())
	if err != nil && !errors.Is(err, errCorruptIndex) {
		return nil, err
	}
	if errors.Is(err, errCorruptIndex) {
		e.log.Warn("local index is corrupt; rebuilding it from the newest manifest", "lineage", lineage)
	}
	if ix != nil && ix.Dir == dir {
		return ix, nil
	}
	return e.rebuildIndex(ctx, lineage, dir)
}

// rebuildIndex reconstructs the index from the store: references only, no
// stat data, so every file is read once more but nothing known is uploaded.
func (e *Engine) rebuildIndex(ctx context.Context, lineage, dir string) (*index, error) {
	ix := newIndex(e.st.String(), lineage, dir)
	seqs, err := manifest.Sequences(ctx, e.st, lineage)
	if err != nil {
		return nil, err
	}
	if len(seqs) == 0 {
		return ix, nil
	}
	ix.Seq = seqs[0]
	for _, seq := range seqs {
		m, err := manifest.Load(ctx, e.st, lineage, seq)
		if err == nil {
			err = e.fillIndex(ctx, ix, m)
		}
		if err == nil {
			return ix, nil
		}
		if !isCandidateError(err) {
			return nil, err
		}
		e.log.Warn("manifest unusable for the index, trying the one before", "lineage", lineage, "seq", seq, "err", err)
		ix.Files, ix.Dirs = map[string]fileState{}, map[string]dirState{}
	}
	return ix, nil
}

func (e *Engine) fillIndex(ctx context.Context, ix *index, m *manifest.Manifest) error {
	ix.Base, ix.Root = m.Seq, m.Root
	return e.walk(ctx, m.Root, func(rel string, en *manifest.Entry) error {
		switch en.Type {
		case manifest.TypeFile, manifest.TypeSymlink:
			st := storedState(en)
			st.Racy = true // no stat data: read it once more
			ix.Files[rel] = st
		}
		return nil
	}, func(rel string, ref segments.Ref, key segments.ID) {
		ix.Dirs[rel] = dirState{Tree: ref, Key: key}
	})
}

// scanDir fills n with the directory at abs, reading changed files.
func (r *checkpointRun) scanDir(n *node, abs string) error {
	ents, err := os.ReadDir(abs)
	if err != nil {
		return fmt.Errorf("read directory %s: %w", abs, err)
	}
	for _, d := range ents {
		if err := r.ctx.Err(); err != nil {
			return err
		}
		name := d.Name()
		rel := name
		if n.rel != "" {
			rel = n.rel + "/" + name
		}
		if n.rel == "" && strings.HasPrefix(name, stagingPrefix) {
			continue
		}
		if manifest.ValidName(name) != nil {
			r.skip(rel, "name cannot be stored")
			continue
		}
		path := filepath.Join(abs, name)
		fi, err := os.Lstat(path)
		if errors.Is(err, os.ErrNotExist) {
			continue // deleted while we scanned
		}
		if err != nil {
			return fmt.Errorf("stat %s: %w", path, err)
		}
		isDir := fi.IsDir()
		if r.opts.Exclude != nil && r.opts.Exclude(rel, isDir) {
			continue
		}
		c := &node{name: name, rel: rel, mode: uint32(fi.Mode().Perm()) | specialBits(fi.Mode()),
			mtime: fi.ModTime().UnixNano()}
		switch {
		case isDir:
			c.typ = manifest.TypeDir
			if err := r.scanDir(c, path); err != nil {
				return err
			}
		case fi.Mode()&os.ModeSymlink != 0:
			target, err := os.Readlink(path)
			if err != nil {
				return fmt.Errorf("read symlink %s: %w", path, err)
			}
			if target == "" || len(target) > manifest.MaxTargetLen {
				r.skip(rel, "symlink target cannot be stored")
				continue
			}
			c.typ, c.target = manifest.TypeSymlink, target
			c.state = fileState{Type: c.typ, Mode: c.mode, MTime: c.mtime, Target: target}
			if old, ok := r.prev(rel); !ok || old.Type != c.typ || old.Target != target || old.Mode != c.mode {
				r.res.FilesChanged++
			}
		case fi.Mode().IsRegular():
			c.typ = manifest.TypeFile
			var err error
			switch {
			case r.opts.SQLite != nil && r.opts.SQLite(rel):
				err = r.database(c, path, fi)
			case r.opts.AppendOnly != nil && r.opts.AppendOnly(rel):
				err = r.transcript(c, path, fi)
			default:
				err = r.file(c, path, fi)
			}
			if errors.Is(err, errSkipEntry) {
				continue
			}
			if err != nil {
				return err
			}
		default:
			r.skip(rel, "not a regular file, directory or symlink ("+fi.Mode().Type().String()+")")
			continue
		}
		n.children = append(n.children, c)
	}
	return nil
}

func (r *checkpointRun) skip(rel, why string) {
	r.e.log.Warn("skipping path", "path", rel, "reason", why)
	r.res.Skipped = append(r.res.Skipped, rel)
}

func specialBits(m os.FileMode) uint32 {
	var b uint32
	if m&os.ModeSetuid != 0 {
		b |= 0o4000
	}
	if m&os.ModeSetgid != 0 {
		b |= 0o2000
	}
	if m&os.ModeSticky != 0 {
		b |= 0o1000
	}
	return b
}

func statOf(fi os.FileInfo) (ctime int64, ino, dev uint64) {
	if s, ok := fi.Sys().(*syscall.Stat_t); ok {
		return s.Ctim.Nano(), s.Ino, uint64(s.Dev)
	}
	return 0, 0, 0
}

// file decides from the index whether the file changed; if so it reads it
// once, chunk by chunk, uploading only chunks the repository lacks.
// errSkipEntry: the path vanished while being scanned, or (a database that
// was never captured) has nothing to store: leave it out of this checkpoint.
var errSkipEntry = errors.New("skip entry")

// statState is what the index will remember of a regular file's stat.
func (r *checkpointRun) statState(c *node, fi os.FileInfo) fileState {
	ctime, ino, dev := statOf(fi)
	st := fileState{Type: manifest.TypeFile, Mode: c.mode, Size: fi.Size(), MTime: c.mtime,
		CTime: ctime, Ino: ino, Dev: dev, Format: c.format}
	// A change within the same clock tick as our read could leave the stat
	// unchanged; such files are read again next time (as git does).
	st.Racy = c.mtime >= r.started.Add(-time.Second).UnixNano() || ctime >= r.started.Add(-time.Second).UnixNano()
	return st
}

// unchanged reuses the index's content for a file whose stat proves it
// has not changed since it was last read.
func (r *checkpointRun) unchanged(c *node, st fileState) bool {
	old, had := r.prev(c.rel)
	if !had || old.Racy || old.Type != st.Type || old.Size != st.Size || old.MTime != st.MTime ||
		old.CTime != st.CTime || old.Ino != st.Ino || old.Dev != st.Dev || old.Mode != st.Mode ||
		old.Format != st.Format || old.Stamp != st.Stamp {
		return false
	}
	r.reuse(c, old)
	st.Content, st.TailHash, st.Shipped = old.Content, old.TailHash, old.Shipped
	c.state = st
	return true
}

// reuse gives c the stored content of old.
func (r *checkpointRun) reuse(c *node, old fileState) {
	c.content, c.size = c.content[:0], 0
	for _, ref := range old.Content {
		c.content = append(c.content, lazyRef{ref: ref})
		c.size += ref.Size
	}
	c.adoptList(old)
}

func (r *checkpointRun) open(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, errSkipEntry // deleted while we scanned: not in this checkpoint
	}
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return f, nil
}

// chunker is what file content is cut with: CDC or fixed blocks.
type chunker interface{ Next() ([]byte, error) }

// ship chunks everything ch yields into p, appending to c.content.
func (r *checkpointRun) ship(c *node, ch chunker, p *segments.Packer, what string) error {
	for {
		chunk, err := ch.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read %s: %w", what, err)
		}
		c.content = append(c.content, r.blob(segments.Sum(chunk), chunk, p))
		c.size += int64(len(chunk))
	}
}

// settle finishes a file that was read: content that turns out identical
// to what is stored keeps the stored references and chunk list exactly, so
// re-reading a file (racy, or after an index rebuild) never re-encodes its
// metadata into new blobs; otherwise the change is counted.
func (r *checkpointRun) settle(c *node, st fileState) {
	c.state = st
	old, had := r.prev(c.rel)
	if had && old.Format == st.Format && sameIDs(old.Content, blobIDs(c.content)) {
		r.reuse(c, old)
		c.state.Content = old.Content
		if old.Mode == st.Mode && old.MTime == st.MTime {
			return
		}
	}
	r.res.FilesChanged++
}

func (r *checkpointRun) file(c *node, path string, fi os.FileInfo) error {
	r.res.Files++
	st := r.statState(c, fi)
	if r.unchanged(c, st) {
		return nil
	}
	r.res.FilesRead++
	f, err := r.open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := r.ship(c, segments.NewChunker(f, r.params), r.data, path); err != nil {
		return err
	}
	r.settle(c, st)
	return nil
}

// tailLen is how much of an append-only file's shipped prefix is re-read
// to check that the writer only appended since.
const tailLen = 4096

// transcript ships an append-only file: only the complete lines appended
// since the last checkpoint, while the writer keeps the file open and
// appending; a torn last line waits for the next checkpoint. A file that
// shrank, was replaced, or whose shipped tail changed was rewritten (Codex
// trims history.jsonl in place): it is shipped whole again.
func (r *checkpointRun) transcript(c *node, path string, fi os.FileInfo) error {
	r.res.Files++
	c.format = manifest.FormatLines
	st := r.statState(c, fi)
	if r.unchanged(c, st) {
		return nil
	}
	r.res.FilesRead++
	f, err := r.open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	size := fi.Size()
	old, had := r.prev(c.rel)
	start := int64(0)
	if had && old.Format == manifest.FormatLines && old.Ino == st.Ino && old.Dev == st.Dev &&
		old.Shipped > 0 && size >= old.Shipped {
		if h, err := tailHash(f, old.Shipped); err == nil && h == old.TailHash {
			start = old.Shipped
		}
	}
	if start == 0 && had && old.Format == manifest.FormatLines && old.Ino == 0 && old.Shipped > 0 && size >= old.Shipped &&
		samePrefix(f, old.Content) {
		// An index rebuilt from the store knows no inode or tail hash, but
		// it knows every stored piece's id: a prefix that hashes to them is
		// what was shipped, and only what follows it is new.
		start = old.Shipped
	}
	keep := len(old.Content)
	if start > 0 {
		keep = r.mergeFrom(old.Content)
		for _, ref := range old.Content[keep:] {
			start -= ref.Size // shipped again, merged with what follows
		}
	}
	end, err := lastNewline(f, start, size)
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	if start > 0 {
		r.reuse(c, old) // the prefix is what was shipped before
		if keep < len(old.Content) {
			c.content, c.size, c.list, c.pages = c.content[:keep], start, nil, nil
		}
	} else {
		c.content, c.size, c.list, c.pages = nil, 0, nil, nil
	}
	if end > start {
		ch := segments.NewChunker(io.NewSectionReader(f, start, end-start), r.params)
		if err := r.ship(c, ch, r.lines, path); err != nil {
			return err
		}
		c.list, c.pages = nil, nil // the chunk list is rebuilt with the new lines
	}
	st.Shipped = c.size
	if st.TailHash, err = tailHash(f, c.size); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	r.settle(c, st)
	return nil
}

// mergeTail is how many small pieces may end a transcript before they are
// merged: each checkpoint's append is a piece of its own, often a few
// hundred bytes, and without merging a transcript appended at every
// checkpoint would hold a chunk reference (and restore a page of its chunk
// list) per checkpoint.
const mergeTail = 32

// mergeFrom returns how many of a transcript's shipped chunks to keep: all
// of them, or, when at least mergeTail chunks smaller than the minimum
// chunk size end it, the chunks before that run, which is then read again
// from the file and chunked with what was appended.
func (r *checkpointRun) mergeFrom(content []segments.Ref) int {
	k := len(content)
	for k > 0 && content[k-1].Size < int64(r.params.Min) {
		k--
	}
	if len(content)-k < mergeTail {
		return len(content)
	}
	return k
}

// lastNewline returns the offset just past the last '\n' in [start, end),
// or start if that range holds no complete line.
func lastNewline(f *os.File, start, end int64) (int64, error) {
	buf := make([]byte, 64<<10)
	for pos := end; pos > start; {
		n := min(int64(len(buf)), pos-start)
		pos -= n
		if _, err := f.ReadAt(buf[:n], pos); err != nil {
			return 0, err
		}
		if i := bytes.LastIndexByte(buf[:n], '\n'); i >= 0 {
			return pos + int64(i) + 1, nil
		}
	}
	return start, nil
}

// samePrefix reports whether f begins with exactly the blobs refs name.
func samePrefix(f *os.File, refs []segments.Ref) bool {
	var off int64
	var buf []byte
	for _, r := range refs {
		if r.Size <= 0 || r.Size > segments.MaxBlobSize {
			return false
		}
		buf = slices.Grow(buf[:0], int(r.Size))[:r.Size]
		if _, err := f.ReadAt(buf, off); err != nil || segments.Sum(buf) != r.Blob {
			return false
		}
		off += r.Size
	}
	return len(refs) > 0
}

// tailHash hashes the last tailLen bytes before off.
func tailHash(f *os.File, off int64) (uint64, error) {
	n := min(off, tailLen)
	buf := make([]byte, n)
	if _, err := f.ReadAt(buf, off-n); err != nil {
		return 0, err
	}
	return xxhash.Sum64(buf), nil
}

// dbBlock is the fixed block size databases are cut into: a multiple of
// every SQLite page size up to 16 KiB, so one changed page changes one
// block, and large enough to keep the chunk list short.
const dbBlock = 16 << 10

// database captures a SQLite database with the online backup API into an
// owner-only staging file and ships it in page-aligned blocks. An idle
// database (same stamp of db and -wal) is neither opened nor uploaded. A
// database that cannot be captured keeps its previous checkpointed copy and
// the checkpoint reports the error; nothing else is lost.
func (r *checkpointRun) database(c *node, path string, fi os.FileInfo) error {
	r.res.Files++
	c.format = manifest.FormatSQLite
	st := r.statState(c, fi)
	stamp, err := r.e.dbs.Stamp(path)
	if err != nil {
		return r.dbFailed(c, fmt.Errorf("%s: %w", c.rel, err))
	}
	st.Stamp = stamp
	if r.unchanged(c, st) {
		return nil
	}
	r.res.FilesRead++
	dir, err := r.e.state.lineageDir(r.opts.Lineage)
	if err != nil {
		return err
	}
	staging, err := os.MkdirTemp(dir, "db-")
	if err != nil {
		return fmt.Errorf("database staging: %w", err)
	}
	defer os.RemoveAll(staging)
	copyPath := filepath.Join(staging, "snapshot.db")
	if err := r.e.dbs.Snapshot(r.ctx, path, copyPath); err != nil {
		if r.ctx.Err() != nil {
			return r.ctx.Err()
		}
		return r.dbFailed(c, fmt.Errorf("%s: %w", c.rel, err))
	}
	f, err := os.Open(copyPath)
	if err != nil {
		return fmt.Errorf("open database snapshot of %s: %w", c.rel, err)
	}
	defer f.Close()
	c.content, c.size, c.list, c.pages = nil, 0, nil, nil
	if err := r.ship(c, segments.NewFixedChunker(f, dbBlock), r.data, c.rel); err != nil {
		return err
	}
	st.Shipped = c.size
	r.settle(c, st)
	return nil
}

// dbFailed keeps the previous good copy of a database that could not be
// captured this time, and records the error.
func (r *checkpointRun) dbFailed(c *node, err error) error {
	r.e.log.Error("database not captured; keeping its previous checkpoint", "path", c.rel, "err", err)
	r.res.DatabaseErrors = append(r.res.DatabaseErrors, err.Error())
	old, had := r.prev(c.rel)
	if !had || old.Format != manifest.FormatSQLite {
		return errSkipEntry
	}
	r.reuse(c, old)
	c.mtime, c.mode = old.MTime, old.Mode
	old.Racy = true // try again next time
	c.state = old
	return nil
}

func sameIDs(refs []segments.Ref, ids []segments.ID) bool {
	if len(refs) != len(ids) {
		return false
	}
	for i := range refs {
		if refs[i].Blob != ids[i] {
			return false
		}
	}
	return true
}

// blob returns where the blob with this id lives, packing it if the
// repository (as far as the lineage's last manifest says) lacks it.
func (r *checkpointRun) blob(id segments.ID, plain []byte, p *segments.Packer) lazyRef {
	if ref, ok := r.known[id]; ok {
		return lazyRef{ref: ref}
	}
	if pd, ok := r.pending[id]; ok {
		return lazyRef{pend: pd}
	}
	_, rec := r.e.codec.Encode(plain)
	pd := p.Add(r.ctx, id, rec, int64(len(plain)))
	r.pending[id] = pd
	r.blobsNew++
	return lazyRef{pend: pd}
}

// buildTree encodes n's tree bottom-up. Child references are taken only
// after all children are packed, right before n itself is packed: a child
// still in the open segment is then guaranteed to share n's segment, which
// is what a zero-segment (same segment) reference means.
//
// A directory whose location-free key equals the one the index remembers
// for its path is unchanged: it keeps its stored tree, and its files keep
// the exact references that tree holds, so the manifest's segment list is
// computed from what the stored bytes really reference.
func (r *checkpointRun) buildTree(n *node) {
	for _, c := range n.children {
		if c.typ == manifest.TypeDir {
			r.buildTree(c)
		}
		if n.ghost {
			n.deleted = max(n.deleted, c.deleted)
		}
	}
	// Chunk lists are packed before any child reference is taken (the
	// same-segment rule above holds for them too).
	for _, c := range n.children {
		if c.typ == manifest.TypeFile && len(c.content) > manifest.InlineChunks && c.list == nil {
			r.packList(c)
		}
	}
	full := manifest.Tree{Entries: make([]manifest.Entry, 0, len(n.children))}
	for _, c := range n.children {
		en := manifest.Entry{Name: c.name, Type: c.typ, Mode: c.mode, MTime: c.mtime, Deleted: c.deleted}
		switch c.typ {
		case manifest.TypeFile:
			en.Size, en.Format = c.size, c.format
			for _, l := range c.content {
				en.Content = append(en.Content, l.get())
			}
			if c.list != nil {
				ref := c.list.get()
				en.Chunks = &ref
			}
		case manifest.TypeSymlink:
			en.Target = c.target
		case manifest.TypeDir:
			ref := c.tree.get()
			en.Tree = &ref
		}
		full.Entries = append(full.Entries, en)
	}
	n.key = manifest.TreeKey(&full, func(i int) segments.ID { return n.children[i].key })
	if r.adopt(n) {
		return
	}
	// What is stored: a file with a chunk list does not repeat its chunks.
	for i := range full.Entries {
		if full.Entries[i].Chunks != nil {
			full.Entries[i].Content = nil
		}
	}
	b, err := manifest.EncodeTree(full)
	if err != nil {
		// Every field came from a validated scan; this is a bug, not input.
		panic(fmt.Sprintf("encode tree %q: %v", n.rel, err))
	}
	n.tree = r.blob(segments.Sum(b), b, r.trees)
}

// packList packs c's chunk list: one leaf, or leaves of PageChunks and an
// index of them. Pages are content-addressed, so after an append only the
// last page (and the index) is new.
func (r *checkpointRun) packList(c *node) {
	refs := make([]segments.Ref, len(c.content))
	for i, l := range c.content {
		refs[i] = l.get()
	}
	leaf := func(part []segments.Ref) lazyRef {
		b, err := manifest.EncodeChunkList(part)
		if err != nil {
			panic(fmt.Sprintf("encode chunk list of %q: %v", c.rel, err))
		}
		return r.blob(segments.Sum(b), b, r.trees)
	}
	if len(refs) <= manifest.PageChunks {
		l := leaf(refs)
		c.list = &l
		return
	}
	c.pages = c.pages[:0]
	for i := 0; i < len(refs); i += manifest.PageChunks {
		c.pages = append(c.pages, leaf(refs[i:min(i+manifest.PageChunks, len(refs))]))
	}
	// Page references are taken right before the index is packed.
	prefs := make([]segments.Ref, len(c.pages))
	for i, p := range c.pages {
		prefs[i] = p.get()
	}
	b, err := manifest.EncodeChunkIndex(prefs)
	if err != nil {
		panic(fmt.Sprintf("encode chunk index of %q: %v", c.rel, err))
	}
	l := r.blob(segments.Sum(b), b, r.trees)
	c.list = &l
}

// adoptList makes c keep the stored chunk list of an unchanged file.
func (c *node) adoptList(old fileState) {
	c.list, c.pages = nil, nil
	if old.Chunks != nil {
		c.list = &lazyRef{ref: *old.Chunks}
	}
	for _, p := range old.Pages {
		c.pages = append(c.pages, lazyRef{ref: p})
	}
}

// adopt reuses the stored tree of an unchanged directory, if the index has
// it consistently for every child.
func (r *checkpointRun) adopt(n *node) bool {
	old, ok := r.ix.Dirs[n.rel]
	if !ok || old.Key != n.key || old.Tree.Segment.IsZero() {
		return false
	}
	olds := make([]*fileState, len(n.children))
	for i, c := range n.children {
		switch c.typ {
		case manifest.TypeFile:
			f, ok := r.ix.Files[c.rel]
			if !ok || !sameIDs(f.Content, blobIDs(c.content)) || (f.Chunks != nil) != (len(c.content) > manifest.InlineChunks) {
				return false
			}
			olds[i] = &f
		case manifest.TypeDir:
			d, ok := r.ix.Dirs[c.rel]
			if !ok || d.Tree != c.tree.get() {
				return false
			}
		}
	}
	for i, c := range n.children {
		if olds[i] == nil {
			continue
		}
		c.content = c.content[:0]
		for _, ref := range olds[i].Content {
			c.content = append(c.content, lazyRef{ref: ref})
		}
		c.adoptList(*olds[i])
	}
	n.tree = lazyRef{ref: old.Tree}
	return true
}

func blobIDs(l []lazyRef) []segments.ID {
	ids := make([]segments.ID, len(l))
	for i := range l {
		ids[i] = l[i].get().Blob
	}
	return ids
}

// collect flattens the scanned tree into the next index and the manifest's
// segment list and totals; every reference is final by now.
func (r *checkpointRun) collect(root *node) (map[string]fileState, map[string]dirState, []segments.ID, manifest.Totals) {
	files := map[string]fileState{}
	dirs := map[string]dirState{}
	segSet := map[segments.ID]struct{}{}
	var tot manifest.Totals
	var rec func(n *node)
	rec = func(n *node) {
		tr := n.tree.get()
		dirs[n.rel] = dirState{Tree: tr, Key: n.key}
		segSet[tr.Segment] = struct{}{}
		for _, c := range n.children {
			live := int64(1)
			if c.deleted != 0 {
				live = 0 // a tombstone: kept, not counted
				if c.typ != manifest.TypeDir {
					r.res.Tombstones++
				}
			}
			switch c.typ {
			case manifest.TypeDir:
				tot.Dirs += live
				rec(c)
			case manifest.TypeSymlink:
				tot.Symlinks += live
				files[c.rel] = c.state
			case manifest.TypeFile:
				tot.Files += live
				tot.Bytes += live * c.size
				st := c.state
				st.Content = make([]segments.Ref, len(c.content))
				for i, l := range c.content {
					st.Content[i] = l.get()
					segSet[st.Content[i].Segment] = struct{}{}
				}
				st.Chunks, st.Pages = nil, nil
				if c.list != nil {
					lr := c.list.get()
					st.Chunks = &lr
					segSet[lr.Segment] = struct{}{}
				}
				for _, p := range c.pages {
					pr := p.get()
					st.Pages = append(st.Pages, pr)
					segSet[pr.Segment] = struct{}{}
				}
				files[c.rel] = st
			}
		}
	}
	rec(root)
	segs := make([]segments.ID, 0, len(segSet))
	for s := range segSet {
		segs = append(segs, s)
	}
	return files, dirs, manifest.SortSegments(segs), tot
}
