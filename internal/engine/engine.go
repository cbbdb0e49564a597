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
	// ErrNotRestored: the lineage has checkpoints but this machine never
	// restored it, so its tree must not become the new truth by accident.
	ErrNotRestored = errors.New("lineage not restored on this machine")
	// ErrDatabase: a database could not be captured (it fails quick_check
	// or cannot be opened); the checkpoint kept its previous good copy.
	ErrDatabase = errors.New("database not captured")
)

// Databases captures and checks SQLite databases; package adapters
// implements it with SQLite's online backup API.
type Databases interface {
	// Stamp summarises a database and its -wal from stat alone, so an idle
	// database is recognised without being opened.
	Stamp(path string) (string, error)
	// Snapshot captures the live database at src into dst, an owner-only
	// file, self-contained (no -wal) and passing quick_check.
	Snapshot(ctx context.Context, src, dst string) error
	// Valid reports whether the database at path passes quick_check.
	Valid(ctx context.Context, path string) bool
}

// Options configures an Engine.
type Options struct {
	// StateDir holds the local index, lock and writer id (owner-only).
	StateDir string
	// Parallel bounds concurrent uploads and downloads (default 4).
	Parallel int
	Logger   *slog.Logger
	// Now is the clock used for manifest times (default time.Now).
	Now func() time.Time
	// Databases captures files a checkpoint marks as SQLite; required for
	// CheckpointOptions.SQLite.
	Databases Databases
	// CompactAt is how many segments of the lowest size tier (small or
	// mostly dead) make a checkpoint compact first (default 16, see
	// compact.go); negative disables compaction, which only measurements
	// should want.
	CompactAt int
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
	dbs   Databases
	// compactAt: see Options.CompactAt.
	compactAt int
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
		log: opts.Logger, par: opts.Parallel, now: opts.Now, dbs: opts.Databases,
		compactAt: opts.CompactAt}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	if e.par <= 0 {
		e.par = 4
	}
	if e.now == nil {
		e.now = time.Now
	}
	if e.compactAt == 0 {
		e.compactAt = compactMinSegments
	}
	// Below 4, the segments one compaction itself leaves (data, lines,
	// trees) would trigger the next: every idle checkpoint would commit.
	if e.compactAt > 0 && e.compactAt < 4 {
		e.compactAt = 4
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
func (e *Engine) loadTree(ctx context.Context, g segments.Getter, ref segments.Ref) (manifest.Tree, error) {
	b, err := e.codec.ReadBlob(ctx, g, ref, segments.ID{})
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
			if err := e.loadChunks(ctx, g, en); err != nil {
				return manifest.Tree{}, fmt.Errorf("chunk list of %q in segment %s: %w", en.Name, r.Segment, err)
			}
		}
	}
	return t, nil
}

// loadChunks fills a file entry's Content (and Pages) from its chunk list:
// a leaf, or an index of leaves (one level, never deeper).
func (e *Engine) loadChunks(ctx context.Context, g segments.Getter, en *manifest.Entry) error {
	b, err := e.codec.ReadBlob(ctx, g, *en.Chunks, segments.ID{})
	if err != nil {
		return err
	}
	refs, pages, err := manifest.DecodeChunkList(b)
	if err != nil {
		return err
	}
	for _, p := range pages {
		p = p.Resolve(en.Chunks.Segment)
		pb, err := e.codec.ReadBlob(ctx, g, p, segments.ID{})
		if err != nil {
			return fmt.Errorf("page %s: %w", p.Blob, err)
		}
		leaf, sub, err := manifest.DecodeChunkList(pb)
		if err != nil {
			return fmt.Errorf("page %s: %w", p.Blob, err)
		}
		if len(sub) > 0 {
			return fmt.Errorf("page %s: %w: pages nested deeper than one level", p.Blob, manifest.ErrInvalid)
		}
		refs = append(refs, leaf...)
		en.Pages = append(en.Pages, p)
	}
	en.Content = refs
	return manifest.CheckContent(refs, en.Size)
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
	return e.walkVia(ctx, newTreeCache(e.st, nil), root, fn, onDir)
}

// walkVia is walk reading trees through g.
func (e *Engine) walkVia(ctx context.Context, g segments.Getter, root segments.Ref, fn walkFn, onDir dirFn) error {
	count := 0
	var rec func(prefix string, ref segments.Ref, depth int, deleted bool) (segments.ID, error)
	rec = func(prefix string, ref segments.Ref, depth int, deleted bool) (segments.ID, error) {
		if depth > 512 {
			return segments.ID{}, fmt.Errorf("%w: tree deeper than 512 levels at %q", manifest.ErrInvalid, prefix)
		}
		t, err := e.loadTree(ctx, g, ref)
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
			if deleted && en.Deleted == 0 {
				return segments.ID{}, fmt.Errorf("%w: %q is live inside a deleted directory", manifest.ErrInvalid, rel)
			}
			if err := fn(rel, en); err != nil {
				return segments.ID{}, err
			}
			if en.Type != manifest.TypeDir {
				continue
			}
			if keys[i], err = rec(rel, *en.Tree, depth+1, en.Deleted != 0); err != nil {
				return segments.ID{}, err
			}
		}
		key := manifest.TreeKey(&t, func(i int) segments.ID { return keys[i] })
		if onDir != nil {
			onDir(prefix, ref, key)
		}
		return key, nil
	}
	_, err := rec("", root, 0, false)
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
