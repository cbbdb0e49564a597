package store_test

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/agentstate/agentstate/store"
)

func TestCounting(t *testing.T) {
	c := store.NewCounting(openDir(t))
	ctx := t.Context()
	if got := c.Stats(); got != (store.Stats{}) || got.Requests() != 0 {
		t.Fatalf("fresh Counting: %+v", got)
	}

	// Concurrent puts: the counters are atomic.
	var wg sync.WaitGroup
	for i := range 1001 {
		wg.Go(func() {
			k := fmt.Sprintf("k/%04d", i)
			if _, err := c.Put(ctx, k, strings.NewReader("abc"), 3, store.PutOptions{}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	before := c.Stats()
	if before.Puts != 1001 || before.BytesUploaded != 3003 {
		t.Fatalf("after 1001 puts: %+v", before)
	}

	rc, err := c.Get(ctx, "k/0000", 1, -1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(rc); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if _, err := c.Stat(ctx, "k/0001"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Stat(ctx, "missing"); err == nil {
		t.Fatal("stat of a missing key succeeded")
	}

	list := func(prefix string, stop int) {
		n := 0
		for _, err := range c.List(ctx, prefix) {
			if err != nil {
				t.Fatal(err)
			}
			if n++; n == stop {
				break
			}
		}
	}
	list("none/", -1) // empty listing: still one request
	list("k/", 1000)  // exactly one page
	list("k/", -1)    // 1001 keys: two pages

	keys := make([]string, 2500)
	for i := range keys {
		keys[i] = fmt.Sprintf("d/%d", i)
	}
	if err := c.Delete(ctx, keys); err != nil { // three batches
		t.Fatal(err)
	}
	if err := c.Delete(ctx, nil); err != nil { // no request
		t.Fatal(err)
	}

	got := c.Stats().Sub(before)
	want := store.Stats{Gets: 1, Stats: 2, Lists: 4, Deletes: 3, BytesDownloaded: 2}
	if got != want {
		t.Errorf("counts = %+v, want %+v", got, want)
	}
	if got.Requests() != 10 {
		t.Errorf("Requests() = %d, want 10", got.Requests())
	}
	if c.String() != c.Unwrap().String() {
		t.Errorf("String() = %q, want the wrapped store's", c)
	}
}
