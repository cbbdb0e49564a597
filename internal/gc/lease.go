package gc

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/agentstate/agentstate/store"
)

// LeaseKey is the object that makes GC one at a time per repository.
const LeaseKey = "locks/gc"

// clockProbePrefix names the short-lived objects written to read the
// store's clock when the lease is held by someone else.
const clockProbePrefix = "locks/clock-"

// DefaultLeaseTTL is how long a lease lasts without renewal. A GC that
// crashed blocks the next one for at most this long.
const DefaultLeaseTTL = 2 * time.Minute

// MinLeaseTTL is the shortest lease accepted: it is renewed every quarter
// of its TTL, and a renewal must succeed within half of it.
const MinLeaseTTL = 2 * time.Second

// storeResolution is the coarsest LastModified resolution of a backend
// (S3: one second). Every age comparison adds it, so a truncated timestamp
// can only make an object look younger than it is.
const storeResolution = time.Second

var (
	// ErrLeaseHeld: another GC holds the repository's lease.
	ErrLeaseHeld = errors.New("another GC holds the repository lease")
	// ErrLeaseLost: the lease could not be renewed (or was taken over);
	// the run stops.
	ErrLeaseLost = errors.New("GC lease lost")
)

// LeaseHeldError says who holds the lease and until when.
type LeaseHeldError struct {
	Owner   string
	Expires time.Time // store clock
}

func (e *LeaseHeldError) Error() string {
	return fmt.Sprintf("%v (owner %s, expires %s unless renewed)", ErrLeaseHeld, e.Owner, e.Expires.UTC().Format(time.RFC3339))
}

func (e *LeaseHeldError) Unwrap() error { return ErrLeaseHeld }

// leaseBody is the lease object's content. Counter changes on every write,
// so the body, and with it the ETag (S3: the MD5 of the body), changes on
// every renewal and If-Match can tell one write from the next.
type leaseBody struct {
	Version  int       `json:"v"`
	Owner    string    `json:"owner"`
	Counter  uint64    `json:"counter"`
	TTL      string    `json:"ttl"`
	Expires  time.Time `json:"expires"` // estimated on the store clock; LastModified+TTL is authoritative
	Released bool      `json:"released,omitempty"`
}

func (b leaseBody) encode() []byte {
	out, _ := json.Marshal(b)
	return append(out, '\n')
}

func parseLeaseBody(b []byte) (leaseBody, time.Duration, error) {
	var lb leaseBody
	if err := json.Unmarshal(b, &lb); err != nil {
		return lb, 0, err
	}
	ttl, err := time.ParseDuration(lb.TTL)
	if err != nil || ttl <= 0 {
		return lb, 0, fmt.Errorf("lease ttl %q", lb.TTL)
	}
	return lb, ttl, nil
}

// Lease is a held GC lease. It renews itself in the background until
// Release; if a renewal fails for longer than half the TTL, or the lease
// was taken over, the context it returned is cancelled with ErrLeaseLost.
type Lease struct {
	st    store.Store
	log   *slog.Logger
	owner string
	ttl   time.Duration

	// storeTime is the store's clock when the lease was taken: the
	// LastModified of our own write.
	storeTime time.Time
	taken     time.Time // local monotonic time of that write

	mu      sync.Mutex
	etag    string
	counter uint64
	lastOK  time.Time // local monotonic time of the last confirmed write
	lost    error

	cancel   context.CancelCauseFunc
	stop     chan struct{}
	done     chan struct{}
	released sync.Once
}

// NewOwner names this process as a lease owner: host, pid and a random
// suffix, so two GCs on one host never look alike.
func NewOwner() string {
	host, _ := os.Hostname()
	if host == "" {
		host = "unknown-host"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// AcquireLease takes the repository's GC lease: create-only if there is
// none, or If-Match on the ETag of a lease that was released or has
// expired on the store's clock. It returns a *LeaseHeldError (ErrLeaseHeld)
// if another GC holds it. The returned context is cancelled when the lease
// is lost; Release stops renewing and releases it.
func AcquireLease(ctx context.Context, st store.Store, owner string, ttl time.Duration, log *slog.Logger) (*Lease, context.Context, error) {
	if ttl < MinLeaseTTL {
		return nil, nil, fmt.Errorf("lease ttl %s: want at least %s", ttl, MinLeaseTTL)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	l := &Lease{st: st, log: log, owner: owner, ttl: ttl}
	for attempt := 0; ; attempt++ {
		err := l.tryAcquire(ctx)
		if err == nil {
			break
		}
		// The lease vanished between our create and our look at it
		// (deleted by hand): try again, a few times.
		if errors.Is(err, errLeaseVanished) && attempt < 3 {
			continue
		}
		return nil, nil, err
	}
	runCtx, cancel := context.WithCancelCause(ctx)
	l.cancel = cancel
	l.stop = make(chan struct{})
	l.done = make(chan struct{})
	go l.renewLoop(runCtx)
	return l, runCtx, nil
}

var errLeaseVanished = errors.New("lease object vanished")

func (l *Lease) tryAcquire(ctx context.Context) error {
	body := leaseBody{Version: 1, Owner: l.owner, Counter: 1, TTL: l.ttl.String()}
	info, err := l.put(ctx, body, store.PutOptions{CreateOnly: true})
	if err == nil {
		return l.took(ctx, info, body.Counter)
	}
	if !errors.Is(err, store.ErrPrecondition) {
		return fmt.Errorf("acquire GC lease: %w", err)
	}
	cur, err := l.st.Stat(ctx, LeaseKey)
	if errors.Is(err, store.ErrNotFound) {
		return errLeaseVanished
	}
	if err != nil {
		return fmt.Errorf("acquire GC lease: %w", err)
	}
	held, ttl, err := l.read(ctx)
	if errors.Is(err, store.ErrNotFound) {
		return errLeaseVanished
	}
	if err != nil {
		// An unreadable lease expires like any other, by LastModified.
		l.log.Warn("GC lease object is unreadable; treating it as expiring after our TTL", "key", LeaseKey, "err", err)
		held, ttl = leaseBody{Owner: "unknown"}, l.ttl
	}
	if !held.Released {
		now, err := probeClock(ctx, l.st)
		if err != nil {
			return fmt.Errorf("acquire GC lease: read the store's clock: %w", err)
		}
		expires := cur.LastModified.Add(ttl)
		if !now.After(expires.Add(storeResolution)) {
			return &LeaseHeldError{Owner: held.Owner, Expires: expires}
		}
		l.log.Warn("taking over an expired GC lease (a GC crashed or was killed)",
			"owner", held.Owner, "expired", expires.UTC().Format(time.RFC3339))
	}
	body.Counter = held.Counter + 1
	info, err = l.put(ctx, body, store.PutOptions{IfMatch: cur.ETag})
	if errors.Is(err, store.ErrPrecondition) {
		// Someone else took it (or renewed it) first.
		return &LeaseHeldError{Owner: "another GC", Expires: cur.LastModified.Add(ttl)}
	}
	if err != nil {
		return fmt.Errorf("take over GC lease: %w", err)
	}
	return l.took(ctx, info, body.Counter)
}

// took records a successful write and reads the store's clock from it.
func (l *Lease) took(ctx context.Context, info store.ObjectInfo, counter uint64) error {
	l.taken = time.Now()
	st, err := l.st.Stat(ctx, LeaseKey)
	if err != nil {
		return fmt.Errorf("acquire GC lease: read it back: %w", err)
	}
	if info.ETag != "" && st.ETag != info.ETag {
		return &LeaseHeldError{Owner: "another GC", Expires: st.LastModified.Add(l.ttl)}
	}
	l.storeTime = st.LastModified
	l.etag, l.counter, l.lastOK = st.ETag, counter, l.taken
	return nil
}

func (l *Lease) put(ctx context.Context, b leaseBody, opts store.PutOptions) (store.ObjectInfo, error) {
	if b.Expires.IsZero() {
		b.Expires = l.StoreNow().Add(l.ttl)
	}
	enc := b.encode()
	return l.st.Put(ctx, LeaseKey, bytes.NewReader(enc), int64(len(enc)), opts)
}

func (l *Lease) read(ctx context.Context) (leaseBody, time.Duration, error) {
	rc, err := l.st.Get(ctx, LeaseKey, 0, -1)
	if err != nil {
		return leaseBody{}, 0, err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, 64<<10))
	if err != nil {
		return leaseBody{}, 0, err
	}
	return parseLeaseBody(b)
}

// StoreTime is the store's clock when the lease was taken.
func (l *Lease) StoreTime() time.Time { return l.storeTime }

// StoreNow estimates the store's clock now: the time the lease was taken
// plus the local monotonic time since. Before the lease is taken it is the
// local clock (used only for the informational expiry in the body).
func (l *Lease) StoreNow() time.Time {
	if l.storeTime.IsZero() {
		return time.Now()
	}
	return l.storeTime.Add(time.Since(l.taken))
}

// Valid reports whether the lease is still ours by a safe margin: the last
// confirmed write is less than half a TTL old (local monotonic clock), and
// nothing has told us it is lost. Deletes check it first.
func (l *Lease) Valid() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lost != nil {
		return l.lost
	}
	if age := time.Since(l.lastOK); age >= l.ttl/2 {
		return fmt.Errorf("%w: not renewed for %s", ErrLeaseLost, age.Round(time.Millisecond))
	}
	return nil
}

// renewEvery is how often the lease is renewed; a failed renewal is
// retried every second until half the TTL has passed since the last good
// one, and then the run is stopped.
func (l *Lease) renewEvery() time.Duration { return l.ttl / 4 }

func (l *Lease) renewLoop(ctx context.Context) {
	defer close(l.done)
	wait := l.renewEvery()
	for {
		t := time.NewTimer(wait)
		select {
		case <-l.stop:
			t.Stop()
			return
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		err := l.renew(ctx)
		if err == nil {
			wait = l.renewEvery()
			continue
		}
		if ctx.Err() != nil {
			return
		}
		l.mu.Lock()
		age := time.Since(l.lastOK)
		if errors.Is(err, store.ErrPrecondition) || age >= l.ttl/2 {
			l.lost = fmt.Errorf("%w: %w", ErrLeaseLost, err)
			l.mu.Unlock()
			l.log.Error("GC lease lost; stopping", "err", err)
			l.cancel(l.lost)
			return
		}
		l.mu.Unlock()
		l.log.Warn("GC lease renewal failed; retrying", "err", err)
		wait = time.Second
	}
}

func (l *Lease) renew(ctx context.Context) error {
	l.mu.Lock()
	etag, counter := l.etag, l.counter+1
	l.mu.Unlock()
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, l.ttl/4)
	defer cancel()
	info, err := l.put(rctx, leaseBody{Version: 1, Owner: l.owner, Counter: counter, TTL: l.ttl.String()}, store.PutOptions{IfMatch: etag})
	if err != nil {
		return err
	}
	if info.ETag == "" {
		if info, err = l.st.Stat(rctx, LeaseKey); err != nil {
			return err
		}
	}
	l.mu.Lock()
	l.etag, l.counter, l.lastOK = info.ETag, counter, start
	l.mu.Unlock()
	return nil
}

// Release stops renewing and marks the lease released (If-Match on our
// ETag, so a lease someone else took over is left alone). It never deletes
// the object: a delete cannot be conditional, and could remove a lease that
// was taken over a moment before.
func (l *Lease) Release(ctx context.Context) (err error) {
	l.released.Do(func() { err = l.release(ctx) })
	return err
}

func (l *Lease) release(ctx context.Context) error {
	close(l.stop)
	<-l.done
	defer l.cancel(context.Canceled)
	l.mu.Lock()
	etag, counter, lost := l.etag, l.counter+1, l.lost
	l.mu.Unlock()
	if lost != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	_, err := l.put(ctx, leaseBody{Version: 1, Owner: l.owner, Counter: counter, TTL: l.ttl.String(), Released: true}, store.PutOptions{IfMatch: etag})
	if errors.Is(err, store.ErrPrecondition) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("release GC lease: %w", err)
	}
	return nil
}

// probeClock reads the store's clock without holding anything: it writes a
// tiny object, reads its LastModified and deletes it. Stale probes (from a
// process killed in between) are removed by the next GC that holds the
// lease.
func probeClock(ctx context.Context, st store.Store) (time.Time, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return time.Time{}, err
	}
	key := clockProbePrefix + hex.EncodeToString(b[:])
	body := []byte("agentstate clock probe\n")
	if _, err := st.Put(ctx, key, bytes.NewReader(body), int64(len(body)), store.PutOptions{CreateOnly: true}); err != nil {
		return time.Time{}, err
	}
	info, err := st.Stat(ctx, key)
	derr := st.Delete(context.WithoutCancel(ctx), []string{key})
	if err != nil {
		return time.Time{}, err
	}
	if derr != nil {
		return time.Time{}, derr
	}
	return info.LastModified, nil
}

// isClockProbe reports whether key is a clock probe.
func isClockProbe(key string) bool {
	rest, ok := strings.CutPrefix(key, clockProbePrefix)
	if !ok || len(rest) != 16 {
		return false
	}
	_, err := hex.DecodeString(rest)
	return err == nil
}
