package segments

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/agentstate/agentstate/store"
)

// memStore is an in-memory Putter and Getter with fault injection, for
// tests that must not depend on a real backend.
type memStore struct {
	mu   sync.Mutex
	objs map[string][]byte

	// putErr, if set, decides the outcome of put number n (1-based) of
	// key before it is applied; a nil result lets the put proceed.
	putErr func(key string, n int) error
	// hold, if set, makes every Put wait until it is closed (or ctx ends).
	hold chan struct{}

	puts     map[string]int // attempts per key
	inflight int
	maxIn    int
	gets     []getCall
}

type getCall struct {
	key            string
	offset, length int64
}

var errTransient = errors.New("injected transient failure")

func newMemStore() *memStore {
	return &memStore{objs: make(map[string][]byte), puts: make(map[string]int)}
}

func (m *memStore) String() string { return "memstore" }

func (m *memStore) Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts store.PutOptions) (store.ObjectInfo, error) {
	m.mu.Lock()
	m.puts[key]++
	n := m.puts[key]
	m.inflight++
	m.maxIn = max(m.maxIn, m.inflight)
	hold, putErr := m.hold, m.putErr
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		m.inflight--
		m.mu.Unlock()
	}()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return store.ObjectInfo{}, ctx.Err()
		}
	}
	if err := ctx.Err(); err != nil {
		return store.ObjectInfo{}, err
	}
	if putErr != nil {
		if err := putErr(key, n); err != nil {
			return store.ObjectInfo{}, err
		}
	}
	data, err := io.ReadAll(body)
	if err != nil {
		return store.ObjectInfo{}, err
	}
	if int64(len(data)) != size {
		return store.ObjectInfo{}, fmt.Errorf("put %s: body is %d bytes, size says %d", key, len(data), size)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.objs[key]; ok && opts.CreateOnly {
		return store.ObjectInfo{}, fmt.Errorf("put %s: %w", key, store.ErrPrecondition)
	}
	m.objs[key] = data
	return store.ObjectInfo{Key: key, Size: size}, nil
}

func (m *memStore) Get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.gets = append(m.gets, getCall{key, offset, length})
	data, ok := m.objs[key]
	if !ok {
		return nil, fmt.Errorf("get %s: %w", key, store.ErrNotFound)
	}
	if offset < 0 || offset > int64(len(data)) {
		return nil, fmt.Errorf("get %s at %d: %w", key, offset, store.ErrInvalidRange)
	}
	end := int64(len(data))
	if length >= 0 && offset+length < end {
		end = offset + length
	}
	return io.NopCloser(bytes.NewReader(data[offset:end])), nil
}

// object returns a copy of the stored object key.
func (m *memStore) object(key string) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return bytes.Clone(m.objs[key])
}

func (m *memStore) set(key string, data []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.objs[key] = data
}

func (m *memStore) putCount(key string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.puts[key]
}

func (m *memStore) getCalls() []getCall {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]getCall(nil), m.gets...)
}

func (m *memStore) resetGets() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.gets = nil
}

// putterFunc is a Putter that consumes the body and reports the call.
type putterFunc func(ctx context.Context, key string, opts store.PutOptions) error

func (f putterFunc) Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts store.PutOptions) (store.ObjectInfo, error) {
	if _, err := io.Copy(io.Discard, body); err != nil {
		return store.ObjectInfo{}, err
	}
	return store.ObjectInfo{Key: key, Size: size}, f(ctx, key, opts)
}
