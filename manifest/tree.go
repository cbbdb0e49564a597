// Package manifest is agentstate's metadata plane: tree blobs (one per
// directory, deterministically encoded so an unchanged subtree keeps its id
// and is reused without upload), manifests (one committed checkpoint of a
// lineage), the create-only commit protocol, and newest-first selection.
//
// Everything decoded here comes from the bucket and is untrusted: decoders
// are strict (unknown fields, unsorted or duplicate names, names that could
// leave a directory, impossible sizes are all errors) and fuzzed.
package manifest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"

	"github.com/agentstate/agentstate/segments"
)

// ErrInvalid marks a tree or manifest that fails validation. Callers treat
// it like corruption: the manifest that needs it is not complete.
var ErrInvalid = errors.New("invalid metadata")

// Type is an entry's file type.
type Type string

const (
	TypeFile    Type = "f"
	TypeDir     Type = "d"
	TypeSymlink Type = "l"
)

// TreeVersion is the tree encoding version.
const TreeVersion = 1

// Limits that keep a hostile tree from exhausting memory or paths.
const (
	MaxNameLen     = 255
	MaxTargetLen   = 4096
	MaxEntries     = 1 << 20
	maxRefsPerFile = 1 << 22
)

// Entry is one name in a directory.
type Entry struct {
	Name  string `json:"name"`
	Type  Type   `json:"type"`
	Mode  uint32 `json:"mode"`  // permission bits, including setuid/setgid/sticky
	MTime int64  `json:"mtime"` // Unix nanoseconds
	// Files: Size is the content length; Content the chunks in order, or,
	// for a file of more than InlineChunks chunks, Chunks names a chunk
	// list blob holding them, so the directory's tree stays small and an
	// unchanged large file costs nothing when its neighbours change.
	Size    int64          `json:"size,omitempty"`
	Content []segments.Ref `json:"content,omitempty"`
	Chunks  *segments.Ref  `json:"chunks,omitempty"`
	// Pages are the page blobs of a paged chunk list, filled in by the
	// loader (never stored in the tree itself).
	Pages []segments.Ref `json:"-"`
	// Format says how the file was captured: "" a regular file, FormatLines
	// an append-only transcript shipped as complete-line segments,
	// FormatSQLite a database captured with SQLite's online backup API
	// (restore removes stale -wal/-shm beside it and keeps a valid local
	// database on a hot restart).
	Format string `json:"format,omitempty"`
	// Directories: the tree blob that lists it.
	Tree *segments.Ref `json:"tree,omitempty"`
	// Symlinks: the link text, stored as is and never followed.
	Target string `json:"target,omitempty"`
	// Deleted, when non-zero, is when the entry left the live tree (Unix
	// nanoseconds): a deletion tombstone kept for the retention window.
	// Restore skips such entries unless asked. A deleted directory's tree
	// lists what it held, every entry of it deleted too.
	Deleted int64 `json:"deleted,omitempty"`
}

// Tree lists one directory, entries sorted by name (byte order).
type Tree struct {
	Version int     `json:"v"`
	Entries []Entry `json:"entries"`
}

// ValidName reports whether name can be one path component under a restore
// target: not empty, ".", or "..", no '/', no NUL, valid UTF-8, bounded.
func ValidName(name string) error {
	switch {
	case name == "" || name == "." || name == "..":
		return fmt.Errorf("%w: name %q is not a file name", ErrInvalid, name)
	case len(name) > MaxNameLen:
		return fmt.Errorf("%w: name of %d bytes is too long", ErrInvalid, len(name))
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("%w: name %q contains '/' or NUL", ErrInvalid, name)
	case !utf8.ValidString(name):
		return fmt.Errorf("%w: name %q is not valid UTF-8", ErrInvalid, name)
	}
	return nil
}

// Validate checks every invariant a decoded tree must hold.
func (t *Tree) Validate() error {
	if t.Version != TreeVersion {
		return fmt.Errorf("%w: tree version %d, want %d", ErrInvalid, t.Version, TreeVersion)
	}
	if len(t.Entries) > MaxEntries {
		return fmt.Errorf("%w: %d entries", ErrInvalid, len(t.Entries))
	}
	for i := range t.Entries {
		e := &t.Entries[i]
		if err := e.validate(); err != nil {
			return err
		}
		if i > 0 && t.Entries[i-1].Name >= e.Name {
			return fmt.Errorf("%w: names %q, %q not strictly sorted", ErrInvalid, t.Entries[i-1].Name, e.Name)
		}
	}
	return nil
}

func (e *Entry) validate() error {
	if err := ValidName(e.Name); err != nil {
		return err
	}
	if e.Mode&^0o7777 != 0 {
		return fmt.Errorf("%w: %q: mode %o has non-permission bits", ErrInvalid, e.Name, e.Mode)
	}
	if e.Format != "" && (e.Type != TypeFile || (e.Format != FormatLines && e.Format != FormatSQLite)) {
		return fmt.Errorf("%w: %q: format %q", ErrInvalid, e.Name, e.Format)
	}
	if e.Deleted < 0 {
		return fmt.Errorf("%w: %q: negative deletion time", ErrInvalid, e.Name)
	}
	bad := func(what string) error { return fmt.Errorf("%w: %q (%s): %s", ErrInvalid, e.Name, e.Type, what) }
	switch e.Type {
	case TypeFile:
		if e.Tree != nil || e.Target != "" {
			return bad("file with tree or target")
		}
		if e.Chunks != nil {
			if err := validRef(*e.Chunks); err != nil {
				return bad(err.Error())
			}
			if e.Size < 0 {
				return bad("negative size")
			}
			// The listed chunks are checked against Size by DecodeChunkList.
			// A decoded entry may carry both: the list and what it holds.
			return nil
		}
		if err := validContent(e.Content, e.Size); err != nil {
			return bad(err.Error())
		}
	case TypeDir:
		if e.Tree == nil || len(e.Content) != 0 || e.Target != "" || e.Size != 0 {
			return bad("directory needs a tree and nothing else")
		}
		if err := validRef(*e.Tree); err != nil {
			return bad(err.Error())
		}
	case TypeSymlink:
		if e.Target == "" || len(e.Target) > MaxTargetLen || strings.ContainsRune(e.Target, 0) {
			return bad("symlink target empty, too long or with NUL")
		}
		if e.Tree != nil || len(e.Content) != 0 || e.Size != 0 {
			return bad("symlink with content")
		}
	default:
		return fmt.Errorf("%w: %q: unknown type %q", ErrInvalid, e.Name, e.Type)
	}
	return nil
}

func validContent(refs []segments.Ref, size int64) error {
	if len(refs) > maxRefsPerFile {
		return fmt.Errorf("%d chunks are too many", len(refs))
	}
	var sum int64
	for _, r := range refs {
		if err := validRef(r); err != nil {
			return err
		}
		if r.Size > segments.MaxBlobSize {
			return errors.New("chunk larger than a blob can be")
		}
		sum += r.Size
	}
	if sum != size {
		return fmt.Errorf("chunks add up to %d bytes, size says %d", sum, size)
	}
	return nil
}

// Formats of file entries.
const (
	FormatLines  = "lines"
	FormatSQLite = "sqlite"
)

// InlineChunks is how many chunk references a tree entry holds itself; a
// file with more gets a chunk list blob. PageChunks is how many references
// one chunk list blob holds: a longer list becomes an index of pages, so
// appending to a transcript rewrites only its last page, and unchanged
// pages are reused.
const (
	InlineChunks = 16
	PageChunks   = 128
	maxPages     = maxRefsPerFile / PageChunks
)

// ChunkList is the plaintext of a chunk list blob: a leaf (Refs, the
// file's chunks in order) or an index (Pages, leaf lists in order).
type ChunkList struct {
	Version int            `json:"v"`
	Refs    []segments.Ref `json:"refs,omitempty"`
	Pages   []segments.Ref `json:"pages,omitempty"`
}

// EncodeChunkList returns the canonical encoding of a leaf chunk list. The
// references must name their segments (data segments are sealed before any
// metadata is encoded), so a leaf is self-contained.
func EncodeChunkList(refs []segments.Ref) ([]byte, error) {
	if len(refs) == 0 || len(refs) > PageChunks {
		return nil, fmt.Errorf("encode chunk list: %w: %d chunks in one list", ErrInvalid, len(refs))
	}
	for _, r := range refs {
		if r.Segment.IsZero() {
			return nil, fmt.Errorf("encode chunk list: %w: chunk %s has no segment", ErrInvalid, r.Blob)
		}
	}
	return json.Marshal(ChunkList{Version: TreeVersion, Refs: refs})
}

// EncodeChunkIndex returns the canonical encoding of an index of leaf
// lists; a page packed in the same segment may have a zero segment.
func EncodeChunkIndex(pages []segments.Ref) ([]byte, error) {
	if len(pages) == 0 || len(pages) > maxPages {
		return nil, fmt.Errorf("encode chunk index: %w: %d pages", ErrInvalid, len(pages))
	}
	return json.Marshal(ChunkList{Version: TreeVersion, Pages: pages})
}

// DecodeChunkList parses a chunk list blob: exactly one of refs (a leaf)
// and pages (an index) is returned. Check the assembled chunks against the
// file's size with CheckContent.
func DecodeChunkList(b []byte) (refs, pages []segments.Ref, err error) {
	var l ChunkList
	if err := strictJSON(b, &l); err != nil {
		return nil, nil, fmt.Errorf("decode chunk list: %w", err)
	}
	switch {
	case l.Version != TreeVersion:
		return nil, nil, fmt.Errorf("decode chunk list: %w: version %d", ErrInvalid, l.Version)
	case (len(l.Refs) == 0) == (len(l.Pages) == 0):
		return nil, nil, fmt.Errorf("decode chunk list: %w: want either chunks or pages", ErrInvalid)
	case len(l.Refs) > PageChunks || len(l.Pages) > maxPages:
		return nil, nil, fmt.Errorf("decode chunk list: %w: too long", ErrInvalid)
	}
	for _, r := range l.Refs {
		if r.Segment.IsZero() {
			return nil, nil, fmt.Errorf("decode chunk list: %w: chunk %s has no segment", ErrInvalid, r.Blob)
		}
		if err := validRef(r); err != nil {
			return nil, nil, fmt.Errorf("decode chunk list: %w: %v", ErrInvalid, err)
		}
	}
	for _, r := range l.Pages {
		if err := validRef(r); err != nil {
			return nil, nil, fmt.Errorf("decode chunk list: %w: page: %v", ErrInvalid, err)
		}
	}
	return l.Refs, l.Pages, nil
}

// CheckContent validates a file's assembled chunks against its size.
func CheckContent(refs []segments.Ref, size int64) error {
	if err := validContent(refs, size); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return nil
}

func validRef(r segments.Ref) error {
	if r.Offset < 0 || r.Length <= 0 || r.Size < 0 || r.Offset > (1<<40) || r.Length > (1<<31) {
		return fmt.Errorf("reference %s has impossible offset %d / length %d / size %d", r.Blob, r.Offset, r.Length, r.Size)
	}
	return nil
}

// EncodeTree returns the canonical encoding of t. The same tree always
// encodes to the same bytes, so its blob id is stable.
func EncodeTree(t Tree) ([]byte, error) {
	t.Version = TreeVersion
	if t.Entries == nil {
		t.Entries = []Entry{}
	}
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("encode tree: %w", err)
	}
	b, err := json.Marshal(t)
	if err != nil {
		return nil, fmt.Errorf("encode tree: %w", err)
	}
	return b, nil
}

// DecodeTree parses and validates a tree blob's plaintext.
func DecodeTree(b []byte) (Tree, error) {
	var t Tree
	if err := strictJSON(b, &t); err != nil {
		return Tree{}, fmt.Errorf("decode tree: %w", err)
	}
	if err := t.Validate(); err != nil {
		return Tree{}, fmt.Errorf("decode tree: %w", err)
	}
	return t, nil
}

// strictJSON decodes exactly one JSON value with no unknown fields and no
// trailing bytes.
func strictJSON(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return fmt.Errorf("%w: trailing data after JSON value", ErrInvalid)
	}
	return nil
}
