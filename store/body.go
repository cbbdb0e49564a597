package store

import (
	"errors"
	"fmt"
	"io"
)

// checkPutOptions refuses contradictory conditions rather than silently
// picking one.
func checkPutOptions(opts PutOptions) error {
	if opts.CreateOnly && opts.IfMatch != "" {
		return errors.New("CreateOnly and IfMatch are mutually exclusive")
	}
	return nil
}

// bodyStart checks that body holds exactly size bytes from its current
// offset, and returns that offset. Checking up front (two seeks, no I/O)
// turns a caller's size mistake into an error before anything is written,
// instead of a truncated object or a request the server rejects half-way.
func bodyStart(body io.ReadSeeker, size int64) (int64, error) {
	if body == nil {
		return 0, errors.New("nil body")
	}
	if size < 0 {
		return 0, fmt.Errorf("negative size %d", size)
	}
	start, err := body.Seek(0, io.SeekCurrent)
	if err != nil {
		return 0, fmt.Errorf("seek body: %w", err)
	}
	end, err := body.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("seek body: %w", err)
	}
	if _, err := body.Seek(start, io.SeekStart); err != nil {
		return 0, fmt.Errorf("seek body: %w", err)
	}
	if end-start != size {
		return 0, fmt.Errorf("body holds %d bytes, size says %d", end-start, size)
	}
	return start, nil
}

// offsetReadSeeker presents the bytes of r from base on as a stream
// starting at 0. minio-go rewinds a retried body with Seek(0, io.SeekStart),
// which would resend the bytes before base of a body that did not start at
// offset 0.
type offsetReadSeeker struct {
	r    io.ReadSeeker
	base int64
}

func (o *offsetReadSeeker) Read(p []byte) (int, error) { return o.r.Read(p) }

func (o *offsetReadSeeker) Seek(offset int64, whence int) (int64, error) {
	if whence == io.SeekStart {
		offset += o.base
	}
	n, err := o.r.Seek(offset, whence)
	return n - o.base, err
}
