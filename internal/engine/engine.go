// Package engine drives segments and manifest for one directory tree: the
// checkpoint (scan, chunk, pack, upload, commit last), the restore (select,
// verify, stage, place) and verify. The CLI and the run supervisor call it;
// it holds no storage format of its own.
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// Sentinel errors the CLI maps to exit codes.
var (
	// ErrNoValidManifest: the lineage has manifests, but none verifies.
	ErrNoValidManifest = errors.New("no manifest of the lineage verifies")
	// ErrIncomplete: restore could not write every path.
	ErrIncomplete = errors.New("restore incomplete")
	// ErrVerify: verify found a problem in the selected manifest.
	ErrVerify = errors.New("verification failed")
)

// Options configures an Engine.
type Options struct {
	// StateDir holds the local index, lock and writer id (owner-only).
	StateDir string
	// Parallel bounds concurrent uploads and downloads (default 4).
	Parallel int
	Logger   *slog.Logger
	// Now is the clock used for manifest times (default time.Now).
	Now func() time.Time
}

// Engine checkpoints and restores trees into one store.
type Engine struct {
	st    *store.Counting
	codec *segments.Codec
	state *stateDir
	log   *slog.Logger
	par   int
	now   func() time.Time
	cfg   *manifest.Config
}

// New returns an engine on st. It does no I/O against the store.
func New(st store.Store, opts Options) (*Engine, error) {
	codec, err := segments.NewCodec()
	if err != nil {
		return nil, err
	}
	if opts.StateDir == "" {
		return nil, errors.New("engine: a state directory is required")
	}
	state, err := openState(opts.StateDir, st.String())
	if err != nil {
		return nil, err
	}
	e := &Engine{st: store.NewCounting(st), codec: codec, state: state,
		log: opts.Logger, par: opts.Parallel, now: opts.Now}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	if e.par <= 0 {
		e.par = 4
	}
	if e.now == nil {
		e.now = time.Now
	}
	return e, nil
}

// Stats returns the requests this engine has made so far.
func (e *Engine) Stats() store.Stats { return e.st.Stats() }

// config returns the repository config: from the local cache when it has
// one (so an idle checkpoint makes no request), else from the store,
// creating it in a new repository.
func (e *Engine) config(ctx context.Context, create bool) (*manifest.Config, error) {
	if e.cfg != nil {
		return e.cfg, nil
	}
	if c, err := e.state.loadConfig(); err == nil {
		e.cfg = c
		return c, nil
	}
	var c *manifest.Config
	var err error
	if create {
		p := segments.DefaultChunkParams
		var fresh *manifest.Config
		fresh, err = manifest.NewConfig(p.Min, p.Avg, p.Max, segments.DefaultSegmentSize, e.now())
		if err != nil {
			return nil, err
		}
		c, err = manifest.InitConfig(ctx, e.st, fresh)
	} else {
		c, err = manifest.LoadConfig(ctx, e.st)
	}
	if err != nil {
		return nil, err
	}
	if err := e.state.saveConfig(c); err != nil {
		e.log.Warn("cannot cache repository config", "err", err)
	}
	e.cfg = c
	return c, nil
}

func (e *Engine) chunkParams(c *manifest.Config) segments.ChunkParams {
	return segments.ChunkParams{Min: c.ChunkMin, Avg: c.ChunkAvg, Max: c.ChunkMax, Seed: c.ChunkSeed}
}

// loadTree reads and decodes one tree blob, resolving same-segment
// references against the tree's own segment and expanding chunk lists, so
// every file entry it returns has its Content.
func (e *Engine) loadTree(ctx context.Context, ref segments.Ref) (manifest.Tree, error) {
	b, err := e.codec.ReadBlob(ctx, e.st, ref, segments.ID{})
	if err != nil {
		return manifest.Tree{}, err
	}
	t, err := manifest.DecodeTree(b)
	if err != nil {
		return manifest.Tree{}, fmt.Errorf("tree %s in segment %s: %w", ref.Blob, ref.Segment, err)
	}
	for i := range t.Entries {
		en := &t.Entries[i]
		if en.Tree != nil {
			r := en.Tree.Resolve(ref.Segment)
			en.Tree = &r
		}
		if en.Chunks != nil {
			r := en.Chunks.Resolve(ref.Segment)
			en.Chunks = &r
			lb, err := e.codec.ReadBlob(ctx, e.st, r, segments.ID{})
			if err != nil {
				return manifest.Tree{}, fmt.Errorf("chunk list of %q: %w", en.Name, err)
			}
			if en.Content, err = manifest.DecodeChunkList(lb, en.Size); err != nil {
				return manifest.Tree{}, fmt.Errorf("chunk list of %q in segment %s: %w", en.Name, r.Segment, err)
			}
		}
	}
	return t, nil
}

// walkFn is called for every entry of a manifest's tree, parents first.
type walkFn func(rel string, en *manifest.Entry) error

// dirFn is called for every directory, the root ("") included, after its
// children, with its tree reference and its location-free key.
type dirFn func(rel string, ref segments.Ref, key segments.ID)

// maxWalkEntries stops a hostile manifest whose trees share subtrees from
// expanding into an unbounded walk.
const maxWalkEntries = 50_000_000

// walk visits the whole tree under root, depth first, parents first. It
// reads each tree blob once and verifies it; onDir may be nil.
func (e *Engine) walk(ctx context.Context, root segments.Ref, fn walkFn, onDir dirFn) error {
	count := 0
	var rec func(prefix string, ref segments.Ref, depth int) (segments.ID, error)
	rec = func(prefix string, ref segments.Ref, depth int) (segments.ID, error) {
		if depth > 512 {
			return segments.ID{}, fmt.Errorf("%w: tree deeper than 512 levels at %q", manifest.ErrInvalid, prefix)
		}
		t, err := e.loadTree(ctx, ref)
		if err != nil {
			return segments.ID{}, err
		}
		keys := make([]segments.ID, len(t.Entries))
		for i := range t.Entries {
			en := &t.Entries[i]
			count++
			if count > maxWalkEntries {
				return segments.ID{}, fmt.Errorf("%w: more than %d entries", manifest.ErrInvalid, maxWalkEntries)
			}
			rel := en.Name
			if prefix != "" {
				rel = prefix + "/" + en.Name
			}
			if err := fn(rel, en); err != nil {
				return segments.ID{}, err
			}
			if en.Type != manifest.TypeDir {
				continue
			}
			if en.Deleted != 0 {
				keys[i] = en.Tree.Blob // a deleted subtree is opaque
				continue
			}
			if keys[i], err = rec(rel, *en.Tree, depth+1); err != nil {
				return segments.ID{}, err
			}
		}
		key := manifest.TreeKey(&t, func(i int) segments.ID { return keys[i] })
		if onDir != nil {
			onDir(prefix, ref, key)
		}
		return key, nil
	}
	_, err := rec("", root, 0)
	return err
}

// isCandidateError tells a bad checkpoint (corrupt, missing or invalid
// objects: fall back to an older manifest) from a store that cannot be
// reached (stop: the orchestrator should retry, not restore older state).
func isCandidateError(err error) bool {
	return errors.Is(err, segments.ErrCorrupt) || errors.Is(err, store.ErrNotFound) ||
		errors.Is(err, manifest.ErrInvalid) || errors.Is(err, store.ErrInvalidRange)
}

// Init makes sure the repository config exists, creating it in a new
// repository, and returns it.
func (e *Engine) Init(ctx context.Context) (*manifest.Config, error) {
	return e.config(ctx, true)
}
