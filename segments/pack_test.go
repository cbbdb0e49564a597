package segments

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentstate/agentstate/store"
)

// fastRetry keeps retry tests quick.
var fastRetry = retryPolicy{attempts: uploadAttempts, base: time.Millisecond, limit: 4 * time.Millisecond}

func newTestUploader(st Putter, parallel int) *Uploader {
	u := NewUploader(st, parallel, nil)
	u.retry = fastRetry
	return u
}

// testTree is what the property test packs: a directory-like blob whose
// children are referenced the way the manifest package will, relatively
// when the child's segment is still open.
type testTree struct {
	Data     string `json:"d"`
	Children []Ref  `json:"c"`
}

// TestPackerRelativeRefs builds random trees bottom-up through a Packer
// with a small target, so that segments seal at arbitrary points. A parent
// refers to a child with a zero Segment exactly when the child's Pending is
// unresolved at the time the parent is encoded. Reading the root back and
// resolving every ref against its container must reach every node intact:
// this fails if a Packer ever seals before appending.
func TestPackerRelativeRefs(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	for seed := range uint64(20) {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 1))
			st := newMemStore()
			up := newTestUploader(st, 3)
			target := int64(200 + r.IntN(3000))
			p := NewPacker(up, KindTree, target)
			relative, absolute := 0, 0
			want := map[ID][]byte{}

			// add packs a subtree of the given depth and returns its Pending.
			var add func(depth int) *Pending
			add = func(depth int) *Pending {
				var kids []*Pending
				if depth > 0 {
					for range 1 + r.IntN(3) {
						kids = append(kids, add(depth-1))
					}
				}
				node := testTree{Data: strings.Repeat(fmt.Sprint(r.Uint64()), r.IntN(20))}
				for _, k := range kids {
					ref, sealed := k.Ref()
					if sealed {
						absolute++
					} else {
						relative++ // ref.Segment is zero
					}
					node.Children = append(node.Children, ref)
				}
				plain, err := json.Marshal(node)
				if err != nil {
					t.Fatal(err)
				}
				id, rec := c.Encode(plain)
				want[id] = plain
				return p.Add(ctx, id, rec, int64(len(plain)))
			}
			root := add(5)
			if err := p.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			if err := up.Wait(); err != nil {
				t.Fatal(err)
			}
			rootRef, sealed := root.Ref()
			if !sealed {
				t.Fatal("root unresolved after Flush")
			}
			if relative == 0 || absolute == 0 {
				t.Fatalf("%d relative and %d absolute refs: the test must exercise both", relative, absolute)
			}
			seen := 0
			var walk func(ref Ref, container ID)
			walk = func(ref Ref, container ID) {
				plain, err := c.ReadBlob(ctx, st, ref, container)
				if err != nil {
					t.Fatalf("read %+v in container %s: %v", ref, container, err)
				}
				seen++
				var node testTree
				if err := json.Unmarshal(plain, &node); err != nil {
					t.Fatal(err)
				}
				seg := ref.Resolve(container).Segment
				for _, k := range node.Children {
					walk(k, seg)
				}
			}
			walk(rootRef, ID{})
			if seen == 0 || len(p.Segments()) != int(up.Stats().Segments) {
				t.Fatalf("walked %d nodes; %d segments sealed, %d stored", seen, len(p.Segments()), up.Stats().Segments)
			}
			for _, seg := range p.Segments() {
				if _, _, err := ParseSegment(st.object(Key(seg)), seg); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

func TestPackerSealing(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	st := newMemStore()
	up := newTestUploader(st, 2)
	p := NewPacker(up, KindData, 1000)

	small := func(s string) (ID, []byte, int64) { id, rec := c.Encode([]byte(s)); return id, rec, int64(len(s)) }
	id1, rec1, n1 := small("first")
	a := p.Add(ctx, id1, rec1, n1)
	if ref, ok := a.Ref(); ok || !ref.Segment.IsZero() || ref.Offset != segHeaderLen || ref.Blob != id1 || ref.Size != n1 || ref.Length != int64(len(rec1)) {
		t.Fatalf("first Pending = %+v, %v", ref, ok)
	}
	// The same blob again: the same Pending, nothing appended.
	if again := p.Add(ctx, id1, rec1, n1); again != a {
		t.Fatal("duplicate blob got a new Pending")
	}
	// A record that crosses the target lands in the open segment first,
	// and only then is the segment sealed: both are resolved, together.
	big := randBytes(1, 5000)
	idB, recB := c.Encode(big)
	b := p.Add(ctx, idB, recB, int64(len(big)))
	ra, okA := a.Ref()
	rb, okB := b.Ref()
	if !okA || !okB || ra.Segment != rb.Segment || ra.Segment.IsZero() {
		t.Fatalf("after crossing the target: %+v %v, %+v %v", ra, okA, rb, okB)
	}
	// The next blob opens a new segment.
	id3, rec3, n3 := small("third")
	d := p.Add(ctx, id3, rec3, n3)
	if ref, ok := d.Ref(); ok || ref.Offset != segHeaderLen {
		t.Fatalf("third Pending = %+v, %v", ref, ok)
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Flush(ctx); err != nil { // nothing open: no segment
		t.Fatal(err)
	}
	if err := up.Wait(); err != nil {
		t.Fatal(err)
	}
	rd, ok := d.Ref()
	if !ok || rd.Segment == ra.Segment {
		t.Fatalf("third blob: %+v, %v", rd, ok)
	}
	if segs := p.Segments(); len(segs) != 2 || segs[0] != ra.Segment || segs[1] != rd.Segment {
		t.Fatalf("Segments() = %v", segs)
	}
	s := up.Stats()
	wantBytes := int64(len(st.object(Key(ra.Segment))) + len(st.object(Key(rd.Segment))))
	if s.Segments != 2 || s.Puts != 2 || s.Existing != 0 || s.Bytes != wantBytes {
		t.Fatalf("Stats = %+v, want 2 segments, 2 puts, %d bytes", s, wantBytes)
	}
	for _, pd := range []*Pending{a, b, d} {
		ref, _ := pd.Ref()
		if _, err := c.ReadBlob(ctx, st, ref, ID{}); err != nil {
			t.Fatal(err)
		}
	}
}

func TestPackerDefaultTarget(t *testing.T) {
	if p := NewPacker(NewUploader(newMemStore(), 1, nil), KindData, 0); p.target != DefaultSegmentSize {
		t.Fatalf("target %d, want %d", p.target, DefaultSegmentSize)
	}
}

func TestUploaderRetry(t *testing.T) {
	seg, data := NewBuilder(KindData).Seal()
	tests := []struct {
		name         string
		failures     int   // the first n puts fail
		failWith     error // with this error (transient if nil)
		preexisting  bool  // the object is already stored
		landAnyway   bool  // failed puts still store the object (lost response)
		wantErr      bool
		wantPuts     int64
		wantExisting int64
	}{
		{name: "first try", wantPuts: 1},
		{name: "two transient failures", failures: 2, wantPuts: 3},
		{name: "succeeds on the last attempt", failures: uploadAttempts - 1, wantPuts: uploadAttempts},
		{name: "always failing", failures: 100, wantErr: true, wantPuts: uploadAttempts},
		// A 412 is followed by one unconditional PUT of the same bytes, which
		// refreshes LastModified so GC's grace period covers the segment.
		{name: "already stored", preexisting: true, wantPuts: 2, wantExisting: 1},
		{name: "lost response, then 412", failures: 1, landAnyway: true, wantPuts: 3, wantExisting: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := newMemStore()
			if tt.preexisting {
				st.set(Key(seg), data)
			}
			st.putErr = func(key string, n int) error {
				if n > tt.failures {
					return nil
				}
				if tt.landAnyway {
					st.set(key, data)
				}
				return fmt.Errorf("put %s: %w", key, errTransient)
			}
			up := newTestUploader(st, 1)
			if err := up.Upload(context.Background(), seg, data); err != nil {
				t.Fatal(err)
			}
			err := up.Wait()
			if tt.wantErr {
				if !errors.Is(err, errTransient) || !strings.Contains(err.Error(), seg.String()) || !strings.Contains(err.Error(), "memstore") {
					t.Fatalf("Wait = %v, want the injected error naming segment %s and the store", err, seg)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			s := up.Stats()
			if s.Puts != tt.wantPuts || s.Existing != tt.wantExisting {
				t.Errorf("Stats = %+v, want %d puts, %d existing", s, tt.wantPuts, tt.wantExisting)
			}
			if !tt.wantErr && (s.Segments != 1 || s.Bytes != int64(len(data)) || !bytes.Equal(st.object(Key(seg)), data)) {
				t.Errorf("segment not stored: %+v", s)
			}
		})
	}
}

func TestRetryDelay(t *testing.T) {
	p := retryPolicy{attempts: 10, base: 100 * time.Millisecond, limit: time.Second}
	for n, want := range []time.Duration{100, 200, 400, 800, 1000, 1000, 1000} {
		want *= time.Millisecond
		for range 50 {
			if d := p.delay(n + 1); d < want/2 || d >= want {
				t.Fatalf("delay(%d) = %v, want in [%v, %v)", n+1, d, want/2, want)
			}
		}
	}
	if d := p.delay(200); d < 500*time.Millisecond || d >= time.Second {
		t.Fatalf("delay(200) = %v: shift overflow", d)
	}
}

// sealedSegment returns a distinct small segment per n.
func sealedSegment(t *testing.T, c *Codec, n int) (ID, []byte) {
	b := NewBuilder(KindData)
	p := []byte(fmt.Sprint("segment ", n))
	id, rec := c.Encode(p)
	b.Add(id, rec, int64(len(p)))
	return b.Seal()
}

func TestUploaderFirstErrorAndFailFast(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	badSeg, badData := sealedSegment(t, c, 0)
	st := newMemStore()
	permanent := errors.New("injected permanent failure")
	st.putErr = func(key string, n int) error {
		if key == Key(badSeg) {
			return permanent
		}
		return nil
	}
	up := newTestUploader(st, 2)
	if err := up.Upload(ctx, badSeg, badData); err != nil {
		t.Fatal(err)
	}
	err := up.Wait()
	if !errors.Is(err, permanent) || !strings.Contains(err.Error(), badSeg.String()) {
		t.Fatalf("Wait = %v", err)
	}
	// Once failed, the checkpoint cannot commit: later uploads are not
	// even attempted, and Wait keeps returning the first error.
	seg, data := sealedSegment(t, c, 1)
	if err := up.Upload(ctx, seg, data); !errors.Is(err, permanent) {
		t.Fatalf("Upload after a failure = %v", err)
	}
	if st.putCount(Key(seg)) != 0 {
		t.Fatal("upload attempted after an earlier failure")
	}
	if err2 := up.Wait(); !errors.Is(err2, permanent) {
		t.Fatalf("second Wait = %v", err2)
	}
}

func TestUploaderBoundedInFlight(t *testing.T) {
	c := newTestCodec(t)
	ctx := context.Background()
	const parallel, total = 3, 10
	st := newMemStore()
	st.hold = make(chan struct{})
	up := newTestUploader(st, parallel)

	started := make(chan int, total)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range total {
			seg, data := sealedSegment(t, c, i)
			if err := up.Upload(ctx, seg, data); err != nil {
				t.Error(err)
			}
			started <- i
		}
	}()
	// Exactly `parallel` Upload calls return while every put is held.
	for range parallel {
		<-started
	}
	select {
	case i := <-started:
		t.Fatalf("Upload %d returned with %d uploads in flight", i, parallel)
	case <-time.After(100 * time.Millisecond):
	}
	close(st.hold)
	<-done
	if err := up.Wait(); err != nil {
		t.Fatal(err)
	}
	if st.maxIn > parallel {
		t.Fatalf("%d puts in flight at once, want at most %d", st.maxIn, parallel)
	}
	if s := up.Stats(); s.Segments != total || s.Puts != total {
		t.Fatalf("Stats = %+v", s)
	}
}

func TestUploaderContextCanceled(t *testing.T) {
	c := newTestCodec(t)
	t.Run("during retries", func(t *testing.T) {
		st := newMemStore()
		var once sync.Once
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		st.putErr = func(string, int) error {
			once.Do(cancel) // the caller gives up while the first put fails
			return errTransient
		}
		up := NewUploader(st, 1, nil) // real backoff: cancel must cut it short
		seg, data := sealedSegment(t, c, 0)
		start := time.Now()
		if err := up.Upload(ctx, seg, data); err != nil {
			t.Fatal(err)
		}
		err := up.Wait()
		if !errors.Is(err, context.Canceled) || !errors.Is(err, errTransient) {
			t.Fatalf("Wait = %v, want context.Canceled and the put error", err)
		}
		if s := up.Stats(); s.Puts != 1 {
			t.Fatalf("%d puts after cancellation, want 1", s.Puts)
		}
		if time.Since(start) > uploadRetryBase {
			t.Fatalf("took %v: waited out the backoff after cancellation", time.Since(start))
		}
	})
	t.Run("waiting for a slot", func(t *testing.T) {
		st := newMemStore()
		st.hold = make(chan struct{})
		up := newTestUploader(st, 1)
		ctx, cancel := context.WithCancel(context.Background())
		seg0, data0 := sealedSegment(t, c, 0)
		if err := up.Upload(ctx, seg0, data0); err != nil {
			t.Fatal(err)
		}
		seg1, data1 := sealedSegment(t, c, 1)
		go func() { time.Sleep(20 * time.Millisecond); cancel() }()
		if err := up.Upload(ctx, seg1, data1); !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), seg1.String()) {
			t.Fatalf("Upload = %v, want context.Canceled naming the segment", err)
		}
		if err := up.Wait(); !errors.Is(err, context.Canceled) {
			t.Fatalf("Wait = %v", err)
		}
		if st.putCount(Key(seg1)) != 0 {
			t.Fatal("canceled upload was attempted")
		}
	})
}

func TestUploaderPutOptions(t *testing.T) {
	var got []store.PutOptions
	var mu sync.Mutex
	rec := putterFunc(func(ctx context.Context, key string, opts store.PutOptions) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, opts)
		return nil
	})
	seg, data := NewBuilder(KindData).Seal()
	up := NewUploader(rec, 1, nil)
	if err := up.Upload(context.Background(), seg, data); err != nil {
		t.Fatal(err)
	}
	if err := up.Wait(); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || !got[0].CreateOnly || got[0].IfMatch != "" {
		t.Fatalf("put options %+v, want create-only", got)
	}
}

// TestUploaderRefreshesExistingSegment: after a 412 the same bytes are
// written once more without a condition, so the object's LastModified is
// fresh: a dead segment GC marked long ago is then inside the grace period
// again until the manifest that needs it is committed.
func TestUploaderRefreshesExistingSegment(t *testing.T) {
	var calls []store.PutOptions
	st := putterFunc(func(_ context.Context, _ string, opts store.PutOptions) error {
		calls = append(calls, opts)
		if opts.CreateOnly {
			return store.ErrPrecondition
		}
		return nil
	})
	up := NewUploader(st, 1, nil)
	seg, data := Sum([]byte("x")), []byte("x")
	if err := up.Upload(context.Background(), seg, data); err != nil {
		t.Fatal(err)
	}
	if err := up.Wait(); err != nil {
		t.Fatal(err)
	}
	if len(calls) != 2 || !calls[0].CreateOnly || calls[1] != (store.PutOptions{}) {
		t.Fatalf("puts %+v: want create-only, then one unconditional put", calls)
	}
}
