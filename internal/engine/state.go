package engine

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

// The state directory is local and owner-only (0700/0600). Layout:
//
//	<state>/writer-id                          who this checkpointer is
//	<state>/stores/<store hash>/config.json    cached repository config
//	<state>/stores/<store hash>/<lineage>/index.json, lock
//
// Nothing here is authoritative: losing it costs re-reading the tree and
// one LIST plus tree GETs to rebuild the index from the newest manifest.

const indexVersion = 1

// fileState is what the index remembers of one path: enough to tell, from
// an lstat alone, that the file is unchanged, and its content references.
type fileState struct {
	Type    manifest.Type  `json:"t"`
	Mode    uint32         `json:"m"`
	Size    int64          `json:"s"`
	MTime   int64          `json:"mt"`
	CTime   int64          `json:"ct,omitempty"`
	Ino     uint64         `json:"i,omitempty"`
	Dev     uint64         `json:"d,omitempty"`
	Target  string         `json:"l,omitempty"`
	Content []segments.Ref `json:"c,omitempty"`
	// Chunks is the chunk list blob that holds Content in the stored tree,
	// for files of more than manifest.InlineChunks chunks.
	Chunks *segments.Ref  `json:"cl,omitempty"`
	Pages  []segments.Ref `json:"cp,omitempty"`
	// Format is the entry's manifest.Format ("" for a regular file).
	Format string `json:"f,omitempty"`
	// TailHash is the xxhash64 of the last tailLen bytes of an append-only
	// file's shipped prefix (Size in the tree): a cheap check that the
	// writer only appended since.
	TailHash uint64 `json:"th,omitempty"`
	// Stamp is a database's change stamp (Databases.Stamp).
	Stamp string `json:"ds,omitempty"`
	// Shipped is the content length stored (for append-only files, up to
	// the last complete line; Size is the file's stat size).
	Shipped int64 `json:"sh,omitempty"`
	// Racy: modified too close to when it was read for the stat to prove
	// the content unchanged next time; re-read it.
	Racy bool `json:"r,omitempty"`
	// Deleted marks a deletion tombstone: when the path left the tree
	// (Unix ns). Its content stays referenced until the window ends.
	Deleted int64 `json:"del,omitempty"`
}

// storedState is what a stored file or symlink entry tells the index: its
// content and metadata, no stat data.
func storedState(en *manifest.Entry) fileState {
	return fileState{Type: en.Type, Mode: en.Mode, Size: en.Size, MTime: en.MTime, Target: en.Target,
		Content: slices.Clone(en.Content), Chunks: en.Chunks, Pages: en.Pages, Format: en.Format,
		Shipped: en.Size, Deleted: en.Deleted}
}

// dirState remembers each directory's last tree blob, so a directory whose
// listing encodes to the same bytes reuses its reference.
type dirState struct {
	Tree segments.Ref `json:"tree"`
	Key  segments.ID  `json:"key"`
}

type index struct {
	Version int    `json:"version"`
	Store   string `json:"store"`
	Lineage string `json:"lineage"`
	Dir     string `json:"dir"`
	// Seq is the newest sequence committed in the lineage as far as this
	// writer knows; the next checkpoint commits Seq+1.
	Seq uint64 `json:"seq"`
	// Base is the sequence whose tree Files and Dirs describe (differs from
	// Seq after a restore fell back past a bad manifest).
	Base     uint64               `json:"base"`
	Root     segments.Ref         `json:"root"`
	Files    map[string]fileState `json:"files"`
	Dirs     map[string]dirState  `json:"dirs"`
	Restored bool                 `json:"restored,omitempty"`
}

func newIndex(storeID, lineage, dir string) *index {
	return &index{Version: indexVersion, Store: storeID, Lineage: lineage, Dir: dir,
		Files: map[string]fileState{}, Dirs: map[string]dirState{}}
}

// known returns every blob the index's tree references, with where it lives.
func (ix *index) known() map[segments.ID]segments.Ref {
	m := make(map[segments.ID]segments.Ref, len(ix.Files)+len(ix.Dirs))
	for _, f := range ix.Files {
		for _, r := range f.Content {
			m[r.Blob] = r
		}
		if f.Chunks != nil {
			m[f.Chunks.Blob] = *f.Chunks
		}
		for _, p := range f.Pages {
			m[p.Blob] = p
		}
	}
	for _, d := range ix.Dirs {
		m[d.Tree.Blob] = d.Tree
	}
	return m
}

type stateDir struct {
	root     string
	storeDir string
}

func openState(root, storeID string) (*stateDir, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("state directory %s: %w", root, err)
	}
	h := sha256.Sum256([]byte(storeID))
	s := &stateDir{root: abs, storeDir: filepath.Join(abs, "stores", hex.EncodeToString(h[:8]))}
	if err := os.MkdirAll(s.storeDir, 0o700); err != nil {
		return nil, fmt.Errorf("create state directory %s: %w", abs, err)
	}
	// MkdirAll keeps existing modes; the state holds content references and
	// must not be readable by others, so tighten what we own.
	for p := s.storeDir; strings.HasPrefix(p, abs); p = filepath.Dir(p) {
		_ = os.Chmod(p, 0o700)
		if p == abs {
			break
		}
	}
	return s, nil
}

func (s *stateDir) lineageDir(lineage string) (string, error) {
	d := filepath.Join(s.storeDir, lineage)
	if err := os.MkdirAll(d, 0o700); err != nil {
		return "", fmt.Errorf("create state for lineage %q: %w", lineage, err)
	}
	return d, nil
}

// writerID returns this state directory's writer identity, creating it once.
func (s *stateDir) writerID() (string, error) {
	p := filepath.Join(s.root, "writer-id")
	if b, err := os.ReadFile(p); err == nil && len(strings.TrimSpace(string(b))) > 0 {
		return strings.TrimSpace(string(b)), nil
	}
	host, _ := os.Hostname()
	var r [6]byte
	if _, err := rand.Read(r[:]); err != nil {
		return "", fmt.Errorf("create writer id: %w", err)
	}
	id := fmt.Sprintf("%s/%s", host, hex.EncodeToString(r[:]))
	if err := writeFileAtomic(p, []byte(id+"\n")); err != nil {
		return "", fmt.Errorf("create writer id: %w", err)
	}
	return id, nil
}

func (s *stateDir) loadConfig() (*manifest.Config, error) {
	b, err := os.ReadFile(filepath.Join(s.storeDir, "config.json"))
	if err != nil {
		return nil, err
	}
	return manifest.ParseConfig(b)
}

func (s *stateDir) saveConfig(c *manifest.Config) error {
	b, err := manifest.EncodeConfig(c)
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(s.storeDir, "config.json"), b)
}

// loadIndex returns nil, nil when there is no usable index: a lost or
// corrupt index is rebuilt, never fatal.
func (s *stateDir) loadIndex(lineage, storeID string) (*index, error) {
	d, err := s.lineageDir(lineage)
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(d, "index.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read index of %q: %w", lineage, err)
	}
	var ix index
	if err := json.Unmarshal(b, &ix); err != nil || ix.Version != indexVersion ||
		ix.Lineage != lineage || ix.Store != storeID || ix.Files == nil || ix.Dirs == nil {
		return nil, errCorruptIndex
	}
	return &ix, nil
}

var errCorruptIndex = errors.New("local index is corrupt")

// initialized reports whether this machine has restored or checkpointed
// the lineage (see saveIndex).
func (s *stateDir) initialized(lineage string) bool {
	d, err := s.lineageDir(lineage)
	if err != nil {
		return false
	}
	_, err = os.Stat(filepath.Join(d, "initialized"))
	return err == nil
}

func (s *stateDir) saveIndex(ix *index) error {
	d, err := s.lineageDir(ix.Lineage)
	if err != nil {
		return err
	}
	// The marker outlives a lost or corrupt index: it says this machine
	// restored or created the lineage, so the index may be rebuilt.
	if _, err := os.Stat(filepath.Join(d, "initialized")); errors.Is(err, fs.ErrNotExist) {
		if err := writeFileAtomic(filepath.Join(d, "initialized"), []byte(time.Now().UTC().Format(time.RFC3339)+"\n")); err != nil {
			return fmt.Errorf("mark lineage %q initialized: %w", ix.Lineage, err)
		}
	}
	b, err := json.Marshal(ix)
	if err != nil {
		return fmt.Errorf("encode index of %q: %w", ix.Lineage, err)
	}
	if err := writeFileAtomic(filepath.Join(d, "index.json"), b); err != nil {
		return fmt.Errorf("save index of %q: %w", ix.Lineage, err)
	}
	return nil
}

// lock takes the lineage's exclusive file lock, so checkpoints and restores
// of one lineage on this machine never overlap (a timer checkpoint, one
// started by hand, a restore). It waits until ctx is done.
func (s *stateDir) lock(ctx context.Context, lineage string) (unlock func(), err error) {
	d, err := s.lineageDir(lineage)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(d, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock of %q: %w", lineage, err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %q: %w", lineage, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("wait for the lock of %q (another checkpoint or restore holds it): %w", lineage, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// writeFileAtomic writes an owner-only file by temp file, fsync, rename and
// directory fsync, so a crash leaves the old or the new file, never a torn one.
func writeFileAtomic(path string, b []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Status is what an operator looks at first: the last committed checkpoint
// of a lineage on this machine and the last error, kept in the state
// directory so `agentstate status` costs no request.
type Status struct {
	Lineage       string    `json:"lineage"`
	Seq           uint64    `json:"seq"`
	LastCommit    time.Time `json:"last_commit,omitzero"`
	LastAttempt   time.Time `json:"last_attempt,omitzero"`
	LastSuccess   time.Time `json:"last_success,omitzero"`
	Files         int       `json:"files"`
	BytesUploaded int64     `json:"last_bytes_uploaded"`
	LastError     string    `json:"last_error,omitempty"`
}

func (s *stateDir) loadStatus(lineage string) Status {
	st := Status{Lineage: lineage}
	d, err := s.lineageDir(lineage)
	if err != nil {
		return st
	}
	if b, err := os.ReadFile(filepath.Join(d, "status.json")); err == nil {
		_ = json.Unmarshal(b, &st)
	}
	return st
}

func (s *stateDir) saveStatus(st Status) {
	d, err := s.lineageDir(st.Lineage)
	if err != nil {
		return
	}
	if b, err := json.Marshal(st); err == nil {
		_ = writeFileAtomic(filepath.Join(d, "status.json"), b)
	}
}
