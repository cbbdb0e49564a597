package gc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/store"
)

// ForgetOptions configure Forget.
type ForgetOptions struct {
	Lineage string
	Policy  Policy
	// Apply writes the retired manifests into a tombstone; without it,
	// Forget only reports and writes nothing.
	Apply  bool
	Owner  string // written into the tombstone (default NewOwner())
	Batch  int    // keys per tombstone (default DefaultBatch)
	Logger *slog.Logger
	// Now is the clock of a preview (default time.Now). Apply reads the
	// store's clock instead, with a probe object it deletes again.
	Now func() time.Time
}

// ForgetDecision is one manifest's fate under the policy.
type ForgetDecision struct {
	Decision
	// Marked: already in a forget tombstone, so the first GC sweep after
	// the grace period deletes it unless it is the newest of the lineage.
	Marked bool `json:"marked,omitempty"`
}

// ForgetReport is what Forget decided and did.
type ForgetReport struct {
	Lineage   string    `json:"lineage"`
	Applied   bool      `json:"applied"`
	StoreTime time.Time `json:"store_time"`
	Clock     string    `json:"clock"`
	Policy    Policy    `json:"policy"`
	// Decisions, newest first.
	Decisions []ForgetDecision `json:"decisions"`
	Retained  int              `json:"retained"`
	Retired   int              `json:"retired"`
	// Marked is how many retired manifests this call wrote into
	// tombstones (with Apply) or would write (without).
	Marked     int      `json:"marked"`
	Tombstones []string `json:"tombstones,omitempty"`
	Requests   Requests `json:"requests"`
}

// Forget applies a retention policy to one lineage: it reports which
// manifests the policy keeps and retires and, with Apply, writes the
// retired ones (those not already marked) into a manifest tombstone. It
// deletes nothing: the next GC sweep after the grace period deletes the
// manifests, and the mark after that the segments only they needed.
func Forget(ctx context.Context, st store.Store, opts ForgetOptions) (*ForgetReport, error) {
	if err := manifest.ValidLineage(opts.Lineage); err != nil {
		return nil, err
	}
	if err := opts.Policy.Validate(); err != nil {
		return nil, err
	}
	if opts.Owner == "" {
		opts.Owner = NewOwner()
	}
	if opts.Batch <= 0 {
		opts.Batch = DefaultBatch
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	c := store.NewCounting(st)
	rep := &ForgetReport{Lineage: opts.Lineage, Policy: opts.Policy}
	defer func() { rep.Requests = requestsOf(c.Stats()) }()

	marked, err := markedManifests(ctx, c, manifest.Prefix(opts.Lineage), opts.Logger)
	if err != nil {
		return rep, err
	}
	var items []Item
	infos := map[uint64]store.ObjectInfo{}
	for obj, err := range c.List(ctx, manifest.Prefix(opts.Lineage)) {
		if err != nil {
			return rep, fmt.Errorf("list manifests of %q: %w", opts.Lineage, err)
		}
		seq, ok := manifest.ParseKey(opts.Lineage, obj.Key)
		if !ok || manifest.Key(opts.Lineage, seq) != obj.Key {
			continue
		}
		items = append(items, Item{Seq: seq, Time: obj.LastModified})
		infos[seq] = obj
	}
	if len(items) == 0 {
		return rep, fmt.Errorf("forget: lineage %q has no checkpoint", opts.Lineage)
	}

	now, clock := opts.Now(), "local"
	if opts.Apply {
		if now, err = probeClock(ctx, c); err != nil {
			return rep, fmt.Errorf("forget: read the store's clock: %w", err)
		}
		clock = "store"
	}
	rep.StoreTime, rep.Clock = now, clock

	var entries []Entry
	for _, d := range Retain(items, opts.Policy, now) {
		o := infos[d.Seq]
		_, isMarked := marked[o.Key]
		rep.Decisions = append(rep.Decisions, ForgetDecision{Decision: d, Marked: isMarked})
		if d.Keep {
			rep.Retained++
			continue
		}
		rep.Retired++
		if !isMarked {
			entries = append(entries, Entry{Key: o.Key, Size: o.Size, Modified: o.LastModified})
		}
	}
	rep.Marked = len(entries)
	if !opts.Apply {
		return rep, nil
	}
	rep.Applied = true
	for len(entries) > 0 {
		n := min(len(entries), opts.Batch)
		key, err := writeTombstone(ctx, c, now, tombHeader{Kind: KindManifests, By: ByForget, Owner: opts.Owner}, entries[:n], false)
		if err != nil {
			return rep, err
		}
		rep.Tombstones = append(rep.Tombstones, key)
		entries = entries[n:]
	}
	return rep, nil
}

// markedManifests returns the manifest keys under prefix that readable
// forget tombstones list.
func markedManifests(ctx context.Context, st store.Store, prefix string, log *slog.Logger) (map[string]struct{}, error) {
	out := map[string]struct{}{}
	for obj, err := range st.List(ctx, TombstonePrefix) {
		if err != nil {
			return nil, fmt.Errorf("list tombstones: %w", err)
		}
		tk, ok := parseTombstoneKey(obj.Key)
		if !ok || tk.By != ByForget {
			continue // GC's own marks are re-checked against its policy; only forget's force
		}
		rc, err := st.Get(ctx, obj.Key, 0, -1)
		if errors.Is(err, store.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read tombstone %s: %w", obj.Key, err)
		}
		t, err := readTombstone(rc, tk.By, tk.Kind)
		rc.Close()
		if err != nil {
			log.Warn("ignoring an unreadable tombstone", "key", obj.Key, "err", err)
			continue
		}
		for _, e := range t.entries {
			if len(e.Key) > len(prefix) && e.Key[:len(prefix)] == prefix {
				out[e.Key] = struct{}{}
			}
		}
	}
	return out, nil
}
