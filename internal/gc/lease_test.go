package gc

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/store"
)

func TestLeaseAcquireHeldRelease(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	a, _, err := AcquireLease(ctx, st, "gc-a", time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !a.StoreTime().Equal(st.Now()) {
		t.Fatalf("store time %s, store clock %s", a.StoreTime(), st.Now())
	}
	_, _, err = AcquireLease(ctx, st, "gc-b", time.Minute, nil)
	var held *LeaseHeldError
	if !errors.As(err, &held) || !errors.Is(err, ErrLeaseHeld) || held.Owner != "gc-a" {
		t.Fatalf("second acquire: %v", err)
	}
	if !held.Expires.Equal(st.Now().Add(time.Minute)) {
		t.Fatalf("expires %s", held.Expires)
	}
	if err := a.Release(ctx); err != nil {
		t.Fatal(err)
	}
	b, _, err := AcquireLease(ctx, st, "gc-b", time.Minute, nil)
	if err != nil {
		t.Fatalf("acquire after release: %v", err)
	}
	defer b.Release(ctx)
	if got := keys(t, st, "locks/"); len(got) != 1 || got[0] != LeaseKey {
		t.Fatalf("locks/ holds %v (a clock probe was left behind?)", got)
	}
}

// TestLeaseExpiryTakeover: a GC that crashed (stopped renewing without
// releasing) blocks the next one only until its lease expires on the
// store's clock.
func TestLeaseExpiryTakeover(t *testing.T) {
	st := newClockStore(t)
	crashed, cancel := context.WithCancel(context.Background())
	if _, _, err := AcquireLease(crashed, st, "gc-crashed", time.Minute, nil); err != nil {
		t.Fatal(err)
	}
	cancel() // renewal stops; the lease is never released
	ctx := context.Background()

	st.Advance(59 * time.Second)
	if _, _, err := AcquireLease(ctx, st, "gc-next", time.Minute, nil); !errors.Is(err, ErrLeaseHeld) {
		t.Fatalf("before expiry: %v", err)
	}
	st.Advance(3 * time.Second)
	l, _, err := AcquireLease(ctx, st, "gc-next", time.Minute, nil)
	if err != nil {
		t.Fatalf("after expiry: %v", err)
	}
	defer l.Release(ctx)
	if !l.StoreTime().Equal(st.Now()) {
		t.Fatalf("store time %s, want %s", l.StoreTime(), st.Now())
	}
	body, _, err := l.read(ctx)
	if err != nil || body.Owner != "gc-next" || body.Counter != 2 {
		t.Fatalf("lease body after takeover: %+v %v", body, err)
	}
	if got := keys(t, st, "locks/"); len(got) != 1 {
		t.Fatalf("locks/ holds %v: the clock probe was not deleted", got)
	}
}

// TestLeaseRenewal: renewal rewrites the lease with If-Match and a new
// counter, so the ETag changes and a takeover by ETag would fail.
func TestLeaseRenewal(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	l, runCtx, err := AcquireLease(ctx, st, "gc-a", 4*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	first, err := st.Stat(ctx, LeaseKey)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // one renewal (every TTL/4)
	second, err := st.Stat(ctx, LeaseKey)
	if err != nil {
		t.Fatal(err)
	}
	if first.ETag == second.ETag {
		t.Fatal("the lease was not renewed")
	}
	if err := l.Valid(); err != nil || runCtx.Err() != nil {
		t.Fatalf("lease invalid after renewal: %v %v", err, runCtx.Err())
	}
	body, _, _ := l.read(ctx)
	if body.Counter < 2 {
		t.Fatalf("counter %d after a renewal", body.Counter)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if body, _, _ := l.read(ctx); !body.Released {
		t.Fatalf("released lease body: %+v", body)
	}
}

// TestLeaseLost: when someone else rewrites the lease, the next renewal
// fails its If-Match and the run's context is cancelled.
func TestLeaseLost(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	l, runCtx, err := AcquireLease(ctx, st, "gc-a", 4*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	other := []byte(`{"v":1,"owner":"intruder","counter":9,"ttl":"1m0s"}`)
	if _, err := st.Put(ctx, LeaseKey, bytes.NewReader(other), int64(len(other)), store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-runCtx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("run context not cancelled after the lease was taken")
	}
	if !errors.Is(context.Cause(runCtx), ErrLeaseLost) || !errors.Is(l.Valid(), ErrLeaseLost) {
		t.Fatalf("cause %v, valid %v", context.Cause(runCtx), l.Valid())
	}
	if body, _, _ := l.read(ctx); body.Owner != "intruder" {
		t.Fatalf("the lost lease was overwritten: %+v", body)
	}
}

// TestLeaseUnreadable: garbage in the lease object expires by its
// LastModified with our TTL.
func TestLeaseUnreadable(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	junk := []byte("not json")
	if _, err := st.Put(ctx, LeaseKey, bytes.NewReader(junk), int64(len(junk)), store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := AcquireLease(ctx, st, "gc", time.Minute, nil); !errors.Is(err, ErrLeaseHeld) {
		t.Fatalf("fresh garbage lease: %v", err)
	}
	st.Advance(2 * time.Minute)
	l, _, err := AcquireLease(ctx, st, "gc", time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	l.Release(ctx)
}

func TestRunLeaseHeld(t *testing.T) {
	st := newClockStore(t)
	ctx := context.Background()
	l, _, err := AcquireLease(ctx, st, "other-gc", time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	_, err = Run(ctx, st, testOptions())
	if !errors.Is(err, ErrLeaseHeld) || !strings.Contains(err.Error(), "other-gc") {
		t.Fatalf("gc while another holds the lease: %v", err)
	}
}
