package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"strings"

	"github.com/agentstate/agentstate/segments"
	"github.com/agentstate/agentstate/store"
)

// treeCacheBytes bounds what one walk keeps of whole tree segments; past
// it, trees are read with one ranged GET each, as without the cache.
const treeCacheBytes = 64 << 20

// treeCache is the Getter a walk reads trees and chunk lists through. The
// first read of a segment fetches it whole, with one GET, and checks its
// SHA-256 against its name; later reads of that segment are served from
// memory. A walk over a compacted lineage then costs a GET per tree
// segment instead of one per directory and chunk-list page, and restore
// knows those segments are intact without reading them again.
type treeCache struct {
	st     segments.Getter
	sizes  map[segments.ID]int64 // known segment sizes, may be nil
	segs   map[string][]byte     // by object key
	tooBig map[string]bool       // read by ranges: past the bound
	bytes  int64
}

// newTreeCache reads through st; sizes, if known (restore and verify stat
// every segment first), keep a segment that would pass the bound from being
// fetched whole at all.
func newTreeCache(st segments.Getter, sizes map[segments.ID]int64) *treeCache {
	return &treeCache{st: st, sizes: sizes, segs: map[string][]byte{}, tooBig: map[string]bool{}}
}

// verified reports whether the cache read seg whole and found it intact.
func (c *treeCache) verified(seg segments.ID) bool {
	_, ok := c.segs[segments.Key(seg)]
	return ok
}

func (c *treeCache) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, error) {
	data, ok := c.segs[key]
	if !ok {
		seg, err := segments.ParseID(key[strings.LastIndexByte(key, '/')+1:])
		if err != nil || c.tooBig[key] || c.bytes >= treeCacheBytes {
			return c.st.Get(ctx, key, off, length)
		}
		if size, known := c.sizes[seg]; known && c.bytes+size > treeCacheBytes {
			c.tooBig[key] = true
			return c.st.Get(ctx, key, off, length)
		}
		body, err := c.st.Get(ctx, key, 0, -1)
		if err != nil {
			return nil, err
		}
		data, err = io.ReadAll(io.LimitReader(body, treeCacheBytes-c.bytes+1))
		body.Close()
		if err != nil {
			return nil, fmt.Errorf("read segment %s: %w", seg, err)
		}
		if c.bytes+int64(len(data)) > treeCacheBytes {
			c.tooBig[key] = true // size unknown until now: never fetched whole again
			return c.st.Get(ctx, key, off, length)
		}
		if segments.ID(sha256.Sum256(data)) != seg {
			return nil, fmt.Errorf("segment %s: content hashes to another id: %w", seg, segments.ErrCorrupt)
		}
		c.segs[key] = data
		c.bytes += int64(len(data))
	}
	if off < 0 || off > int64(len(data)) || (length >= 0 && off+length > int64(len(data))) {
		return nil, fmt.Errorf("%s bytes %d+%d of %d: %w", key, off, length, len(data), store.ErrInvalidRange)
	}
	end := int64(len(data))
	if length >= 0 {
		end = off + length
	}
	return io.NopCloser(bytes.NewReader(data[off:end])), nil
}
