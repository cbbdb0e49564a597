package store

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// errInvalidKey is wrapped by every key or prefix rejection, so callers and
// tests can tell a caller bug from a storage failure.
var errInvalidKey = errors.New("invalid key")

// CheckKey reports whether key is valid in every backend: non-empty, valid
// UTF-8, '/'-separated segments that are neither empty nor "." or "..", no
// leading or trailing '/', and no control characters. The rules are the
// intersection of what a file system and S3 accept, so a repository written
// to one backend can be copied to another key for key. Control characters
// are refused because S3's multi-object delete is an XML document that
// cannot carry most of them.
func CheckKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: empty", errInvalidKey)
	}
	if err := checkChars(key); err != nil {
		return err
	}
	if strings.HasPrefix(key, "/") || strings.HasSuffix(key, "/") {
		return fmt.Errorf("%w %q: leading or trailing '/'", errInvalidKey, key)
	}
	for seg := range strings.SplitSeq(key, "/") {
		if err := checkSegment(key, seg); err != nil {
			return err
		}
	}
	return nil
}

// checkPrefix validates a List prefix: "" or a key-like string whose
// complete segments (those followed by '/') are valid key segments. The last,
// partial segment only filters names, so it may be anything CheckKey allows
// in a segment, including empty.
func checkPrefix(prefix string) error {
	if prefix == "" {
		return nil
	}
	if err := checkChars(prefix); err != nil {
		return err
	}
	if strings.HasPrefix(prefix, "/") {
		return fmt.Errorf("%w prefix %q: leading '/'", errInvalidKey, prefix)
	}
	segs := strings.Split(prefix, "/")
	for _, seg := range segs[:len(segs)-1] {
		if err := checkSegment(prefix, seg); err != nil {
			return err
		}
	}
	return nil
}

func checkChars(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w %q: not valid UTF-8", errInvalidKey, s)
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return fmt.Errorf("%w %q: control character", errInvalidKey, s)
		}
	}
	return nil
}

func checkSegment(key, seg string) error {
	switch seg {
	case "":
		return fmt.Errorf("%w %q: empty path segment", errInvalidKey, key)
	case ".", "..":
		return fmt.Errorf("%w %q: %q segment", errInvalidKey, key, seg)
	}
	return nil
}
