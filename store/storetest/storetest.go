// Package storetest is the conformance suite every store.Store backend
// passes: the dir backend in its unit tests, the s3 backend against a real
// MinIO server in the integration tests. The repository format relies on
// exactly what it checks, so a backend (or a server) that passes it can
// hold a repository.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentstate/agentstate/store"
)

// Run runs the suite. open must return a fresh, empty store for each
// subtest (it is called once per subtest) and clean it up with t.Cleanup.
func Run(t *testing.T, open func(t *testing.T) store.Store) {
	tests := []struct {
		name string
		fn   func(t *testing.T, s store.Store)
	}{
		{"PutGetRoundtrip", testRoundtrip},
		{"Overwrite", testOverwrite},
		{"CreateOnlyExisting", testCreateOnlyExisting},
		{"IfMatch", testIfMatch},
		{"IfMatchCounter", testIfMatchCounter},
		{"Ranges", testRanges},
		{"Missing", testMissing},
		{"ListOrder", testListOrder},
		{"ListPrefix", testListPrefix},
		{"ListPagination", testListPagination},
		{"DeleteMissing", testDeleteMissing},
		{"BulkDelete", testBulkDelete},
		{"ConcurrentCreateOnly", testConcurrentCreateOnly},
		{"LastModified", testLastModified},
		{"InvalidKeys", testInvalidKeys},
		{"BodySizeMismatch", testBodySizeMismatch},
		{"BodyOffset", testBodyOffset},
		{"CanceledContext", testCanceledContext},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.fn(t, open(t))
		})
	}
}

func ctx(t *testing.T) context.Context { return t.Context() }

// payload returns n deterministic pseudo-random bytes.
func payload(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func put(t *testing.T, s store.Store, key string, data []byte, opts store.PutOptions) (store.ObjectInfo, error) {
	t.Helper()
	return s.Put(ctx(t), key, bytes.NewReader(data), int64(len(data)), opts)
}

func mustPut(t *testing.T, s store.Store, key string, data []byte) store.ObjectInfo {
	t.Helper()
	info, err := put(t, s, key, data, store.PutOptions{})
	if err != nil {
		t.Fatalf("put %s: %v", key, err)
	}
	return info
}

func get(t *testing.T, s store.Store, key string, offset, length int64) ([]byte, error) {
	t.Helper()
	rc, err := s.Get(ctx(t), key, offset, length)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

func mustGet(t *testing.T, s store.Store, key string) []byte {
	t.Helper()
	b, err := get(t, s, key, 0, -1)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return b
}

// putMany writes every key (content: the key) with bounded parallelism, so
// thousand-key tests stay fast against a real server.
func putMany(t *testing.T, s store.Store, keys []string) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, len(keys))
	sem := make(chan struct{}, 32)
	for _, k := range keys {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if _, err := s.Put(ctx(t), k, strings.NewReader(k), int64(len(k)), store.PutOptions{}); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

func listKeys(t *testing.T, s store.Store, prefix string) []string {
	t.Helper()
	var keys []string
	for info, err := range s.List(ctx(t), prefix) {
		if err != nil {
			t.Fatalf("list %q: %v", prefix, err)
		}
		keys = append(keys, info.Key)
	}
	return keys
}

func testRoundtrip(t *testing.T, s store.Store) {
	tests := []struct {
		key  string
		data []byte
	}{
		{"empty", nil},
		{"small", []byte("hello, world\n")},
		{"nested/dir/object", []byte("deep")},
		{"big/5MiB", payload(1, 5<<20+123)},
		{"unicode/é-ü-日本", []byte("utf-8 key")},
		{"punct/a b+c=d,e;f!g'h(i)~", []byte("odd characters")},
	}
	for _, tt := range tests {
		t.Run(tt.key, func(t *testing.T) {
			info, err := put(t, s, tt.key, tt.data, store.PutOptions{})
			if err != nil {
				t.Fatalf("put: %v", err)
			}
			if info.Key != tt.key || info.Size != int64(len(tt.data)) || info.ETag == "" {
				t.Errorf("put returned %+v, want key %q size %d and an ETag", info, tt.key, len(tt.data))
			}
			got := mustGet(t, s, tt.key)
			if !bytes.Equal(got, tt.data) {
				t.Errorf("get returned %d bytes, want the %d put", len(got), len(tt.data))
			}
			st, err := s.Stat(ctx(t), tt.key)
			if err != nil {
				t.Fatalf("stat: %v", err)
			}
			if st.Key != tt.key || st.Size != int64(len(tt.data)) || st.ETag != info.ETag {
				t.Errorf("stat = %+v, want key %q size %d ETag %q", st, tt.key, len(tt.data), info.ETag)
			}
		})
	}
}

func testOverwrite(t *testing.T, s store.Store) {
	first := mustPut(t, s, "k", []byte("version one"))
	second := mustPut(t, s, "k", []byte("version two, longer"))
	if got := string(mustGet(t, s, "k")); got != "version two, longer" {
		t.Errorf("after overwrite get = %q", got)
	}
	if first.ETag == second.ETag {
		t.Errorf("ETag %q did not change when the content did", first.ETag)
	}
}

func testCreateOnlyExisting(t *testing.T, s store.Store) {
	if _, err := put(t, s, "manifest", []byte("first"), store.PutOptions{CreateOnly: true}); err != nil {
		t.Fatalf("create-only on a new key: %v", err)
	}
	_, err := put(t, s, "manifest", []byte("second"), store.PutOptions{CreateOnly: true})
	if !errors.Is(err, store.ErrPrecondition) {
		t.Fatalf("create-only on an existing key: err = %v, want ErrPrecondition", err)
	}
	if got := string(mustGet(t, s, "manifest")); got != "first" {
		t.Errorf("content after refused create-only = %q, want %q", got, "first")
	}
	// An unrelated key is unaffected, and an empty object can be created.
	if _, err := put(t, s, "manifest2", nil, store.PutOptions{CreateOnly: true}); err != nil {
		t.Errorf("create-only of an empty object: %v", err)
	}
	if _, err := put(t, s, "manifest", []byte("x"), store.PutOptions{CreateOnly: true, IfMatch: "abc"}); err == nil {
		t.Errorf("CreateOnly together with IfMatch was accepted")
	}
}

func testIfMatch(t *testing.T, s store.Store) {
	v1 := mustPut(t, s, "lease", []byte("holder A, until 1"))

	_, err := put(t, s, "lease", []byte("holder B"), store.PutOptions{IfMatch: "not-the-etag"})
	if !errors.Is(err, store.ErrPrecondition) {
		t.Fatalf("If-Match with a wrong ETag: err = %v, want ErrPrecondition", err)
	}
	if got := string(mustGet(t, s, "lease")); got != "holder A, until 1" {
		t.Errorf("content after refused If-Match = %q", got)
	}

	v2, err := put(t, s, "lease", []byte("holder A, until 2"), store.PutOptions{IfMatch: v1.ETag})
	if err != nil {
		t.Fatalf("If-Match with the right ETag: %v", err)
	}
	if v2.ETag == v1.ETag {
		t.Errorf("ETag did not change on an If-Match put")
	}
	if got := string(mustGet(t, s, "lease")); got != "holder A, until 2" {
		t.Errorf("content after If-Match = %q", got)
	}
	// The old ETag is stale now.
	if _, err := put(t, s, "lease", []byte("holder C"), store.PutOptions{IfMatch: v1.ETag}); !errors.Is(err, store.ErrPrecondition) {
		t.Errorf("If-Match with a stale ETag: err = %v, want ErrPrecondition", err)
	}
	// If-Match on a missing key fails its precondition.
	if _, err := put(t, s, "no-lease", []byte("x"), store.PutOptions{IfMatch: v2.ETag}); !errors.Is(err, store.ErrPrecondition) {
		t.Errorf("If-Match on a missing key: err = %v, want ErrPrecondition", err)
	}
	if _, err := s.Stat(ctx(t), "no-lease"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("If-Match on a missing key created it: stat err = %v", err)
	}
}

// testIfMatchCounter has writers increment a counter by read-modify-write
// with If-Match: only if conditional puts are serialized does every
// increment survive.
func testIfMatchCounter(t *testing.T, s store.Store) {
	const writers, increments = 8, 5
	mustPut(t, s, "counter", []byte("0"))
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for range writers {
		wg.Go(func() {
			for done := 0; done < increments; {
				info, err := s.Stat(ctx(t), "counter")
				if err != nil {
					errs <- err
					return
				}
				b, err := get(t, s, "counter", 0, -1)
				if err != nil {
					errs <- err
					return
				}
				n, err := strconv.Atoi(string(b))
				if err != nil {
					errs <- err
					return
				}
				next := []byte(strconv.Itoa(n + 1))
				// Stat then Get is not atomic: the content read may be
				// newer than the ETag, in which case the put must fail.
				_, err = s.Put(ctx(t), "counter", bytes.NewReader(next), int64(len(next)), store.PutOptions{IfMatch: info.ETag})
				switch {
				case err == nil:
					done++
				case !errors.Is(err, store.ErrPrecondition):
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got, want := string(mustGet(t, s, "counter")), strconv.Itoa(writers*increments); got != want {
		t.Errorf("counter = %s, want %s: an If-Match put overwrote a concurrent one", got, want)
	}
}

func testRanges(t *testing.T, s store.Store) {
	data := payload(2, 100)
	mustPut(t, s, "r", data)
	mustPut(t, s, "empty", nil)
	tests := []struct {
		name           string
		key            string
		offset, length int64
		want           []byte
		err            error
	}{
		{"whole", "r", 0, -1, data, nil},
		{"middle", "r", 10, 20, data[10:30], nil},
		{"prefix", "r", 0, 1, data[:1], nil},
		{"to end", "r", 90, -1, data[90:], nil},
		{"exactly to end", "r", 90, 10, data[90:], nil},
		{"length past end is truncated", "r", 95, 10, data[95:], nil},
		{"last byte", "r", 99, -1, data[99:], nil},
		{"zero length", "r", 10, 0, []byte{}, nil},
		{"at end", "r", 100, -1, []byte{}, nil},
		{"at end with length", "r", 100, 5, []byte{}, nil},
		{"offset past end", "r", 101, -1, nil, store.ErrInvalidRange},
		{"offset far past end", "r", 1 << 20, 10, nil, store.ErrInvalidRange},
		{"empty object whole", "empty", 0, -1, []byte{}, nil},
		{"empty object with length", "empty", 0, 10, []byte{}, nil},
		{"empty object past end", "empty", 1, -1, nil, store.ErrInvalidRange},
		{"missing with range", "missing", 10, 10, nil, store.ErrNotFound},
		{"missing zero length", "missing", 0, 0, nil, store.ErrNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := get(t, s, tt.key, tt.offset, tt.length)
			if tt.err != nil {
				if !errors.Is(err, tt.err) {
					t.Fatalf("Get(%q, %d, %d) err = %v, want %v", tt.key, tt.offset, tt.length, err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Get(%q, %d, %d): %v", tt.key, tt.offset, tt.length, err)
			}
			if !bytes.Equal(got, tt.want) {
				t.Errorf("Get(%q, %d, %d) = %d bytes %x, want %d bytes %x", tt.key, tt.offset, tt.length, len(got), got, len(tt.want), tt.want)
			}
		})
	}
}

func testMissing(t *testing.T, s store.Store) {
	mustPut(t, s, "dir/child", []byte("x"))
	// "dir" is a prefix of an object, not an object: a file-system
	// backend must not mistake its directory for one.
	for _, key := range []string{"nope", "dir", "dir/nope", "dir/child/below", "nope/deeper"} {
		if _, err := s.Stat(ctx(t), key); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("Stat(%q) err = %v, want ErrNotFound", key, err)
		}
		if _, err := get(t, s, key, 0, -1); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("Get(%q) err = %v, want ErrNotFound", key, err)
		}
	}
}

// orderKeys trip naive walks of a directory tree: sorting directory
// entries by name yields "a/b" before "a-c" and "a.x", but in byte order
// '-' (0x2d) and '.' (0x2e) sort before '/' (0x2f), which sorts before
// '0'. No key is also a prefix of another at a '/' boundary, which a file
// system cannot hold.
var orderKeys = []string{
	"A", "a-c", "a.x", "a/b", "a/b-", "a/b.c", "a/bb/x", "a/b0", "a/c/d", "a/c-", "a/c.e/f",
	"a0", "a~", "b-/x", "b/y", "b.z/w", "b0", "segments/00/ff", "segments/0a/01",
	"é", "日本/語",
}

func testListOrder(t *testing.T, s store.Store) {
	shuffled := slices.Clone(orderKeys)
	rand.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	putMany(t, s, shuffled)

	want := slices.Clone(orderKeys)
	slices.Sort(want) // byte order
	got := listKeys(t, s, "")
	if !slices.Equal(got, want) {
		t.Errorf("List order:\n got  %q\n want %q", got, want)
	}
	for info, err := range s.List(ctx(t), "") {
		if err != nil {
			t.Fatal(err)
		}
		st, err := s.Stat(ctx(t), info.Key)
		if err != nil {
			t.Fatal(err)
		}
		// Backends may keep LastModified to the second (S3's HEAD does).
		if info.Size != int64(len(info.Key)) || info.ETag != st.ETag ||
			!info.LastModified.Truncate(time.Second).Equal(st.LastModified.Truncate(time.Second)) {
			t.Errorf("List item %+v differs from Stat %+v", info, st)
		}
	}
}

func testListPrefix(t *testing.T, s store.Store) {
	putMany(t, s, orderKeys)
	sorted := slices.Clone(orderKeys)
	slices.Sort(sorted)
	for _, prefix := range []string{"", "a", "a/", "a/b", "a/c", "a/c/", "a/c.", "b", "b-", "b/", "segments/", "segments/0a/", "segments/0a/01", "é", "zzz", "a/zzz/", "nothing/here/"} {
		var want []string
		for _, k := range sorted {
			if strings.HasPrefix(k, prefix) {
				want = append(want, k)
			}
		}
		if got := listKeys(t, s, prefix); !slices.Equal(got, want) {
			t.Errorf("List(%q):\n got  %q\n want %q", prefix, got, want)
		}
	}
}

func testListPagination(t *testing.T, s store.Store) {
	// More than one S3 page (1000 keys), spread over directories so the
	// dir backend's walk crosses directories within and across pages.
	const n = 1100
	var keys []string
	for i := range n {
		keys = append(keys, fmt.Sprintf("p/%x/%04d", i%13, i))
	}
	putMany(t, s, append(slices.Clone(keys), "o", "q/after"))
	slices.Sort(keys)

	got := listKeys(t, s, "p/")
	if len(got) != n {
		t.Fatalf("List(p/) yielded %d keys, want %d", len(got), n)
	}
	if !slices.Equal(got, keys) {
		t.Fatalf("List(p/) not every key once in order; first difference at %d", firstDiff(got, keys))
	}
	if all := listKeys(t, s, ""); len(all) != n+2 || all[0] != "o" || all[n+1] != "q/after" {
		t.Errorf("List(\"\") yielded %d keys, first %q, last %q", len(all), all[0], all[len(all)-1])
	}

	// Breaking out early, within the first page and within the second,
	// stops cleanly, and the store keeps working.
	for _, stop := range []int{1, 10, 1050} {
		i := 0
		for info, err := range s.List(ctx(t), "p/") {
			if err != nil {
				t.Fatal(err)
			}
			if info.Key != keys[i] {
				t.Fatalf("item %d = %q, want %q", i, info.Key, keys[i])
			}
			i++
			if i == stop {
				break
			}
		}
		if i != stop {
			t.Errorf("stopped after %d items, want %d", i, stop)
		}
	}
	if got := listKeys(t, s, "q/"); !slices.Equal(got, []string{"q/after"}) {
		t.Errorf("List(q/) after early breaks = %q", got)
	}
}

func firstDiff(a, b []string) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func testDeleteMissing(t *testing.T, s store.Store) {
	if err := s.Delete(ctx(t), nil); err != nil {
		t.Errorf("Delete(nil): %v", err)
	}
	if err := s.Delete(ctx(t), []string{"nope", "x/y/z"}); err != nil {
		t.Errorf("Delete of missing keys: %v", err)
	}
	mustPut(t, s, "a/b/c", []byte("1"))
	mustPut(t, s, "a/keep", []byte("2"))
	if err := s.Delete(ctx(t), []string{"a/b/c", "a/b", "never"}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, err := s.Stat(ctx(t), "a/b/c"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("deleted key: stat err = %v, want ErrNotFound", err)
	}
	if got := listKeys(t, s, ""); !slices.Equal(got, []string{"a/keep"}) {
		t.Errorf("after delete List = %q, want [a/keep]", got)
	}
	// With "a/b/c" gone, "a/b" is no longer a prefix and can be an object.
	mustPut(t, s, "a/b", []byte("3"))
	if got := listKeys(t, s, ""); !slices.Equal(got, []string{"a/b", "a/keep"}) {
		t.Errorf("List = %q, want [a/b a/keep]", got)
	}
	if err := s.Delete(ctx(t), []string{"a/b", "a/b"}); err != nil {
		t.Errorf("Delete of a key twice in one call: %v", err)
	}
}

func testBulkDelete(t *testing.T, s store.Store) {
	const n = 1100 // more than one S3 DeleteObjects batch
	var keys []string
	for i := range n {
		keys = append(keys, fmt.Sprintf("del/%02d/%04d", i%7, i))
	}
	putMany(t, s, append(slices.Clone(keys), "keep"))
	if err := s.Delete(ctx(t), append(keys, "del/missing")); err != nil {
		t.Fatalf("bulk delete: %v", err)
	}
	if got := listKeys(t, s, ""); !slices.Equal(got, []string{"keep"}) {
		t.Errorf("after bulk delete %d keys remain (want only keep): %.5q", len(got), got)
	}
}

func testConcurrentCreateOnly(t *testing.T, s store.Store) {
	const writers = 16
	var wg sync.WaitGroup
	errs := make([]error, writers)
	start := make(chan struct{})
	for i := range writers {
		wg.Go(func() {
			body := []byte(fmt.Sprintf("writer %d", i))
			<-start
			_, errs[i] = s.Put(ctx(t), "manifests/l/00000000000000000001", bytes.NewReader(body), int64(len(body)), store.PutOptions{CreateOnly: true})
		})
	}
	close(start)
	wg.Wait()
	winner := -1
	for i, err := range errs {
		switch {
		case err == nil:
			if winner >= 0 {
				t.Errorf("writers %d and %d both created the key", winner, i)
			}
			winner = i
		case !errors.Is(err, store.ErrPrecondition):
			t.Errorf("writer %d: err = %v, want nil or ErrPrecondition", i, err)
		}
	}
	if winner < 0 {
		t.Fatal("no writer created the key")
	}
	if got, want := string(mustGet(t, s, "manifests/l/00000000000000000001")), fmt.Sprintf("writer %d", winner); got != want {
		t.Errorf("content = %q, want the winner's %q", got, want)
	}
}

func testLastModified(t *testing.T, s store.Store) {
	// Generous bounds: the store's clock may be another machine's.
	before := time.Now().Add(-5 * time.Minute)
	mustPut(t, s, "t", []byte("x"))
	after := time.Now().Add(5 * time.Minute)
	st, err := s.Stat(ctx(t), "t")
	if err != nil {
		t.Fatal(err)
	}
	if st.LastModified.Before(before) || st.LastModified.After(after) {
		t.Errorf("Stat LastModified = %v, want about now", st.LastModified)
	}
	for info, err := range s.List(ctx(t), "") {
		if err != nil {
			t.Fatal(err)
		}
		if info.LastModified.Before(before) || info.LastModified.After(after) {
			t.Errorf("List LastModified = %v, want about now", info.LastModified)
		}
	}
}

func testInvalidKeys(t *testing.T, s store.Store) {
	for _, key := range []string{"", "/abs", "trailing/", "a//b", "..", "../up", "a/../b", "a/./b", ".", "nul\x00byte", "ctl\x01", "bad\xffutf8"} {
		if _, err := put(t, s, key, []byte("x"), store.PutOptions{}); err == nil || errors.Is(err, store.ErrPrecondition) {
			t.Errorf("Put(%q) err = %v, want a key error", key, err)
		}
		if _, err := s.Stat(ctx(t), key); err == nil || errors.Is(err, store.ErrNotFound) {
			t.Errorf("Stat(%q) err = %v, want a key error", key, err)
		}
		if _, err := s.Get(ctx(t), key, 0, -1); err == nil || errors.Is(err, store.ErrNotFound) {
			t.Errorf("Get(%q) err = %v, want a key error", key, err)
		}
		if err := s.Delete(ctx(t), []string{key}); err == nil {
			t.Errorf("Delete(%q) accepted an invalid key", key)
		}
	}
	for _, prefix := range []string{"/abs", "../", "a//", "a/../"} {
		var err error
		for _, err = range s.List(ctx(t), prefix) {
			break
		}
		if err == nil {
			t.Errorf("List(%q) accepted an invalid prefix", prefix)
		}
	}
	if got := listKeys(t, s, ""); len(got) != 0 {
		t.Errorf("invalid keys left objects: %q", got)
	}
}

func testBodySizeMismatch(t *testing.T, s store.Store) {
	for _, tt := range []struct {
		name string
		size int64
		opts store.PutOptions
	}{
		{"short body", 10, store.PutOptions{}},
		{"long body", 2, store.PutOptions{}},
		{"short body create-only", 10, store.PutOptions{CreateOnly: true}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := s.Put(ctx(t), "k", strings.NewReader("12345"), tt.size, tt.opts); err == nil {
				t.Fatalf("Put with size %d of a 5-byte body succeeded", tt.size)
			}
			if _, err := s.Stat(ctx(t), "k"); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("failed put left an object: stat err = %v", err)
			}
		})
	}
}

// testBodyOffset: a body positioned past its start is uploaded from there,
// including when a conditional put has to rewind it.
func testBodyOffset(t *testing.T, s store.Store) {
	for _, opts := range []store.PutOptions{{}, {CreateOnly: true}} {
		r := strings.NewReader("skip:payload")
		if _, err := r.Seek(5, io.SeekStart); err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("off-%t", opts.CreateOnly)
		if _, err := s.Put(ctx(t), key, r, 7, opts); err != nil {
			t.Fatalf("put %+v: %v", opts, err)
		}
		if got := string(mustGet(t, s, key)); got != "payload" {
			t.Errorf("put from offset 5 %+v stored %q", opts, got)
		}
	}
}

func testCanceledContext(t *testing.T, s store.Store) {
	mustPut(t, s, "k", []byte("x"))
	c, cancel := context.WithCancel(ctx(t))
	cancel()
	if _, err := s.Put(c, "k2", strings.NewReader("y"), 1, store.PutOptions{}); !errors.Is(err, context.Canceled) {
		t.Errorf("Put err = %v, want context.Canceled", err)
	}
	if _, err := s.Put(c, "k3", strings.NewReader("y"), 1, store.PutOptions{CreateOnly: true}); !errors.Is(err, context.Canceled) {
		t.Errorf("create-only Put err = %v, want context.Canceled", err)
	}
	if _, err := s.Get(c, "k", 0, -1); !errors.Is(err, context.Canceled) {
		t.Errorf("Get err = %v, want context.Canceled", err)
	}
	if _, err := s.Stat(c, "k"); !errors.Is(err, context.Canceled) {
		t.Errorf("Stat err = %v, want context.Canceled", err)
	}
	var listErr error
	for _, err := range s.List(c, "") {
		if err != nil {
			listErr = err
			break
		}
	}
	if !errors.Is(listErr, context.Canceled) {
		t.Errorf("List err = %v, want context.Canceled: a cancelled listing must not look complete", listErr)
	}
	if _, err := s.Stat(ctx(t), "k2"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("cancelled put wrote the object: stat err = %v", err)
	}
}
