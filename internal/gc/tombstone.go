package gc

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

// TombstonePrefix is where GC marks live.
const TombstonePrefix = "tombstones/"

// TombstoneVersion is the tombstone encoding this build reads and writes. A
// tombstone of another version is left alone.
const TombstoneVersion = 1

// Tombstone kinds: a tombstone holds keys of one kind only.
const (
	KindManifests = "manifests"
	KindSegments  = "segments"
)

// Who wrote a tombstone. GC's own marks are decisions of its policy,
// re-checked against the policy when they are swept; forget's are an
// operator's decision, which retires those manifests whatever GC's policy
// says (but never the newest of a lineage).
const (
	ByGC     = "gc"
	ByForget = "forget"
)

// DefaultBatch is how many keys one tombstone holds at most (about 1.2 MB),
// which is also what bounds the memory a mark or a sweep needs for it.
const DefaultBatch = 10_000

// maxTombstoneSize bounds what is read for one tombstone.
const maxTombstoneSize = 64 << 20

// tombstoneTimeLayout is sortable (fixed width, UTC) and has no ':' so the
// key is friendly to every tool and file system.
const tombstoneTimeLayout = "20060102T150405.000000000Z"

// errTombstone wraps every reason a tombstone cannot be decoded.
var errTombstone = errors.New("invalid tombstone")

// Entry is one key a tombstone marks for deletion, with its size and
// LastModified when it was marked.
type Entry struct {
	Key      string    `json:"key"`
	Size     int64     `json:"size"`
	Modified time.Time `json:"modified"`
}

// tombHeader is the first line of a tombstone.
type tombHeader struct {
	Version int       `json:"v"`
	Kind    string    `json:"kind"`
	By      string    `json:"by"`
	Created time.Time `json:"created"` // store clock (estimated), informational
	Owner   string    `json:"owner"`
	Count   int       `json:"count"`
	Bytes   int64     `json:"bytes"`
	// Listed (segment tombstones) is how many segment keys the mark listed
	// from this tombstone's first entry to its last: what a sweep would
	// page through to check the entries by listing instead of by HEAD.
	Listed int64 `json:"listed,omitempty"`
}

// tombstone is a decoded tombstone.
type tombstone struct {
	header  tombHeader
	entries []Entry
}

// tombKey is a parsed tombstone key,
// tombstones/<time>-<16 hex>.<by>-<kind>. Who wrote it and what it holds
// are in the name, so a run knows from the listing alone which tombstones
// it must read: GC's own only once they are due, forget's every run.
type tombKey struct {
	Key  string
	Time time.Time // from the name; LastModified is what ages it
	By   string
	Kind string
}

// newTombstoneKey names a tombstone written at (estimated store) time t.
func newTombstoneKey(t time.Time, by, kind string) (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("tombstone id: %w", err)
	}
	return TombstonePrefix + t.UTC().Format(tombstoneTimeLayout) + "-" + hex.EncodeToString(b[:]) + "." + by + "-" + kind, nil
}

// parseTombstoneKey recognises the names newTombstoneKey makes.
func parseTombstoneKey(key string) (tombKey, bool) {
	rest, ok := strings.CutPrefix(key, TombstonePrefix)
	if !ok {
		return tombKey{}, false
	}
	// The time has a '.' (fractional seconds), so the suffix is cut from
	// the right.
	dot := strings.LastIndexByte(rest, '.')
	if dot < 0 {
		return tombKey{}, false
	}
	name := rest[:dot]
	by, kind, _ := strings.Cut(rest[dot+1:], "-")
	switch {
	case by == ByGC && (kind == KindManifests || kind == KindSegments):
	case by == ByForget && kind == KindManifests:
	default:
		return tombKey{}, false
	}
	dash := strings.LastIndexByte(name, '-')
	if dash < 0 || len(name)-dash-1 != 16 {
		return tombKey{}, false
	}
	if _, err := hex.DecodeString(name[dash+1:]); err != nil {
		return tombKey{}, false
	}
	t, err := time.Parse(tombstoneTimeLayout, name[:dash])
	if err != nil {
		return tombKey{}, false
	}
	return tombKey{Key: key, Time: t, By: by, Kind: kind}, true
}

// trailerPrefix starts the last line: the SHA-256 of everything before it.
const tombTrailerPrefix = "sha256:"

// encodeTombstone returns the stored form: a header line, one JSON line per
// entry, and a checksum line.
func encodeTombstone(h tombHeader, entries []Entry) ([]byte, error) {
	h.Version = TombstoneVersion
	h.Count = len(entries)
	h.Bytes = 0
	for _, e := range entries {
		h.Bytes += e.Size
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf) // one value per line
	if err := enc.Encode(h); err != nil {
		return nil, err
	}
	for _, e := range entries {
		e.Modified = e.Modified.UTC()
		if err := enc.Encode(e); err != nil {
			return nil, err
		}
	}
	sum := sha256.Sum256(buf.Bytes())
	buf.WriteString(tombTrailerPrefix + hex.EncodeToString(sum[:]) + "\n")
	return buf.Bytes(), nil
}

// decodeTombstone verifies the checksum, then parses. Entries are checked
// later, one by one, against what the sweep may delete; a tombstone is a
// list of candidates, never an authority.
func decodeTombstone(b []byte, by, kind string) (*tombstone, error) {
	body, ok := bytes.CutSuffix(b, []byte("\n"))
	if !ok {
		return nil, fmt.Errorf("%w: no trailer", errTombstone)
	}
	nl := bytes.LastIndexByte(body, '\n')
	if nl < 0 {
		return nil, fmt.Errorf("%w: no trailer", errTombstone)
	}
	content, trailer := body[:nl+1], string(body[nl+1:])
	hexSum, ok := strings.CutPrefix(trailer, tombTrailerPrefix)
	if !ok {
		return nil, fmt.Errorf("%w: no trailer", errTombstone)
	}
	if sum := sha256.Sum256(content); hex.EncodeToString(sum[:]) != hexSum {
		return nil, fmt.Errorf("%w: checksum mismatch", errTombstone)
	}
	sc := bufio.NewScanner(bytes.NewReader(content))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	var t tombstone
	if !sc.Scan() {
		return nil, fmt.Errorf("%w: no header", errTombstone)
	}
	if err := json.Unmarshal(sc.Bytes(), &t.header); err != nil {
		return nil, fmt.Errorf("%w: header: %v", errTombstone, err)
	}
	if t.header.Version != TombstoneVersion {
		return nil, fmt.Errorf("%w: version %d, this agentstate reads %d", errTombstoneVersion, t.header.Version, TombstoneVersion)
	}
	if t.header.Kind != kind || t.header.By != by {
		return nil, fmt.Errorf("%w: holds %s by %s, its name says %s by %s", errTombstone, t.header.Kind, t.header.By, kind, by)
	}
	for sc.Scan() {
		var e Entry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("%w: entry %d: %v", errTombstone, len(t.entries)+1, err)
		}
		t.entries = append(t.entries, e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %v", errTombstone, err)
	}
	if len(t.entries) != t.header.Count {
		return nil, fmt.Errorf("%w: %d entries, header says %d", errTombstone, len(t.entries), t.header.Count)
	}
	return &t, nil
}

// errTombstoneVersion: written by another version; left alone.
var errTombstoneVersion = errors.New("unsupported tombstone version")

// readTombstone reads at most maxTombstoneSize bytes of r.
func readTombstone(r io.Reader, by, kind string) (*tombstone, error) {
	b, err := io.ReadAll(io.LimitReader(r, maxTombstoneSize+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxTombstoneSize {
		return nil, fmt.Errorf("%w: larger than %d bytes", errTombstone, maxTombstoneSize)
	}
	return decodeTombstone(b, by, kind)
}

// parseSegmentKey recognises segments/<xx>/<64 hex> exactly as
// segments.Key writes it. Anything else under segments/ is not ours to
// delete.
func parseSegmentKey(key string) (segments.ID, bool) {
	rest, ok := strings.CutPrefix(key, "segments/")
	if !ok || len(rest) != 3+64 || rest[2] != '/' {
		return segments.ID{}, false
	}
	id, err := segments.ParseID(rest[3:])
	if err != nil || segments.Key(id) != key {
		return segments.ID{}, false
	}
	return id, true
}

// parseManifestKey recognises manifests/<lineage>/<seq, 20 digits> exactly
// as manifest.Key writes it.
func parseManifestKey(key string) (lineage string, seq uint64, ok bool) {
	rest, ok := strings.CutPrefix(key, "manifests/")
	if !ok {
		return "", 0, false
	}
	slash := strings.LastIndexByte(rest, '/')
	if slash < 0 {
		return "", 0, false
	}
	lineage = rest[:slash]
	if manifest.ValidLineage(lineage) != nil {
		return "", 0, false
	}
	seq, ok = manifest.ParseKey(lineage, key)
	if !ok || manifest.Key(lineage, seq) != key {
		return "", 0, false
	}
	return lineage, seq, true
}
