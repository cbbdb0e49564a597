// Package store is agentstate's object I/O: one small interface over an
// S3-compatible bucket (backend "s3", minio-go) or a local folder (backend
// "dir", the embedded default), plus request accounting.
//
// Every key is relative to the store's prefix and uses '/' as separator.
// Objects are written whole; the interface has no append and no rename,
// because the repository format never needs them.
package store

import (
	"context"
	"errors"
	"io"
	"iter"
	"time"
)

// Sentinel errors that callers branch on. Backends wrap them with context;
// test with errors.Is.
var (
	// ErrNotFound: the key does not exist.
	ErrNotFound = errors.New("object not found")
	// ErrPrecondition: a conditional put did not hold (the key already
	// exists for a create-only put, or its ETag differs for an If-Match put).
	ErrPrecondition = errors.New("precondition failed")
	// ErrInvalidRange: the requested range starts past the end of the object.
	ErrInvalidRange = errors.New("invalid range")
)

// ObjectInfo describes one stored object. LastModified is on the store's
// clock, which is the clock GC must measure ages against.
type ObjectInfo struct {
	Key          string
	Size         int64
	ETag         string
	LastModified time.Time
}

// PutOptions makes a put conditional. The zero value is an unconditional put.
type PutOptions struct {
	// CreateOnly fails with ErrPrecondition if the key exists
	// (S3 If-None-Match: *). It is one single PUT, never multipart.
	CreateOnly bool
	// IfMatch, when set, fails with ErrPrecondition unless the object exists
	// with this ETag (S3 If-Match). Used to renew leases.
	IfMatch string
}

// Store is the object I/O every backend implements. Implementations are
// safe for concurrent use.
type Store interface {
	// Put writes the object whole from body, which must hold exactly size
	// bytes. body is seekable so a backend can retry a failed attempt.
	Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts PutOptions) (ObjectInfo, error)
	// Get reads length bytes starting at offset; length < 0 reads to the end.
	// A missing key is ErrNotFound, returned by Get itself, not on first Read.
	Get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error)
	// Stat describes one object, or ErrNotFound.
	Stat(ctx context.Context, key string) (ObjectInfo, error)
	// List yields the objects whose key starts with prefix, in ascending
	// lexical (byte) order, streaming: memory does not grow with the count.
	// Stop early by breaking out of the loop.
	List(ctx context.Context, prefix string) iter.Seq2[ObjectInfo, error]
	// Delete removes the keys in bulk. Deleting a missing key is not an error.
	Delete(ctx context.Context, keys []string) error
	// String names the store for messages, never with credentials.
	String() string
}
