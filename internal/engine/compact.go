package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"path"
	"slices"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

// Compaction keeps what a restore costs bounded as a lineage ages. Every
// checkpoint that changes something seals small segments (a few appended
// transcript lines, a changed page, the trees above them), and as files
// change, older segments hold fewer live blobs. Left alone, the newest
// manifest would list a segment per change and a restore would make a
// request per segment.
//
// The writer compacts, at the start of a checkpoint, because it is the one
// process allowed to commit to its lineage: a GC committing into a live
// lineage would race the writer's next sequence number. A segment is a
// candidate when its live bytes (what the tree still references) are under
// half the segment size: that covers both a small segment and a big one
// that is mostly dead. Candidates fall into size tiers by live bytes, each
// tier four times the one below (under 64 KiB, 256 KiB, 1 MiB, 4 MiB, half
// a segment). When a tier holds enough candidates (16 in the lowest, which
// every checkpoint feeds, 4 above), that tier and those below are merged:
// their live data blobs are copied (verified, by blob id) into fresh
// segments, and every tree and chunk list is encoded again so it points at
// the copies. The checkpoint then commits as usual, and the old segments die
// through GC's mark and sweep once no retained manifest lists them.
//
// Tiers keep the copying proportional to what changes: a merged segment
// lands a tier higher and is copied again only when that tier fills, so a
// byte is copied about once per tier before it rests in a segment at least
// half live, rather than at every compaction.
//
// Bound: every segment that is not a candidate is at least half live, so
// the newest manifest lists at most 2 * live bytes / segment size of them,
// plus fewer than 15 + 3 * 4 candidates, plus what one checkpoint adds.
const (
	compactMinSegments  = 16 // candidates in the lowest tier that trigger a merge
	compactTierSegments = 4  // candidates in a higher tier that trigger a merge
	compactTierBase     = 64 << 10
	// compactMaxFactor bounds one compaction to this many segment sizes of
	// live bytes copied; the smallest candidates go first, so the count
	// still drops while an old, big backlog is worked off over checkpoints.
	compactMaxFactor = 4
)

// tier is a candidate's size tier by its live bytes.
func tier(live int64) int {
	t := 0
	for b := int64(compactTierBase); live >= b && t < 4; b *= 4 {
		t++
	}
	return t
}

// segUse is what the index references in one segment.
type segUse struct {
	kind  segments.Kind
	live  int64
	blobs map[segments.ID]segments.Ref
}

// segmentUse groups every blob the index references by segment.
func (ix *index) segmentUse() map[segments.ID]*segUse {
	use := map[segments.ID]*segUse{}
	add := func(r segments.Ref, kind segments.Kind) {
		u := use[r.Segment]
		if u == nil {
			u = &segUse{kind: kind, blobs: map[segments.ID]segments.Ref{}}
			use[r.Segment] = u
		}
		if _, ok := u.blobs[r.Blob]; !ok {
			u.blobs[r.Blob] = r
			u.live += r.Length
		}
	}
	for _, f := range ix.Files {
		kind := segments.KindData
		if f.Format == manifest.FormatLines {
			kind = segments.KindLines
		}
		for _, r := range f.Content {
			add(r, kind)
		}
		if f.Chunks != nil {
			add(*f.Chunks, segments.KindTree)
		}
		for _, p := range f.Pages {
			add(p, segments.KindTree)
		}
	}
	for _, d := range ix.Dirs {
		add(d.Tree, segments.KindTree)
	}
	return use
}

// compact copies the live blobs of the index's candidate segments into
// fresh ones and points the index at the copies; see the comment above.
// It does nothing (and no request) unless enough candidates accumulated.
// A candidate that cannot be read intact is not copied: the files that
// reference it are dropped from the index, so this checkpoint reads them
// again and uploads them anew from the local tree.
func (r *checkpointRun) compact(segSize int64) error {
	ix := r.ix
	if ix.Seq == 0 || ix.Base != ix.Seq || r.e.compactAt < 0 {
		return nil
	}
	use := ix.segmentUse()
	var all []segments.ID
	var perTier [5]int
	for seg, u := range use {
		if u.live < segSize/2 {
			all = append(all, seg)
			perTier[tier(u.live)]++
		}
	}
	top := -1
	for t, n := range perTier {
		if (t == 0 && n >= r.e.compactAt) || (t > 0 && n >= compactTierSegments) {
			top = t
		}
	}
	if top < 0 {
		return nil
	}
	var cands []segments.ID
	for _, seg := range all {
		if tier(use[seg].live) <= top {
			cands = append(cands, seg)
		}
	}
	slices.SortFunc(cands, func(a, b segments.ID) int {
		return cmp.Or(cmp.Compare(use[a].live, use[b].live), cmp.Compare(a.String(), b.String()))
	})
	budget := compactMaxFactor * segSize
	retired := map[segments.ID]bool{}
	moved := map[segments.ID]*segments.Pending{}
	broken := map[segments.ID]bool{}
	var copied int64
	for _, seg := range cands {
		u := use[seg]
		if u.kind != segments.KindTree && copied > 0 && copied+u.live > budget {
			continue
		}
		retired[seg] = true
		if u.kind == segments.KindTree {
			continue // trees and chunk lists are encoded again below
		}
		p := r.data
		if u.kind == segments.KindLines {
			p = r.lines
		}
		refs := make([]segments.Ref, 0, len(u.blobs))
		for _, ref := range u.blobs {
			refs = append(refs, ref)
		}
		err := r.e.codec.ReadBlobs(r.ctx, r.e.st, seg, refs, func(ref segments.Ref, plain []byte) error {
			_, rec := r.e.codec.Encode(plain)
			moved[ref.Blob] = p.Add(r.ctx, ref.Blob, rec, ref.Size)
			return nil
		})
		if err != nil {
			if r.ctx.Err() != nil || !isCandidateError(err) {
				return fmt.Errorf("compact segment %s: %w", seg, err)
			}
			r.e.log.Warn("segment unreadable while compacting; its files are read and uploaded again",
				"lineage", r.opts.Lineage, "segment", seg, "err", err)
			broken[seg] = true
			for id := range u.blobs {
				delete(moved, id)
			}
			continue
		}
		copied += u.live
	}
	// Seal the copies now: the index takes their final references, and
	// what this checkpoint adds goes into segments of its own.
	r.data.Flush(r.ctx)
	r.lines.Flush(r.ctx)

	for rel, f := range ix.Files {
		drop, changed := false, false
		for i, ref := range f.Content {
			if broken[ref.Segment] {
				drop = true
				break
			}
			if pd, ok := moved[ref.Blob]; ok && retired[ref.Segment] {
				f.Content[i], _ = pd.Ref()
				changed = true
			}
		}
		if drop {
			delete(ix.Files, rel)
			continue
		}
		inRetired := f.Chunks != nil && retired[f.Chunks.Segment]
		for _, p := range f.Pages {
			inRetired = inRetired || retired[p.Segment]
		}
		if changed || inRetired {
			f.Chunks, f.Pages = nil, nil
		}
		ix.Files[rel] = f
	}
	// Every tree is encoded again: a tree holds its children's references,
	// so one moved blob changes every tree above it.
	ix.Dirs = map[string]dirState{}
	r.res.SegmentsCompacted = len(retired)
	r.res.BytesCompacted = copied
	r.e.log.Info("compacting segments", "lineage", r.opts.Lineage,
		"segments", len(retired), "bytes_copied", copied, "tier", top)
	return nil
}

// CompactorWriter is the writer name of manifests CompactStored commits.
const CompactorWriter = "gc-compaction"

// CompactStored compacts the lineage's checkpoint seq from the store
// alone, for a lineage whose writer is gone (GC calls it for lineages idle
// longer than its window): the same tree is re-packed by the rule above
// and committed as seq+1 with Compacts set, through the normal create-only
// commit. It does nothing (Committed false) if seq is no longer the newest,
// if too few segments are candidates, or if a writer committed first; a
// writer that meets the compaction rebases onto it (see commit).
func (e *Engine) CompactStored(ctx context.Context, lineage string, seq uint64) (*CheckpointResult, error) {
	start := time.Now()
	before := e.st.Stats().Requests()
	res := &CheckpointResult{Lineage: lineage, Seq: seq}
	defer func() { res.Requests, res.Duration = e.st.Stats().Requests()-before, time.Since(start) }()
	seqs, err := manifest.Sequences(ctx, e.st, lineage)
	if err != nil || len(seqs) == 0 || seqs[0] != seq {
		return res, err // a writer committed since: it compacts itself
	}
	m, err := manifest.Load(ctx, e.st, lineage, seq)
	if err != nil {
		return res, fmt.Errorf("compact %q seq %d: %w", lineage, seq, err)
	}
	if e.compactAt < 0 || len(m.Segments) < e.compactAt {
		return res, nil // cannot reach the trigger: no tree walk
	}
	cfg, err := e.config(ctx, false)
	if err != nil {
		return res, err
	}
	ix := newIndex(e.st.String(), lineage, "")
	ix.Seq, ix.Base, ix.Root = m.Seq, m.Seq, m.Root
	root := &node{typ: manifest.TypeDir}
	nodes := map[string]*node{"": root}
	err = e.walk(ctx, m.Root, func(rel string, en *manifest.Entry) error {
		parent := nodes[path.Dir(rel)]
		if path.Dir(rel) == "." {
			parent = root
		}
		if parent == nil {
			return fmt.Errorf("%w: %q has no parent directory", manifest.ErrInvalid, rel)
		}
		c := &node{name: en.Name, rel: rel, typ: en.Type, mode: en.Mode, mtime: en.MTime,
			target: en.Target, format: en.Format, deleted: en.Deleted}
		switch en.Type {
		case manifest.TypeDir:
			nodes[rel] = c
		default:
			st := storedState(en)
			ix.Files[rel] = st
			c.state = st
		}
		parent.children = append(parent.children, c)
		return nil
	}, func(rel string, ref segments.Ref, key segments.ID) {
		ix.Dirs[rel] = dirState{Tree: ref, Key: key}
	})
	if err != nil {
		return res, fmt.Errorf("compact %q seq %d: read its tree: %w", lineage, seq, err)
	}
	r := e.newRun(ctx, CheckpointOptions{Lineage: lineage}, ix, cfg, start, res)
	if err := r.compact(cfg.SegmentSize); err != nil {
		return res, err
	}
	if res.SegmentsCompacted == 0 {
		return res, r.up.Wait()
	}
	if len(ix.Files) != countFiles(root) {
		// compact dropped the files of an unreadable segment: without the
		// local tree there is nothing to read them from again.
		r.up.Wait()
		return res, fmt.Errorf("compact %q seq %d: a segment is unreadable; run 'agentstate verify'", lineage, seq)
	}
	r.known = ix.known()
	var fill func(n *node)
	fill = func(n *node) {
		for _, c := range n.children {
			switch c.typ {
			case manifest.TypeDir:
				fill(c)
			case manifest.TypeFile:
				st := ix.Files[c.rel]
				c.state = st
				r.reuse(c, st)
			}
		}
	}
	fill(root)
	r.buildTree(root)
	r.trees.Flush(ctx)
	if err := r.up.Wait(); err != nil {
		return res, fmt.Errorf("compact %q seq %d: upload segments (no manifest committed): %w", lineage, seq, err)
	}
	_, _, segs, totals := r.collect(root)
	st := r.up.Stats()
	res.SegmentsUploaded, res.BytesUploaded = int(st.Segments), st.Bytes
	next := &manifest.Manifest{Version: manifest.Version, Lineage: lineage, Seq: m.Seq + 1, Parent: m.Seq,
		Time: e.now().UTC(), Writer: CompactorWriter, Root: root.tree.get(), Totals: totals, Segments: segs,
		Compacts: m.Seq}
	if err := manifest.Commit(ctx, e.st, next); err != nil {
		if errors.Is(err, manifest.ErrConflict) {
			e.log.Info("a writer committed first; not compacting", "lineage", lineage, "seq", next.Seq)
			return res, nil
		}
		return res, fmt.Errorf("compact %q: commit seq %d: %w", lineage, next.Seq, err)
	}
	res.Seq, res.Committed = next.Seq, true
	return res, nil
}

func countFiles(n *node) int {
	k := 0
	for _, c := range n.children {
		if c.typ == manifest.TypeDir {
			k += countFiles(c)
		} else {
			k++
		}
	}
	return k
}
