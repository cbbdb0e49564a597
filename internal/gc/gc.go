package gc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// DefaultGrace is how old a tombstone, and every key it deletes, must be
// on the store's clock. It must be longer than any checkpoint takes from
// its first segment upload to its commit.
const DefaultGrace = time.Hour

// ErrDamaged: a retained manifest cannot be read, so GC cannot know which
// segments it needs, and deletes nothing.
var ErrDamaged = errors.New("a retained manifest is damaged")

// deleteBatch is the most keys one S3 DeleteObjects request takes.
const deleteBatch = 1000

// listFactor decides how the sweep reads the current LastModified of the
// candidates under one segments/<xx>/ prefix: one HEAD each, or a listing
// of the prefix (one request per 1000 keys, stopping after the last
// candidate). A LIST costs 12.5 times a HEAD on AWS, and its pages are
// fetched one after another while HEADs run in parallel, so the sweep lists
// only with at least listFactor candidates per page it expects to read.
const listFactor = 16

// stale clock probes are removed once they are this old.
const staleProbeAge = time.Hour

// Options configure a GC run.
type Options struct {
	// Policy is the retention policy, for every lineage.
	Policy Policy
	// Grace is the minimum age of a tombstone and of every key it deletes
	// (default DefaultGrace).
	Grace time.Duration
	// DryRun writes and deletes nothing, not even the lease, and reports
	// what a run would do.
	DryRun bool
	// LeaseTTL is the lease's lifetime without renewal (default
	// DefaultLeaseTTL).
	LeaseTTL time.Duration
	// Owner names this GC in the lease (default NewOwner()).
	Owner string
	// Parallel bounds concurrent GETs and HEADs (default 8).
	Parallel int
	// Batch is the most keys one tombstone holds (default DefaultBatch).
	Batch  int
	Logger *slog.Logger
	// Now is the clock of a dry run only (default time.Now); a real run
	// always uses the store's clock.
	Now func() time.Time
	// Compactor, if set, compacts lineages whose newest manifest is older
	// than CompactIdle (default DefaultCompactIdle; negative: never): their
	// writer is gone, so it cannot compact them itself, and GC cannot race
	// it for a sequence number.
	Compactor   Compactor
	CompactIdle time.Duration
}

// DefaultCompactIdle is how long a lineage has had no commit before GC
// compacts it.
const DefaultCompactIdle = 24 * time.Hour

// Compactor re-packs a lineage's checkpoint seq from the store alone and
// commits the result as seq+1 (engine.Engine.CompactStored does).
type Compactor interface {
	Compact(ctx context.Context, lineage string, seq uint64) (Compaction, error)
}

// Compaction is what one Compactor call did.
type Compaction struct {
	Committed bool
	Segments  int   // retired into fresh ones
	Bytes     int64 // of live blobs copied
}

func (o Options) withDefaults() (Options, error) {
	if err := o.Policy.Validate(); err != nil {
		return o, err
	}
	if o.Grace == 0 {
		o.Grace = DefaultGrace
	}
	if o.Grace < 0 {
		return o, fmt.Errorf("grace period %s: must be positive", o.Grace)
	}
	if o.LeaseTTL == 0 {
		o.LeaseTTL = DefaultLeaseTTL
	}
	if o.Owner == "" {
		o.Owner = NewOwner()
	}
	if o.Parallel <= 0 {
		o.Parallel = 8
	}
	if o.Batch <= 0 {
		o.Batch = DefaultBatch
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.CompactIdle == 0 {
		o.CompactIdle = DefaultCompactIdle
	}
	return o, nil
}

// Report is what a run did (or, in a dry run, would do) and cost.
type Report struct {
	DryRun    bool          `json:"dry_run"`
	Store     string        `json:"store"`
	StoreTime time.Time     `json:"store_time"`
	Clock     string        `json:"clock"` // "store", or "local" in a dry run
	Policy    Policy        `json:"policy"`
	Grace     time.Duration `json:"grace_ns"`

	// Scan.
	Lineages          int `json:"lineages"`
	Manifests         int `json:"manifests"`
	ManifestsRetained int `json:"manifests_retained"`
	ManifestsRetired  int `json:"manifests_retired"`
	LiveSegments      int `json:"live_segments"`
	// ManifestsDuringRun were committed while the run went on (found by
	// the refreshes before deletes); they are retained.
	ManifestsDuringRun int `json:"manifests_committed_during_run"`

	// Sweep.
	TombstonesDue     int   `json:"tombstones_due"`     // older than the grace period
	TombstonesPending int   `json:"tombstones_pending"` // still in their grace period
	TombstonesSwept   int   `json:"tombstones_swept"`   // deleted after every key in them was handled
	TombstonesInvalid int   `json:"tombstones_invalid"` // unreadable; deleted when due
	ManifestsSwept    int   `json:"manifests_swept"`
	SegmentsSwept     int   `json:"segments_swept"`
	KeysSwept         int   `json:"keys_swept"`
	BytesReclaimed    int64 `json:"bytes_reclaimed"`
	// KeptReferenced were tombstoned but a retained manifest lists them
	// (again); KeptYoung were modified within the grace period (such as a
	// segment uploaded again after an earlier delete); AlreadyGone were
	// not there any more.
	KeptReferenced int `json:"kept_referenced"`
	KeptYoung      int `json:"kept_young"`
	AlreadyGone    int `json:"already_gone"`

	// Mark.
	MarkSkipped       string `json:"mark_skipped,omitempty"`
	ManifestsMarked   int    `json:"manifests_marked"`
	SegmentsMarked    int    `json:"segments_marked"`
	BytesMarked       int64  `json:"bytes_marked"`
	TombstonesWritten int    `json:"tombstones_written"`

	// Compaction of idle lineages (their newest manifest older than
	// CompactIdle): what was committed; the retired segments are marked by
	// a later run, once no retained manifest lists them.
	LineagesCompacted int    `json:"lineages_compacted"`
	SegmentsCompacted int    `json:"segments_compacted"`
	BytesCompacted    int64  `json:"bytes_compacted"`
	CompactFailed     int    `json:"compact_failed,omitempty"`
	CompactSkipped    string `json:"compact_skipped,omitempty"`

	// Unknown counts objects under manifests/, segments/ and tombstones/
	// that are not in agentstate's format: GC never touches them.
	Unknown int `json:"unknown_objects"`

	Requests  Requests  `json:"requests"`
	Durations Durations `json:"durations"`
}

// Requests counts the requests a run made, as S3 bills them.
type Requests struct {
	Total   int64 `json:"total"`
	Puts    int64 `json:"puts"`
	Gets    int64 `json:"gets"`
	Heads   int64 `json:"heads"`
	Lists   int64 `json:"lists"`
	Deletes int64 `json:"deletes"`
}

func requestsOf(s store.Stats) Requests {
	return Requests{Total: s.Requests(), Puts: s.Puts, Gets: s.Gets, Heads: s.Stats, Lists: s.Lists, Deletes: s.Deletes}
}

// Durations of a run's phases.
type Durations struct {
	Total time.Duration `json:"total_ns"`
	Scan  time.Duration `json:"scan_ns"`
	Sweep time.Duration `json:"sweep_ns"`
	Mark  time.Duration `json:"mark_ns"`
}

// run is the state of one GC run.
type run struct {
	st    *store.Counting
	opts  Options
	log   *slog.Logger
	lease *Lease
	// now is the store's clock at the start; every age is measured
	// against it, which can only make objects look younger than they are.
	now time.Time
	rep *Report

	mu   sync.Mutex // guards live and protected during parallel loads
	live map[segments.ID]struct{}
	// protected holds, during the segment sweep, the segments of retired
	// manifests that still exist after the manifest sweep: a manifest that
	// exists stays complete until it is deleted itself, so restore --seq
	// and ls never meet a manifest whose segments are gone.
	protected map[segments.ID]struct{}
	// seen holds every manifest key the run has accounted for: retained
	// (and loaded) or retired. A refresh loads only keys not in it.
	seen map[string]struct{}
	// retired maps each retired manifest to its listing entry.
	retired map[string]store.ObjectInfo
	// forgotten holds the manifests listed by readable forget tombstones,
	// of any age: retired whatever the policy says.
	forgotten map[string]struct{}
	// swept holds the manifests this run deleted.
	swept    map[string]struct{}
	manTombs []*manTomb
	segTombs []store.ObjectInfo
	// youngGCTombs counts GC's tombstones still in their grace period.
	youngGCTombs int
	// wouldDelete (dry run only) remembers, by 8-byte prefix, the segments
	// the sweep would have deleted, so the mark does not count them again.
	wouldDelete map[[8]byte]struct{}
	// newest holds each lineage's newest manifest, for compaction.
	newest []store.ObjectInfo
	// compacts maps a loaded manifest's key to the sequence it compacts
	// (manifest.Manifest.Compacts), when it is a compaction.
	compacts map[string]uint64
	errs     []error
}

type manTomb struct {
	info    store.ObjectInfo
	entries []Entry // nil if invalid
	invalid bool
}

// Run runs one GC (see the package documentation) on st.
func Run(ctx context.Context, st store.Store, opts Options) (rep *Report, err error) {
	opts, err = opts.withDefaults()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	c := store.NewCounting(st)
	r := &run{st: c, opts: opts, log: opts.Logger,
		rep:  &Report{DryRun: opts.DryRun, Store: st.String(), Policy: opts.Policy, Grace: opts.Grace},
		live: map[segments.ID]struct{}{}, seen: map[string]struct{}{},
		retired: map[string]store.ObjectInfo{}, forgotten: map[string]struct{}{},
		swept: map[string]struct{}{}, compacts: map[string]uint64{}}
	rep = r.rep
	defer func() {
		rep.Durations.Total = time.Since(start)
		rep.Requests = requestsOf(c.Stats())
		rep.KeysSwept = rep.ManifestsSwept + rep.SegmentsSwept
	}()

	if opts.DryRun {
		r.now, rep.Clock = opts.Now(), "local"
		r.wouldDelete = map[[8]byte]struct{}{}
	} else {
		lease, lctx, err := AcquireLease(ctx, c, opts.Owner, opts.LeaseTTL, r.log)
		if err != nil {
			return rep, err
		}
		r.lease = lease
		defer func() {
			if rerr := lease.Release(ctx); rerr != nil {
				r.log.Warn("cannot release the GC lease; it expires by itself", "err", rerr)
			}
		}()
		ctx = lctx
		r.now, rep.Clock = lease.StoreTime(), "store"
	}
	rep.StoreTime = r.now

	err = r.do(ctx, start)
	if err != nil && context.Cause(ctx) != nil && !errors.Is(err, context.Cause(ctx)) {
		err = fmt.Errorf("%w (%w)", err, context.Cause(ctx))
	}
	if err == nil && len(r.errs) > 0 {
		err = fmt.Errorf("gc finished with %d errors (what failed is retried by the next run): %w", len(r.errs), errors.Join(r.errs...))
	}
	return rep, err
}

func (r *run) do(ctx context.Context, start time.Time) error {
	if err := r.readTombstones(ctx); err != nil {
		return err
	}
	if err := r.scan(ctx); err != nil {
		return err
	}
	r.rep.Durations.Scan = time.Since(start)

	t := time.Now()
	if err := r.sweepManifests(ctx); err != nil {
		return err
	}
	if len(r.segTombs) > 0 {
		if err := r.protect(ctx); err != nil {
			return err
		}
		if err := r.sweepSegments(ctx); err != nil {
			return err
		}
	}
	r.rep.Durations.Sweep = time.Since(t)

	t = time.Now()
	if err := r.mark(ctx); err != nil {
		return err
	}
	r.rep.Durations.Mark = time.Since(t)
	r.compactIdle(ctx)
	if !r.opts.DryRun {
		r.removeStaleProbes(ctx)
	}
	return nil
}

// compactIdle compacts the lineages whose writer has been idle longer
// than CompactIdle. Compaction is housekeeping: a lineage that cannot be
// compacted (an unreadable segment, which verify reports) is logged and
// counted, and the run does not fail for it; the next run tries again.
func (r *run) compactIdle(ctx context.Context) {
	switch {
	case r.opts.Compactor == nil || r.opts.CompactIdle < 0:
		return
	case r.opts.DryRun:
		r.rep.CompactSkipped = "dry run"
		return
	}
	for _, o := range r.newest {
		if r.now.Sub(o.LastModified) < r.opts.CompactIdle {
			continue
		}
		lineage, seq, _ := parseManifestKey(o.Key)
		c, err := r.opts.Compactor.Compact(ctx, lineage, seq)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			r.rep.CompactFailed++
			r.log.Warn("cannot compact an idle lineage; the next run tries again", "lineage", lineage, "err", err)
			continue
		}
		if c.Committed {
			r.rep.LineagesCompacted++
			r.rep.SegmentsCompacted += c.Segments
			r.rep.BytesCompacted += c.Bytes
			r.log.Info("compacted an idle lineage", "lineage", lineage, "seq", seq+1, "segments", c.Segments)
		}
	}
}

// due reports whether something last modified at lm is older than the
// grace period, with the store's timestamp resolution as slack.
func (r *run) due(lm time.Time) bool {
	return r.now.Sub(lm) >= r.opts.Grace+storeResolution
}

// readTombstones lists tombstones/. GC's own tombstones are read only
// once due (a young one only blocks the next mark); forget's are read every
// run, since they retire manifests.
func (r *run) readTombstones(ctx context.Context) error {
	for obj, err := range r.st.List(ctx, TombstonePrefix) {
		if err != nil {
			return fmt.Errorf("list tombstones: %w", err)
		}
		tk, ok := parseTombstoneKey(obj.Key)
		if !ok {
			r.rep.Unknown++
			continue
		}
		due := r.due(obj.LastModified)
		if due {
			r.rep.TombstonesDue++
		} else {
			r.rep.TombstonesPending++
		}
		switch {
		case tk.By == ByGC && !due:
			r.youngGCTombs++
			continue
		case tk.Kind == KindSegments:
			r.segTombs = append(r.segTombs, obj)
			continue
		}
		t, err := r.getTombstone(ctx, tk)
		switch {
		case errors.Is(err, store.ErrNotFound):
			continue // swept by someone else just now
		case errors.Is(err, errTombstoneVersion):
			r.log.Warn("leaving a tombstone of another agentstate version alone", "key", obj.Key, "err", err)
			r.rep.Unknown++
			continue
		case errors.Is(err, errTombstone):
			r.log.Warn("unreadable tombstone; its marks are ignored", "key", obj.Key, "err", err)
			r.rep.TombstonesInvalid++
			r.manTombs = append(r.manTombs, &manTomb{info: obj, invalid: true})
			continue
		case err != nil:
			return err
		}
		mt := &manTomb{info: obj}
		for _, e := range t.entries {
			if _, _, ok := parseManifestKey(e.Key); ok {
				mt.entries = append(mt.entries, e)
				if tk.By == ByForget {
					r.forgotten[e.Key] = struct{}{}
				}
			}
		}
		r.manTombs = append(r.manTombs, mt)
	}
	return nil
}

func (r *run) getTombstone(ctx context.Context, tk tombKey) (*tombstone, error) {
	rc, err := r.st.Get(ctx, tk.Key, 0, -1)
	if err != nil {
		return nil, fmt.Errorf("read tombstone %s: %w", tk.Key, err)
	}
	defer rc.Close()
	t, err := readTombstone(rc, tk.By, tk.Kind)
	if err != nil {
		return nil, fmt.Errorf("read tombstone %s: %w", tk.Key, err)
	}
	return t, nil
}

// lineageRef names one manifest to load.
type lineageRef struct {
	lineage string
	seq     uint64
}

// scan applies retention to every lineage and loads the retained
// manifests into the live set. The listing is consumed one lineage at a
// time (a lineage's keys are contiguous in byte order).
func (r *run) scan(ctx context.Context) error {
	var retained []lineageRef
	var cur string
	var group []store.ObjectInfo
	flush := func() {
		if len(group) == 0 {
			return
		}
		r.rep.Lineages++
		items := make([]Item, 0, len(group))
		byseq := make(map[uint64]store.ObjectInfo, len(group))
		for _, o := range group {
			_, seq, _ := parseManifestKey(o.Key)
			items = append(items, Item{Seq: seq, Time: o.LastModified})
			byseq[seq] = o
		}
		for i, d := range Retain(items, r.opts.Policy, r.now) {
			o := byseq[d.Seq]
			r.seen[o.Key] = struct{}{}
			_, forced := r.forgotten[o.Key]
			if i == 0 {
				r.newest = append(r.newest, o)
			}
			if i == 0 || (d.Keep && !forced) {
				retained = append(retained, lineageRef{cur, d.Seq})
				continue
			}
			r.retired[o.Key] = o
		}
		group = group[:0]
	}
	for obj, err := range r.st.List(ctx, "manifests/") {
		if err != nil {
			return fmt.Errorf("list manifests: %w", err)
		}
		lineage, _, ok := parseManifestKey(obj.Key)
		if !ok {
			r.rep.Unknown++
			continue
		}
		r.rep.Manifests++
		if lineage != cur {
			flush()
			cur = lineage
		}
		group = append(group, obj)
	}
	flush()
	r.rep.ManifestsRetained = len(retained)
	r.rep.ManifestsRetired = len(r.retired)

	err := forEach(ctx, r.opts.Parallel, retained, func(ctx context.Context, ref lineageRef) error {
		return r.loadLive(ctx, ref)
	})
	if err != nil {
		return err
	}
	// While a GC compaction is a lineage's newest manifest, the writer may
	// still build on the checkpoint it re-packed (its index points there)
	// and commit after it: that parent chain stays retained, whatever the
	// policy says, until the writer commits again.
	for _, o := range r.newest {
		lineage, _, _ := parseManifestKey(o.Key)
		for key := o.Key; r.compacts[key] != 0; {
			seq := r.compacts[key]
			key = manifest.Key(lineage, seq)
			if _, ok := r.retired[key]; !ok {
				continue // retained anyway, and loaded
			}
			delete(r.retired, key)
			r.rep.ManifestsRetired--
			r.rep.ManifestsRetained++
			if err := r.loadLive(ctx, lineageRef{lineage, seq}); err != nil {
				return err
			}
		}
	}
	r.rep.LiveSegments = len(r.live)
	return nil
}

// loadLive adds the segments of one retained manifest to the live set.
func (r *run) loadLive(ctx context.Context, ref lineageRef) error {
	m, err := manifest.Load(ctx, r.st, ref.lineage, ref.seq)
	switch {
	case errors.Is(err, store.ErrNotFound):
		// Deleted since the listing: only another GC deletes manifests,
		// and only retired ones; a manifest that is gone needs nothing.
		r.log.Warn("retained manifest disappeared during the run", "lineage", ref.lineage, "seq", ref.seq)
		return nil
	case errors.Is(err, manifest.ErrInvalid):
		return fmt.Errorf("%w: %w; GC deletes nothing while it cannot tell which segments the manifest needs (restore will fall back past it; inspect it, and remove or replace it by hand)", ErrDamaged, err)
	case err != nil:
		return err
	}
	r.mu.Lock()
	for _, s := range m.Segments {
		r.live[s] = struct{}{}
	}
	if m.Compacts != 0 {
		r.compacts[manifest.Key(ref.lineage, ref.seq)] = m.Compacts
	}
	r.mu.Unlock()
	return nil
}

// protect loads the retired manifests that survived the manifest sweep
// (retired since the last mark, or marked less than a grace period ago)
// into the protected set. It runs only when segment tombstones are due, so
// about once per grace period.
func (r *run) protect(ctx context.Context) error {
	r.protected = map[segments.ID]struct{}{}
	var refs []lineageRef
	for k := range r.retired {
		if _, gone := r.swept[k]; gone {
			continue
		}
		lineage, seq, _ := parseManifestKey(k)
		refs = append(refs, lineageRef{lineage, seq})
	}
	return forEach(ctx, r.opts.Parallel, refs, func(ctx context.Context, ref lineageRef) error {
		m, err := manifest.Load(ctx, r.st, ref.lineage, ref.seq)
		switch {
		case errors.Is(err, store.ErrNotFound):
			return nil
		case errors.Is(err, manifest.ErrInvalid):
			// Retired and unreadable: nothing can restore it, and it is
			// on its way out; it does not stop the sweep.
			r.log.Warn("retired manifest is damaged; it protects nothing", "lineage", ref.lineage, "seq", ref.seq, "err", err)
			return nil
		case err != nil:
			return err
		}
		r.mu.Lock()
		for _, s := range m.Segments {
			r.protected[s] = struct{}{}
		}
		r.mu.Unlock()
		return nil
	})
}

// needed reports whether a surviving manifest lists seg.
func (r *run) needed(seg segments.ID) bool {
	if _, ok := r.live[seg]; ok {
		return true
	}
	_, ok := r.protected[seg]
	return ok
}

// refresh adds the segments of manifests committed since the scan to the
// live set. It runs before every delete request and before the mark, so a
// manifest committed during the run protects what it lists.
func (r *run) refresh(ctx context.Context) error {
	for obj, err := range r.st.List(ctx, "manifests/") {
		if err != nil {
			return fmt.Errorf("list manifests: %w", err)
		}
		if _, ok := r.seen[obj.Key]; ok {
			continue
		}
		lineage, seq, ok := parseManifestKey(obj.Key)
		if !ok {
			continue
		}
		r.seen[obj.Key] = struct{}{}
		if err := r.loadLive(ctx, lineageRef{lineage, seq}); err != nil {
			return err
		}
		r.rep.ManifestsDuringRun++
	}
	r.rep.LiveSegments = len(r.live)
	return nil
}

// mayDelete is checked before every delete request.
func (r *run) mayDelete(ctx context.Context) error {
	if r.opts.DryRun {
		return errors.New("internal error: a dry run tried to delete")
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return r.lease.Valid()
}

// sweepManifests deletes the manifests that due manifest tombstones list
// and that are still retired, then those tombstones.
func (r *run) sweepManifests(ctx context.Context) error {
	for _, mt := range r.manTombs {
		if !r.due(mt.info.LastModified) {
			continue
		}
		var keys []string
		for _, e := range mt.entries {
			o, retired := r.retired[e.Key]
			if _, done := r.swept[e.Key]; done {
				continue // listed by two tombstones
			}
			switch {
			case retired && r.due(o.LastModified):
				keys = append(keys, e.Key)
			case retired:
				r.rep.KeptYoung++
			default:
				if _, ok := r.seen[e.Key]; ok {
					r.rep.KeptReferenced++ // retained now: the newest, or kept by the policy as it is now
				} else {
					r.rep.AlreadyGone++
				}
			}
		}
		ok := true
		for b := range slices.Chunk(keys, deleteBatch) {
			if err := r.deleteKeys(ctx, b); err != nil {
				if ctx.Err() != nil {
					return err
				}
				r.errs = append(r.errs, err)
				ok = false
				break
			}
			for _, k := range b {
				r.rep.BytesReclaimed += r.retired[k].Size
				r.swept[k] = struct{}{}
			}
			r.rep.ManifestsSwept += len(b)
		}
		if ok {
			if err := r.deleteTombstone(ctx, mt.info.Key); err != nil {
				return err
			}
		}
	}
	return nil
}

// deleteKeys deletes keys (at most deleteBatch), or in a dry run only
// pretends to.
func (r *run) deleteKeys(ctx context.Context, keys []string) error {
	if len(keys) == 0 || r.opts.DryRun {
		return nil
	}
	if err := r.mayDelete(ctx); err != nil {
		return err
	}
	return r.st.Delete(ctx, keys)
}

func (r *run) deleteTombstone(ctx context.Context, key string) error {
	if r.opts.DryRun {
		r.rep.TombstonesSwept++
		return nil
	}
	if err := r.mayDelete(ctx); err != nil {
		return err
	}
	if err := r.st.Delete(ctx, []string{key}); err != nil {
		if ctx.Err() != nil {
			return err
		}
		r.errs = append(r.errs, err)
		return nil
	}
	r.rep.TombstonesSwept++
	return nil
}

// sweepSegments handles the due segment tombstones one at a time, so
// memory is bounded by one tombstone.
func (r *run) sweepSegments(ctx context.Context) error {
	for _, info := range r.segTombs {
		if err := r.sweepSegmentTombstone(ctx, info); err != nil {
			return err
		}
	}
	return nil
}

func (r *run) sweepSegmentTombstone(ctx context.Context, info store.ObjectInfo) error {
	tk, _ := parseTombstoneKey(info.Key)
	t, err := r.getTombstone(ctx, tk)
	switch {
	case errors.Is(err, store.ErrNotFound):
		return nil
	case errors.Is(err, errTombstoneVersion):
		r.log.Warn("leaving a tombstone of another agentstate version alone", "key", info.Key, "err", err)
		r.rep.Unknown++
		return nil
	case errors.Is(err, errTombstone):
		r.log.Warn("unreadable tombstone; deleting it (its segments are marked again by the next mark if they are dead)", "key", info.Key, "err", err)
		r.rep.TombstonesInvalid++
		return r.deleteTombstone(ctx, info.Key)
	case err != nil:
		return err
	}
	sw := &segSweep{r: r, pages: listPages(t)}
	// Entries are sorted as the mark wrote them; group consecutive ones by
	// their segments/<xx>/ prefix to check them a prefix at a time.
	var group []Entry
	prefix := ""
	for _, e := range t.entries {
		id, ok := parseSegmentKey(e.Key)
		if !ok {
			continue
		}
		if r.needed(id) {
			r.rep.KeptReferenced++
			continue
		}
		p := e.Key[:len("segments/xx/")]
		if p != prefix && len(group) > 0 {
			if err := sw.check(ctx, prefix, group); err != nil {
				return err
			}
			group = group[:0]
		}
		prefix = p
		group = append(group, e)
	}
	if len(group) > 0 {
		if err := sw.check(ctx, prefix, group); err != nil {
			return err
		}
	}
	if err := sw.flush(ctx); err != nil {
		return err
	}
	if sw.failed {
		return nil // keep the tombstone: the next run retries
	}
	return r.deleteTombstone(ctx, info.Key)
}

// listPages estimates how many listing pages checking one prefix of t by
// listing costs.
func listPages(t *tombstone) int64 {
	prefixes := int64(0)
	last := ""
	for _, e := range t.entries {
		if len(e.Key) > len("segments/xx/") && e.Key[:len("segments/xx/")] != last {
			last = e.Key[:len("segments/xx/")]
			prefixes++
		}
	}
	if prefixes == 0 || t.header.Listed <= 0 {
		return 1
	}
	perPrefix := t.header.Listed / prefixes
	return max(1, (perPrefix+999)/1000)
}

// segSweep batches the deletes of one tombstone.
type segSweep struct {
	r       *run
	pending []store.ObjectInfo
	failed  bool
	// pages estimates the listing pages one prefix of this tombstone
	// costs: the keys the mark listed over the tombstone's span, spread
	// over the prefixes it touches.
	pages int64
}

// check reads the current LastModified of candidates under prefix and
// queues those that are due.
func (s *segSweep) check(ctx context.Context, prefix string, cands []Entry) error {
	r := s.r
	found, gone, err := r.current(ctx, prefix, cands, s.pages)
	if err != nil {
		if ctx.Err() != nil {
			return err
		}
		r.errs = append(r.errs, err)
		s.failed = true
		return nil
	}
	r.rep.AlreadyGone += gone
	for _, o := range found {
		if !r.due(o.LastModified) {
			r.rep.KeptYoung++
			continue
		}
		s.pending = append(s.pending, o)
		if len(s.pending) >= deleteBatch {
			if err := s.flush(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

// flush deletes the queued segments that the refreshed live set still does
// not list.
func (s *segSweep) flush(ctx context.Context) error {
	r := s.r
	if len(s.pending) == 0 {
		return nil
	}
	defer func() { s.pending = s.pending[:0] }()
	if err := r.refresh(ctx); err != nil {
		return err
	}
	keys := make([]string, 0, len(s.pending))
	var n int64
	for _, o := range s.pending {
		id, _ := parseSegmentKey(o.Key)
		if r.needed(id) {
			r.rep.KeptReferenced++
			continue
		}
		keys = append(keys, o.Key)
		n += o.Size
		if r.wouldDelete != nil {
			r.wouldDelete[[8]byte(id[:8])] = struct{}{}
		}
	}
	if err := r.deleteKeys(ctx, keys); err != nil {
		if ctx.Err() != nil {
			return err
		}
		r.errs = append(r.errs, err)
		s.failed = true
		return nil
	}
	r.rep.SegmentsSwept += len(keys)
	r.rep.BytesReclaimed += n
	return nil
}

// current returns the objects among cands that exist now, with their
// current size and LastModified, and how many are gone: by listing prefix
// when there are many candidates under it, else by one HEAD each.
func (r *run) current(ctx context.Context, prefix string, cands []Entry, pages int64) ([]store.ObjectInfo, int, error) {
	if int64(len(cands)) >= listFactor*pages {
		want := make(map[string]bool, len(cands))
		last := ""
		for _, c := range cands {
			want[c.Key] = true
			last = max(last, c.Key)
		}
		var found []store.ObjectInfo
		for obj, err := range r.st.List(ctx, prefix) {
			if err != nil {
				return nil, 0, err
			}
			if obj.Key > last {
				break
			}
			if want[obj.Key] {
				found = append(found, obj)
				delete(want, obj.Key)
			}
		}
		return found, len(want), nil
	}
	var mu sync.Mutex
	var found []store.ObjectInfo
	gone := 0
	err := forEach(ctx, r.opts.Parallel, cands, func(ctx context.Context, c Entry) error {
		o, err := r.st.Stat(ctx, c.Key)
		mu.Lock()
		defer mu.Unlock()
		switch {
		case errors.Is(err, store.ErrNotFound):
			gone++
		case err != nil:
			return err
		default:
			found = append(found, o)
		}
		return nil
	})
	return found, gone, err
}

// mark writes tombstones for the retired manifests (but those forget has
// marked already) and for every segment the live set does not list. It
// waits while GC tombstones are still in their grace period, so nothing is
// marked twice: those are swept first, and what stays dead is marked again
// then.
func (r *run) mark(ctx context.Context) error {
	if r.youngGCTombs > 0 {
		r.rep.MarkSkipped = fmt.Sprintf("GC tombstones still in their grace period: %d (what is dead is marked once those are swept, so nothing is marked twice)", r.youngGCTombs)
		return nil
	}
	if err := r.refresh(ctx); err != nil {
		return err
	}
	w := &tombWriter{r: r, kind: KindManifests}
	var keys []string
	for k := range r.retired {
		_, forgotten := r.forgotten[k]
		_, swept := r.swept[k]
		if !forgotten && !swept {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		o := r.retired[k]
		if err := w.add(ctx, Entry{Key: o.Key, Size: o.Size, Modified: o.LastModified}); err != nil {
			return err
		}
	}
	if err := w.flush(ctx); err != nil {
		return err
	}
	r.rep.ManifestsMarked = w.total

	w = &tombWriter{r: r, kind: KindSegments}
	for obj, err := range r.st.List(ctx, "segments/") {
		if err != nil {
			return fmt.Errorf("list segments: %w", err)
		}
		id, ok := parseSegmentKey(obj.Key)
		if !ok {
			r.rep.Unknown++
			continue
		}
		w.pos++
		if _, live := r.live[id]; live {
			continue
		}
		if r.wouldDelete != nil {
			if _, gone := r.wouldDelete[[8]byte(id[:8])]; gone {
				continue
			}
		}
		if err := w.add(ctx, Entry{Key: obj.Key, Size: obj.Size, Modified: obj.LastModified}); err != nil {
			return err
		}
		r.rep.BytesMarked += obj.Size
	}
	if err := w.flush(ctx); err != nil {
		return err
	}
	r.rep.SegmentsMarked = w.total
	return nil
}

// tombWriter streams entries into tombstones of at most Batch keys.
type tombWriter struct {
	r       *run
	kind    string
	by      string
	entries []Entry
	total   int
	written []string
	// pos counts the keys listed so far; first is pos at the current
	// batch's first entry.
	pos, first int64
}

func (w *tombWriter) add(ctx context.Context, e Entry) error {
	if len(w.entries) == 0 {
		w.first = w.pos
	}
	w.entries = append(w.entries, e)
	w.total++
	if len(w.entries) >= w.r.opts.Batch {
		return w.flush(ctx)
	}
	return nil
}

func (w *tombWriter) flush(ctx context.Context) error {
	if len(w.entries) == 0 {
		return nil
	}
	defer func() { w.entries = w.entries[:0] }()
	by := w.by
	if by == "" {
		by = ByGC
	}
	h := tombHeader{Kind: w.kind, By: by, Owner: w.r.opts.Owner}
	if w.kind == KindSegments {
		h.Listed = w.pos - w.first + 1
	}
	key, err := writeTombstone(ctx, w.r.st, w.r.storeNow(), h, w.entries, w.r.opts.DryRun)
	if err != nil {
		return err
	}
	w.written = append(w.written, key)
	w.r.rep.TombstonesWritten++
	return nil
}

// storeNow estimates the store's clock now, for tombstone names.
func (r *run) storeNow() time.Time {
	if r.lease != nil {
		return r.lease.StoreNow()
	}
	return r.opts.Now()
}

// writeTombstone writes one tombstone create-only and returns its key. In
// a dry run it only names it.
func writeTombstone(ctx context.Context, st store.Store, now time.Time, h tombHeader, entries []Entry, dryRun bool) (string, error) {
	h.Created = now.UTC()
	b, err := encodeTombstone(h, entries)
	if err != nil {
		return "", err
	}
	for attempt := 0; ; attempt++ {
		key, err := newTombstoneKey(now, h.By, h.Kind)
		if err != nil {
			return "", err
		}
		if dryRun {
			return key, nil
		}
		_, err = st.Put(ctx, key, bytes.NewReader(b), int64(len(b)), store.PutOptions{CreateOnly: true})
		if errors.Is(err, store.ErrPrecondition) && attempt < 3 {
			continue // a random id collided (or our own retried PUT landed): a fresh name
		}
		if err != nil {
			return "", fmt.Errorf("write tombstone: %w", err)
		}
		return key, nil
	}
}

// removeStaleProbes deletes clock probes a killed process left behind.
func (r *run) removeStaleProbes(ctx context.Context) {
	var stale []string
	for obj, err := range r.st.List(ctx, clockProbePrefix) {
		if err != nil {
			return
		}
		if isClockProbe(obj.Key) && r.now.Sub(obj.LastModified) > staleProbeAge {
			stale = append(stale, obj.Key)
		}
	}
	if len(stale) > 0 && r.mayDelete(ctx) == nil {
		_ = r.st.Delete(ctx, stale)
	}
}

// forEach runs fn on every item with at most n at a time, and returns the
// first error (which stops the others from starting).
func forEach[T any](ctx context.Context, n int, items []T, fn func(context.Context, T) error) error {
	if len(items) == 0 {
		return nil
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	ch := make(chan T)
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	for range min(n, len(items)) {
		wg.Go(func() {
			for it := range ch {
				if err := fn(ctx, it); err != nil {
					once.Do(func() { first = err; cancel(err) })
				}
			}
		})
	}
feed:
	for _, it := range items {
		select {
		case ch <- it:
		case <-ctx.Done():
			break feed
		}
	}
	close(ch)
	wg.Wait()
	if first == nil {
		return ctx.Err()
	}
	return first
}
