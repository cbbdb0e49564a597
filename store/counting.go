package store

import (
	"context"
	"io"
	"iter"
	"sync/atomic"
)

// listPage and deleteBatch (s3.go) are the sizes S3 bills a request for.
const listPage = 1000

// Counting wraps a Store and counts the requests made through it, the way
// S3 bills them, and the bytes moved. It is how the CLI reports "requests
// made" and how tests prove that an idle checkpoint makes none. It is safe
// for concurrent use.
//
// Counts are of calls, not of the backend's retries: a put retried by
// minio-go counts once.
type Counting struct {
	s Store

	puts, gets, stats, lists, deletes atomic.Int64
	bytesUp, bytesDown                atomic.Int64
}

// Stats is a snapshot of a Counting's counters.
type Stats struct {
	Puts    int64 // Put calls
	Gets    int64 // Get calls
	Stats   int64 // Stat calls
	Lists   int64 // listing pages: one per 1000 keys started, at least one per List
	Deletes int64 // delete requests: one per 1000 keys

	BytesUploaded   int64 // sizes of the bodies passed to Put
	BytesDownloaded int64 // bytes read from bodies returned by Get
}

// Requests is the total number of requests.
func (s Stats) Requests() int64 { return s.Puts + s.Gets + s.Stats + s.Lists + s.Deletes }

// Sub returns s - t, the requests made between two snapshots.
func (s Stats) Sub(t Stats) Stats {
	return Stats{
		Puts:            s.Puts - t.Puts,
		Gets:            s.Gets - t.Gets,
		Stats:           s.Stats - t.Stats,
		Lists:           s.Lists - t.Lists,
		Deletes:         s.Deletes - t.Deletes,
		BytesUploaded:   s.BytesUploaded - t.BytesUploaded,
		BytesDownloaded: s.BytesDownloaded - t.BytesDownloaded,
	}
}

// NewCounting returns s with request accounting.
func NewCounting(s Store) *Counting { return &Counting{s: s} }

// Stats returns the counts so far.
func (c *Counting) Stats() Stats {
	return Stats{
		Puts:            c.puts.Load(),
		Gets:            c.gets.Load(),
		Stats:           c.stats.Load(),
		Lists:           c.lists.Load(),
		Deletes:         c.deletes.Load(),
		BytesUploaded:   c.bytesUp.Load(),
		BytesDownloaded: c.bytesDown.Load(),
	}
}

// Unwrap returns the wrapped store.
func (c *Counting) Unwrap() Store { return c.s }

// String names the wrapped store.
func (c *Counting) String() string { return c.s.String() }

// Put implements Store.
func (c *Counting) Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts PutOptions) (ObjectInfo, error) {
	c.puts.Add(1)
	c.bytesUp.Add(size)
	return c.s.Put(ctx, key, body, size, opts)
}

// Get implements Store.
func (c *Counting) Get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	c.gets.Add(1)
	rc, err := c.s.Get(ctx, key, offset, length)
	if err != nil {
		return nil, err
	}
	return &countingReader{rc: rc, n: &c.bytesDown}, nil
}

// Stat implements Store.
func (c *Counting) Stat(ctx context.Context, key string) (ObjectInfo, error) {
	c.stats.Add(1)
	return c.s.Stat(ctx, key)
}

// List implements Store. A page is counted when its first key is pulled,
// so breaking out early does not count pages never fetched.
func (c *Counting) List(ctx context.Context, prefix string) iter.Seq2[ObjectInfo, error] {
	return func(yield func(ObjectInfo, error) bool) {
		c.lists.Add(1)
		n := 0
		for info, err := range c.s.List(ctx, prefix) {
			if err == nil {
				if n > 0 && n%listPage == 0 {
					c.lists.Add(1)
				}
				n++
			}
			if !yield(info, err) {
				return
			}
		}
	}
}

// Delete implements Store.
func (c *Counting) Delete(ctx context.Context, keys []string) error {
	c.deletes.Add(int64((len(keys) + deleteBatch - 1) / deleteBatch))
	return c.s.Delete(ctx, keys)
}

type countingReader struct {
	rc io.ReadCloser
	n  *atomic.Int64
}

func (r *countingReader) Read(p []byte) (int, error) {
	n, err := r.rc.Read(p)
	r.n.Add(int64(n))
	return n, err
}

func (r *countingReader) Close() error { return r.rc.Close() }
