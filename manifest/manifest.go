package manifest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// ErrConflict means another writer committed the sequence number this
// checkpoint wanted: one writer per lineage is the rule, and agentstate
// never forks a lineage silently.
var ErrConflict = errors.New("concurrent writer committed first")

// Version is the manifest encoding version.
const Version = 1

// MaxManifestSize bounds what is read for one manifest.
const MaxManifestSize = 64 << 20

// Manifest is one committed checkpoint of a lineage. It is written once,
// create-only, after every object it needs is confirmed in the store.
type Manifest struct {
	Version int    `json:"v"`
	Lineage string `json:"lineage"`
	Seq     uint64 `json:"seq"`
	// Parent is the sequence this checkpoint was built on (0 for the first).
	Parent uint64    `json:"parent"`
	Time   time.Time `json:"time"`
	// Writer identifies the state directory (machine + instance) that
	// committed; a 412 on our own key from our own writer is a retried PUT.
	Writer string       `json:"writer"`
	Root   segments.Ref `json:"root"`
	Totals Totals       `json:"totals"`
	// Segments is every segment the tree needs, sorted: GC keeps exactly
	// these alive, restore checks them first.
	Segments []segments.ID `json:"segments"`
	// Compacts, when set, is the parent's sequence: this manifest holds
	// the same tree as its parent, re-packed into fewer segments by GC for
	// a lineage whose writer was idle. A writer that meets it when
	// committing on that parent commits after it instead (see engine).
	Compacts uint64 `json:"compacts,omitempty"`
}

// Totals summarises the tree for `ls` and status output.
type Totals struct {
	Files    int64 `json:"files"`
	Dirs     int64 `json:"dirs"`
	Symlinks int64 `json:"symlinks"`
	Bytes    int64 `json:"bytes"`
}

var lineageRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidLineage reports whether name can be a lineage: letters, digits,
// '.', '_', '-', starting with a letter or digit, at most 128 bytes.
func ValidLineage(name string) error {
	if !lineageRE.MatchString(name) {
		return fmt.Errorf("lineage %q: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit", name)
	}
	return nil
}

// Validate checks a manifest's internal consistency.
func (m *Manifest) Validate() error {
	switch {
	case m.Version != Version:
		return fmt.Errorf("%w: manifest version %d, want %d", ErrInvalid, m.Version, Version)
	case ValidLineage(m.Lineage) != nil:
		return fmt.Errorf("%w: %v", ErrInvalid, ValidLineage(m.Lineage))
	case m.Seq == 0 || m.Parent >= m.Seq:
		return fmt.Errorf("%w: sequence %d with parent %d", ErrInvalid, m.Seq, m.Parent)
	case m.Root.Segment.IsZero():
		return fmt.Errorf("%w: root reference has no segment", ErrInvalid)
	case validRef(m.Root) != nil:
		return fmt.Errorf("%w: root: %v", ErrInvalid, validRef(m.Root))
	case m.Totals.Files < 0 || m.Totals.Dirs < 0 || m.Totals.Symlinks < 0 || m.Totals.Bytes < 0:
		return fmt.Errorf("%w: negative totals", ErrInvalid)
	case m.Compacts != 0 && m.Compacts != m.Parent:
		return fmt.Errorf("%w: compacts sequence %d, not its parent %d", ErrInvalid, m.Compacts, m.Parent)
	}
	for i := 1; i < len(m.Segments); i++ {
		if bytes.Compare(m.Segments[i-1][:], m.Segments[i][:]) >= 0 {
			return fmt.Errorf("%w: segment list not sorted and unique", ErrInvalid)
		}
	}
	if _, ok := slices.BinarySearchFunc(m.Segments, m.Root.Segment, cmpID); !ok {
		return fmt.Errorf("%w: root segment %s not in the segment list", ErrInvalid, m.Root.Segment)
	}
	return nil
}

// HasSegment reports whether the manifest lists seg.
func (m *Manifest) HasSegment(seg segments.ID) bool {
	_, ok := slices.BinarySearchFunc(m.Segments, seg, cmpID)
	return ok
}

func cmpID(a, b segments.ID) int { return bytes.Compare(a[:], b[:]) }

// SortSegments sorts and de-duplicates ids in place and returns them.
func SortSegments(ids []segments.ID) []segments.ID {
	slices.SortFunc(ids, cmpID)
	return slices.Compact(ids)
}

// The encoding is the JSON body followed by a trailer line holding the
// SHA-256 of the body, so a torn or edited manifest is detected before a
// single field of it is trusted.
const trailerPrefix = "\nsha256:"

// Encode returns the manifest's stored form.
func Encode(m *Manifest) ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("encode manifest: %w", err)
	}
	body, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode manifest: %w", err)
	}
	sum := sha256.Sum256(body)
	out := make([]byte, 0, len(body)+len(trailerPrefix)+65)
	out = append(out, body...)
	out = append(out, trailerPrefix...)
	out = append(out, hex.EncodeToString(sum[:])...)
	return append(out, '\n'), nil
}

// Decode verifies the checksum and parses a stored manifest strictly.
func Decode(b []byte) (*Manifest, error) {
	n := len(trailerPrefix) + 64 + 1
	if len(b) < n || b[len(b)-1] != '\n' || string(b[len(b)-n:len(b)-65]) != trailerPrefix {
		return nil, fmt.Errorf("decode manifest: %w: no checksum trailer", ErrInvalid)
	}
	body := b[:len(b)-n]
	// Compare the exact lowercase hex: the stored form has one spelling.
	if sum := sha256.Sum256(body); hex.EncodeToString(sum[:]) != string(b[len(b)-65:len(b)-1]) {
		return nil, fmt.Errorf("decode manifest: %w: checksum mismatch", ErrInvalid)
	}
	var m Manifest
	if err := strictJSON(body, &m); err != nil {
		return nil, fmt.Errorf("decode manifest: %w", err)
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("decode manifest: %w", err)
	}
	return &m, nil
}

// Prefix is the key prefix of a lineage's manifests.
func Prefix(lineage string) string { return "manifests/" + lineage + "/" }

// Key is the object key of a manifest: manifests/<lineage>/<seq, 20 digits>.
func Key(lineage string, seq uint64) string {
	return fmt.Sprintf("%s%020d", Prefix(lineage), seq)
}

// ParseKey returns the sequence number in a manifest key of lineage.
func ParseKey(lineage, key string) (uint64, bool) {
	s, ok := strings.CutPrefix(key, Prefix(lineage))
	if !ok || len(s) != 20 {
		return 0, false
	}
	seq, err := strconv.ParseUint(s, 10, 64)
	return seq, err == nil && seq > 0
}

// Putter, Getter and Lister are the parts of a store this package uses.
type Putter interface {
	Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts store.PutOptions) (store.ObjectInfo, error)
}

type Getter interface {
	Get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error)
}

type Lister interface {
	List(ctx context.Context, prefix string) iter.Seq2[store.ObjectInfo, error]
}

// ReadWriter is what Commit needs.
type ReadWriter interface {
	Putter
	Getter
}

// Commit writes m create-only at its sequence number. It must be called only
// after every segment m lists is confirmed in the store. If the key exists
// and holds exactly these bytes, this is our own earlier attempt (a PUT
// retried after a lost response): success. Anything else there is another
// writer: ErrConflict, and nothing is written.
func Commit(ctx context.Context, st ReadWriter, m *Manifest) error {
	b, err := Encode(m)
	if err != nil {
		return err
	}
	key := Key(m.Lineage, m.Seq)
	_, err = st.Put(ctx, key, bytes.NewReader(b), int64(len(b)), store.PutOptions{CreateOnly: true})
	if err == nil {
		return nil
	}
	if !errors.Is(err, store.ErrPrecondition) {
		return fmt.Errorf("commit %s: %w", key, err)
	}
	existing, rerr := readAll(ctx, st, key)
	if rerr == nil && bytes.Equal(existing, b) {
		return nil
	}
	who := "another writer"
	if other, derr := Decode(existing); derr == nil {
		who = fmt.Sprintf("writer %q at %s", other.Writer, other.Time.Format(time.RFC3339))
	}
	return fmt.Errorf("commit %s: sequence %d of lineage %q was committed by %s: %w",
		key, m.Seq, m.Lineage, who, ErrConflict)
}

// Load reads and verifies one manifest.
func Load(ctx context.Context, st Getter, lineage string, seq uint64) (*Manifest, error) {
	key := Key(lineage, seq)
	b, err := readAll(ctx, st, key)
	if err != nil {
		return nil, fmt.Errorf("load manifest %s: %w", key, err)
	}
	m, err := Decode(b)
	if err != nil {
		return nil, fmt.Errorf("load manifest %s: %w", key, err)
	}
	if m.Lineage != lineage || m.Seq != seq {
		return nil, fmt.Errorf("load manifest %s: %w: it names lineage %q sequence %d", key, ErrInvalid, m.Lineage, m.Seq)
	}
	return m, nil
}

// Sequences lists the committed sequence numbers of a lineage, newest first.
// The list holds only numbers, so even a long lineage costs little memory.
func Sequences(ctx context.Context, st Lister, lineage string) ([]uint64, error) {
	var seqs []uint64
	for obj, err := range st.List(ctx, Prefix(lineage)) {
		if err != nil {
			return nil, fmt.Errorf("list manifests of %q: %w", lineage, err)
		}
		if seq, ok := ParseKey(lineage, obj.Key); ok {
			seqs = append(seqs, seq)
		}
	}
	slices.Sort(seqs)
	slices.Reverse(seqs)
	return seqs, nil
}

func readAll(ctx context.Context, st Getter, key string) ([]byte, error) {
	rc, err := st.Get(ctx, key, 0, -1)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, MaxManifestSize+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxManifestSize {
		return nil, fmt.Errorf("%w: larger than %d bytes", ErrInvalid, MaxManifestSize)
	}
	return b, nil
}
