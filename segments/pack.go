package segments

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/agentstate/agentstate/store"
)

// DefaultSegmentSize is the size at which a Packer seals a segment: big
// enough that a checkpoint costs a few PUTs, small enough that a single PUT
// (create-only needs one, never multipart) is quick to retry and that
// `parallel` segments in flight stay a modest amount of memory.
const DefaultSegmentSize = 16 << 20

// Retry policy of an upload. A put is retried on any error except a held
// precondition (which is success) and the caller's context ending.
const (
	uploadAttempts   = 4
	uploadRetryBase  = 200 * time.Millisecond
	uploadRetryLimit = 2 * time.Second
)

// Putter is the part of store.Store that the Uploader needs.
type Putter interface {
	// Put writes the object whole; see store.Store.
	Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts store.PutOptions) (store.ObjectInfo, error)
}

var _ Putter = store.Store(nil)

// UploadStats counts an Uploader's work.
type UploadStats struct {
	Segments int64 // segments now in the store: written, or found there already
	Bytes    int64 // total size of those segments
	Existing int64 // of Segments, how many were there already (412 on create-only)
	Puts     int64 // put requests made, retries included
}

type retryPolicy struct {
	attempts    int
	base, limit time.Duration
}

// Uploader writes sealed segments to the store asynchronously, at most
// `parallel` at a time, each with a create-only put so an existing object
// is never overwritten. It is safe for concurrent use. One Uploader serves
// one checkpoint: the first failure is sticky, and the caller must not
// commit a manifest unless Wait returns nil.
type Uploader struct {
	st    Putter
	log   *slog.Logger
	slots chan struct{}
	retry retryPolicy

	wg  sync.WaitGroup
	mu  sync.Mutex
	err error

	segments, bytes, existing, puts atomic.Int64
}

// NewUploader returns an Uploader writing to st with at most parallel
// uploads in flight (at least 1). A nil log discards.
func NewUploader(st Putter, parallel int, log *slog.Logger) *Uploader {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Uploader{
		st:    st,
		log:   log,
		slots: make(chan struct{}, max(parallel, 1)),
		retry: retryPolicy{attempts: uploadAttempts, base: uploadRetryBase, limit: uploadRetryLimit},
	}
}

// Upload starts writing data, whose SHA-256 is seg, to Key(seg), and
// returns once it is under way. While `parallel` uploads are in flight it
// blocks until one finishes, which bounds the memory held by segments
// waiting to be written. ctx governs the upload itself, not just the wait:
// keep it alive until Wait. data must not be modified until Wait returns.
//
// Upload returns an error, which Wait also returns, if ctx ends while it
// waits for a slot or an earlier upload already failed (there is no point
// writing more of a checkpoint that cannot be committed).
func (u *Uploader) Upload(ctx context.Context, seg ID, data []byte) error {
	if err := u.firstErr(); err != nil {
		return fmt.Errorf("upload segment %s: not started, an earlier upload failed: %w", seg, err)
	}
	if ctx.Err() == nil {
		select {
		case u.slots <- struct{}{}:
			u.wg.Add(1)
			go func() {
				defer u.wg.Done()
				defer func() { <-u.slots }()
				if err := u.put(ctx, seg, data); err != nil {
					u.fail(err)
				}
			}()
			return nil
		case <-ctx.Done():
		}
	}
	err := fmt.Errorf("upload segment %s: waiting for an upload slot: %w", seg, context.Cause(ctx))
	u.fail(err)
	return err
}

// put writes one segment, retrying transient failures with capped,
// jittered exponential backoff.
func (u *Uploader) put(ctx context.Context, seg ID, data []byte) error {
	key, size := Key(seg), int64(len(data))
	where := "the store"
	if s, ok := u.st.(fmt.Stringer); ok {
		where = s.String()
	}
	opts := store.PutOptions{CreateOnly: true}
	existed := false
	for attempt := 1; ; attempt++ {
		u.puts.Add(1)
		_, err := u.st.Put(ctx, key, bytes.NewReader(data), size, opts)
		if errors.Is(err, store.ErrPrecondition) && opts.CreateOnly {
			// The key exists, and a content-addressed key holds exactly
			// these bytes (a single PUT is atomic). But it may be a dead
			// segment that GC has already marked, aged past the grace
			// period: write the same bytes again, unconditionally, so its
			// LastModified is fresh and the grace period protects it until
			// the manifest that needs it is committed.
			existed, opts = true, store.PutOptions{}
			u.existing.Add(1)
			attempt--
			continue
		}
		switch {
		case err == nil:
			u.segments.Add(1)
			u.bytes.Add(size)
			u.log.Debug("segment stored", "segment", seg, "bytes", size, "attempts", attempt, "existed", existed)
			return nil
		case ctx.Err() != nil:
			return fmt.Errorf("upload segment %s (%d bytes) to %s: attempt %d: %w: %w", seg, size, where, attempt, context.Cause(ctx), err)
		case attempt >= u.retry.attempts:
			return fmt.Errorf("upload segment %s (%d bytes) to %s: giving up after %d attempts: %w", seg, size, where, attempt, err)
		}
		delay := u.retry.delay(attempt)
		u.log.Warn("segment upload failed, retrying", "segment", seg, "bytes", size, "attempt", attempt, "retry_in", delay, "err", err)
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("upload segment %s (%d bytes) to %s: %w before attempt %d, after: %w",
				seg, size, where, context.Cause(ctx), attempt+1, err)
		}
	}
}

// delay is the wait after failed attempt n (1-based): base·2ⁿ⁻¹ capped at
// limit, jittered over its upper half so that parallel uploads failing
// together do not retry in lockstep.
func (p retryPolicy) delay(n int) time.Duration {
	d := p.limit
	if n-1 < 32 && p.base<<(n-1) < p.limit {
		d = p.base << (n - 1)
	}
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2)
}

func (u *Uploader) fail(err error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.err == nil {
		u.err = err
	}
}

func (u *Uploader) firstErr() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.err
}

// Wait waits for every upload started so far and returns the first
// failure, or nil if every segment is stored. Call it after the last
// Upload (or Packer.Flush), before committing anything that references the
// segments.
func (u *Uploader) Wait() error {
	u.wg.Wait()
	return u.firstErr()
}

// Stats reports the work done so far.
func (u *Uploader) Stats() UploadStats {
	return UploadStats{
		Segments: u.segments.Load(),
		Bytes:    u.bytes.Load(),
		Existing: u.existing.Load(),
		Puts:     u.puts.Load(),
	}
}

// Packer packs blob records of one Kind into segments of about target
// bytes and hands each sealed segment to an Uploader. It is used from one
// goroutine.
//
// A Packer seals only after appending, so while a Pending is unresolved
// the next Add lands in the same segment. A caller builds trees on this: a
// parent tree added right after its child can refer to the child with a
// relative Ref (zero Segment) whenever the child's Pending is unresolved.
type Packer struct {
	up     *Uploader
	kind   Kind
	target int64

	b      *Builder        // the open segment, nil if none
	open   []*Pending      // the blobs in b
	byBlob map[ID]*Pending // the same, by id: a blob is packed once per segment
	sealed []ID            // every segment sealed so far
}

// NewPacker returns a Packer for blobs of kind that seals a segment once it
// reaches target bytes (DefaultSegmentSize if target <= 0).
func NewPacker(up *Uploader, kind Kind, target int64) *Packer {
	if !validKind(kind) {
		panic(fmt.Sprintf("segments: NewPacker with unknown kind %d", kind))
	}
	if target <= 0 {
		target = DefaultSegmentSize
	}
	return &Packer{up: up, kind: kind, target: target}
}

// Pending is the place of a blob given to a Packer: complete once its
// segment is sealed.
type Pending struct {
	ref    Ref
	sealed bool
}

// Ref returns the blob's reference and whether its segment is sealed. Blob,
// Offset, Length and Size are valid either way; Segment is zero until then.
func (p *Pending) Ref() (Ref, bool) { return p.ref, p.sealed }

// Add appends the record of blob id (plaintext size bytes, from
// Codec.Encode) to the open segment, and only then, if that reached the
// target, seals the segment and starts its upload. A blob already in the
// open segment is not added again: its Pending is returned. Upload errors
// surface from Uploader.Wait.
func (p *Packer) Add(ctx context.Context, id ID, record []byte, size int64) *Pending {
	if pd, ok := p.byBlob[id]; ok {
		return pd
	}
	if p.b == nil {
		p.b = NewBuilder(p.kind)
		p.byBlob = make(map[ID]*Pending)
	}
	off, n := p.b.Add(id, record, size)
	pd := &Pending{ref: Ref{Blob: id, Offset: off, Length: n, Size: size}}
	p.open = append(p.open, pd)
	p.byBlob[id] = pd
	// Seal strictly after appending (see the type's documentation).
	if p.b.Len() >= p.target {
		_ = p.seal(ctx) // recorded by the Uploader, returned by Wait
	}
	return pd
}

// Flush seals the open segment, if it holds any blob, and starts its
// upload. Its error is also returned by Uploader.Wait.
func (p *Packer) Flush(ctx context.Context) error {
	if p.b == nil || p.b.Count() == 0 {
		return nil
	}
	return p.seal(ctx)
}

func (p *Packer) seal(ctx context.Context) error {
	seg, data := p.b.Seal()
	for _, pd := range p.open {
		pd.ref.Segment = seg
		pd.sealed = true
	}
	p.b, p.open, p.byBlob = nil, nil, nil
	p.sealed = append(p.sealed, seg)
	return p.up.Upload(ctx, seg, data)
}

// Segments returns the ids of the segments sealed so far, in order: what a
// manifest committing this work must list (besides reused ones).
func (p *Packer) Segments() []ID { return append([]ID(nil), p.sealed...) }
