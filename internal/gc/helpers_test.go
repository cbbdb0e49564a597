package gc

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"iter"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// clockStore is a store whose clock the test controls: every object
// written through it gets the virtual time of the write as its
// LastModified (Put, Stat and List report it), and Advance moves the
// virtual clock. Ages of hours pass in no time, and no test sleeps.
type clockStore struct {
	store.Store
	mu  sync.Mutex
	now time.Time
	mod map[string]time.Time

	// beforeDelete, beforeStat and beforeList, if set, run before the
	// corresponding call (with the key, keys or prefix), to inject
	// concurrent writers at exact points of a run.
	beforeDelete func(keys []string)
	beforeStat   func(key string)
	beforeList   func(prefix string)
}

func newClockStore(t testing.TB) *clockStore {
	t.Helper()
	d, err := store.OpenDir(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	return &clockStore{Store: d, now: time.Date(2030, 6, 1, 12, 0, 0, 0, time.UTC), mod: map[string]time.Time{}}
}

func (c *clockStore) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clockStore) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// SetModified backdates (or postdates) one object.
func (c *clockStore) SetModified(key string, t time.Time) {
	c.mu.Lock()
	c.mod[key] = t
	c.mu.Unlock()
}

func (c *clockStore) fix(info store.ObjectInfo) store.ObjectInfo {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.mod[info.Key]; ok {
		info.LastModified = t
	}
	return info
}

func (c *clockStore) Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts store.PutOptions) (store.ObjectInfo, error) {
	// The virtual time is registered before the write, so no reader can
	// see the new object with the file system's (real, years earlier)
	// time; a failed put restores what was there.
	c.mu.Lock()
	prev, had := c.mod[key]
	now := c.now
	c.mod[key] = now
	c.mu.Unlock()
	info, err := c.Store.Put(ctx, key, body, size, opts)
	if err != nil {
		c.mu.Lock()
		if had {
			c.mod[key] = prev
		} else {
			delete(c.mod, key)
		}
		c.mu.Unlock()
		return info, err
	}
	info.LastModified = now
	return info, nil
}

func (c *clockStore) Stat(ctx context.Context, key string) (store.ObjectInfo, error) {
	if c.beforeStat != nil {
		c.beforeStat(key)
	}
	info, err := c.Store.Stat(ctx, key)
	if err != nil {
		return info, err
	}
	return c.fix(info), nil
}

func (c *clockStore) List(ctx context.Context, prefix string) iter.Seq2[store.ObjectInfo, error] {
	if c.beforeList != nil {
		c.beforeList(prefix)
	}
	return func(yield func(store.ObjectInfo, error) bool) {
		for info, err := range c.Store.List(ctx, prefix) {
			if err == nil {
				info = c.fix(info)
			}
			if !yield(info, err) {
				return
			}
		}
	}
}

func (c *clockStore) Delete(ctx context.Context, keys []string) error {
	if c.beforeDelete != nil {
		c.beforeDelete(keys)
	}
	err := c.Store.Delete(ctx, keys)
	c.mu.Lock()
	for _, k := range keys {
		delete(c.mod, k)
	}
	c.mu.Unlock()
	return err
}

// keys lists every key under prefix.
func keys(t testing.TB, st store.Store, prefix string) []string {
	t.Helper()
	var out []string
	for o, err := range st.List(context.Background(), prefix) {
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, o.Key)
	}
	return out
}

// etags lists every key with its ETag and LastModified.
func etags(t testing.TB, st store.Store) map[string]string {
	t.Helper()
	out := map[string]string{}
	for o, err := range st.List(context.Background(), "") {
		if err != nil {
			t.Fatal(err)
		}
		out[o.Key] = o.ETag + "@" + o.LastModified.String()
	}
	return out
}

func exists(t testing.TB, st store.Store, key string) bool {
	t.Helper()
	_, err := st.Stat(context.Background(), key)
	return err == nil
}

// putSegment writes n random bytes as a segment (GC never reads segment
// contents, only their keys) and returns its id.
func putSegment(t testing.TB, st store.Store, n int) segments.ID {
	t.Helper()
	b := make([]byte, n)
	_, _ = rand.Read(b)
	id := segments.Sum(b)
	if _, err := st.Put(context.Background(), segments.Key(id), bytes.NewReader(b), int64(n), store.PutOptions{CreateOnly: true}); err != nil {
		t.Fatal(err)
	}
	return id
}

// commit writes a manifest of lineage at seq listing segs. It is not
// restorable (its root is not a tree), which GC never needs.
func commit(t testing.TB, st store.Store, lineage string, seq uint64, segs ...segments.ID) {
	t.Helper()
	list := manifest.SortSegments(slices.Clone(segs))
	m := &manifest.Manifest{Version: manifest.Version, Lineage: lineage, Seq: seq, Parent: seq - 1,
		Time: time.Now().UTC(), Writer: "test/writer",
		Root:     segments.Ref{Segment: segs[0], Offset: 0, Length: 1, Size: 0},
		Segments: list}
	if err := manifest.Commit(context.Background(), st, m); err != nil {
		t.Fatal(err)
	}
}

func countPrefix(ks []string, prefix string) int {
	n := 0
	for _, k := range ks {
		if strings.HasPrefix(k, prefix) {
			n++
		}
	}
	return n
}

// testOptions is a fast, explicit policy: keep the last 2, no time rules.
func testOptions() Options {
	return Options{Policy: Policy{KeepLast: 2}, Grace: time.Hour, LeaseTTL: time.Minute, Owner: "test/gc"}
}

func mustRun(t testing.TB, st store.Store, opts Options) *Report {
	t.Helper()
	rep, err := Run(context.Background(), st, opts)
	if err != nil {
		t.Fatalf("gc: %v", err)
	}
	return rep
}
