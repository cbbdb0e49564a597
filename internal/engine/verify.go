package engine

import (
	"context"
	"fmt"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

// VerifyResult is what verify checked.
type VerifyResult struct {
	Lineage  string        `json:"lineage"`
	Seq      uint64        `json:"seq"`
	Files    int64         `json:"files"`
	Dirs     int64         `json:"dirs"`
	Blobs    int           `json:"blobs"`
	Bytes    int64         `json:"bytes"`
	Segments int           `json:"segments"`
	Requests int64         `json:"requests"`
	Duration time.Duration `json:"duration_ns"`
}

// Verify downloads and checks everything one manifest needs, writing
// nothing: the manifest checksum, every listed segment, every tree, and
// every content blob (length, xxhash64, SHA-256). seq 0 means the newest.
func (e *Engine) Verify(ctx context.Context, lineage string, seq uint64) (*VerifyResult, error) {
	start := time.Now()
	before := e.st.Stats().Requests()
	res := &VerifyResult{Lineage: lineage}
	defer func() { res.Requests, res.Duration = e.st.Stats().Requests()-before, time.Since(start) }()
	if err := manifest.ValidLineage(lineage); err != nil {
		return nil, err
	}
	if seq == 0 {
		seqs, err := manifest.Sequences(ctx, e.st, lineage)
		if err != nil {
			return res, err
		}
		if len(seqs) == 0 {
			return res, fmt.Errorf("verify %q: the lineage has no checkpoint", lineage)
		}
		seq = seqs[0]
	}
	res.Seq = seq
	m, err := manifest.Load(ctx, e.st, lineage, seq)
	if err != nil {
		return res, fmt.Errorf("verify %q seq %d: %w: %w", lineage, seq, ErrVerify, err)
	}
	res.Segments = len(m.Segments)
	sizes, err := e.checkSegments(ctx, m)
	if err != nil {
		return res, fmt.Errorf("verify %q seq %d: %w: %w", lineage, seq, ErrVerify, err)
	}
	refsOf := map[segments.ID][]segments.Ref{}
	seen := map[segments.ID]bool{}
	var total int64
	live := func(en *manifest.Entry) int64 {
		if en.Deleted != 0 {
			return 0 // a tombstone: checked, not counted
		}
		return 1
	}
	trees := newTreeCache(e.st, sizes)
	err = e.walkVia(ctx, trees, m.Root, func(rel string, en *manifest.Entry) error {
		switch en.Type {
		case manifest.TypeDir:
			res.Dirs += live(en)
			if !m.HasSegment(en.Tree.Segment) {
				return fmt.Errorf("%w: %s: tree in segment %s that the manifest does not list", manifest.ErrInvalid, rel, en.Tree.Segment)
			}
		case manifest.TypeFile:
			res.Files += live(en)
			total += live(en) * en.Size
			if en.Chunks != nil && !m.HasSegment(en.Chunks.Segment) {
				return fmt.Errorf("%w: %s: chunk list in segment %s that the manifest does not list", manifest.ErrInvalid, rel, en.Chunks.Segment)
			}
			for _, p := range en.Pages {
				if !m.HasSegment(p.Segment) {
					return fmt.Errorf("%w: %s: chunk list page in segment %s that the manifest does not list", manifest.ErrInvalid, rel, p.Segment)
				}
			}
			for _, r := range en.Content {
				if !m.HasSegment(r.Segment) {
					return fmt.Errorf("%w: %s: chunk in segment %s that the manifest does not list", manifest.ErrInvalid, rel, r.Segment)
				}
				if !seen[r.Blob] {
					seen[r.Blob] = true
					refsOf[r.Segment] = append(refsOf[r.Segment], r)
				}
			}
		}
		return nil
	}, nil)
	if err != nil {
		return res, fmt.Errorf("verify %q seq %d: %w: %w", lineage, seq, ErrVerify, err)
	}
	res.Bytes = total
	// Every listed segment is read whole: its name is its SHA-256, so this
	// checks every byte, including those no blob of this manifest needs.
	for _, seg := range m.Segments {
		refs := refsOf[seg]
		res.Blobs += len(refs)
		if len(refs) == 0 && trees.verified(seg) {
			continue // a tree segment the walk read whole and checked
		}
		if err := e.codec.ReadSegment(ctx, e.st, seg, sizes[seg], refs, func(segments.Ref, []byte) error { return nil }); err != nil {
			return res, fmt.Errorf("verify %q seq %d: %w: %w", lineage, seq, ErrVerify, err)
		}
	}
	return res, nil
}

// Summary describes one manifest for `ls`.
type Summary struct {
	Seq      uint64          `json:"seq"`
	Parent   uint64          `json:"parent"`
	Time     time.Time       `json:"time"`
	Writer   string          `json:"writer"`
	Totals   manifest.Totals `json:"totals"`
	Segments int             `json:"segments"`
	Error    string          `json:"error,omitempty"`
}

// List summarises the lineage's manifests, newest first. A manifest that
// does not decode is listed with its error rather than hidden.
func (e *Engine) List(ctx context.Context, lineage string) ([]Summary, error) {
	if err := manifest.ValidLineage(lineage); err != nil {
		return nil, err
	}
	seqs, err := manifest.Sequences(ctx, e.st, lineage)
	if err != nil {
		return nil, err
	}
	out := make([]Summary, 0, len(seqs))
	for _, seq := range seqs {
		m, err := manifest.Load(ctx, e.st, lineage, seq)
		if err != nil {
			out = append(out, Summary{Seq: seq, Error: err.Error()})
			continue
		}
		out = append(out, Summary{Seq: m.Seq, Parent: m.Parent, Time: m.Time, Writer: m.Writer,
			Totals: m.Totals, Segments: len(m.Segments)})
	}
	return out, nil
}

// DeletedPath is a deletion tombstone in a checkpoint: a file or symlink
// that left the tree and can still be restored.
type DeletedPath struct {
	Path    string        `json:"path"`
	Type    manifest.Type `json:"type"`
	Size    int64         `json:"size"`
	Deleted time.Time     `json:"deleted"`
}

// Deleted lists the deletion tombstones of the lineage's checkpoint seq
// (0: the newest) and returns the sequence it read.
func (e *Engine) Deleted(ctx context.Context, lineage string, seq uint64) (uint64, []DeletedPath, error) {
	if err := manifest.ValidLineage(lineage); err != nil {
		return 0, nil, err
	}
	if seq == 0 {
		seqs, err := manifest.Sequences(ctx, e.st, lineage)
		if err != nil {
			return 0, nil, err
		}
		if len(seqs) == 0 {
			return 0, nil, nil
		}
		seq = seqs[0]
	}
	m, err := manifest.Load(ctx, e.st, lineage, seq)
	if err != nil {
		return seq, nil, err
	}
	var out []DeletedPath
	err = e.walk(ctx, m.Root, func(rel string, en *manifest.Entry) error {
		if en.Deleted != 0 && en.Type != manifest.TypeDir {
			out = append(out, DeletedPath{Path: rel, Type: en.Type, Size: en.Size, Deleted: time.Unix(0, en.Deleted).UTC()})
		}
		return nil
	}, nil)
	if err != nil {
		return seq, nil, fmt.Errorf("list deleted paths of %q seq %d: %w", lineage, seq, err)
	}
	return seq, out, nil
}
