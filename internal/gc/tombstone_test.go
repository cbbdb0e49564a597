package gc

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/manifest"
	"github.com/agentstate/agentstate/segments"
)

func TestTombstoneRoundTrip(t *testing.T) {
	now := time.Date(2030, 6, 1, 12, 0, 0, 123456789, time.UTC)
	entries := []Entry{
		{Key: segments.Key(segments.Sum([]byte("a"))), Size: 10, Modified: now.Add(-time.Hour)},
		{Key: segments.Key(segments.Sum([]byte("b"))), Size: 20, Modified: now.Add(-2 * time.Hour)},
	}
	b, err := encodeTombstone(tombHeader{Kind: KindSegments, By: ByGC, Created: now, Owner: "o"}, entries)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeTombstone(b, ByGC, KindSegments)
	if err != nil {
		t.Fatal(err)
	}
	if got.header.Count != 2 || got.header.Bytes != 30 || got.header.By != ByGC || len(got.entries) != 2 {
		t.Fatalf("decoded %+v", got)
	}
	for i := range entries {
		if got.entries[i].Key != entries[i].Key || got.entries[i].Size != entries[i].Size || !got.entries[i].Modified.Equal(entries[i].Modified) {
			t.Fatalf("entry %d: %+v, want %+v", i, got.entries[i], entries[i])
		}
	}
	if _, err := decodeTombstone(b, ByGC, KindManifests); !errors.Is(err, errTombstone) {
		t.Fatalf("kind mismatch: %v", err)
	}
	if _, err := decodeTombstone(b, ByForget, KindSegments); !errors.Is(err, errTombstone) {
		t.Fatalf("writer mismatch: %v", err)
	}
	// Any changed byte is caught by the checksum; truncation too.
	for _, i := range []int{0, len(b) / 2, len(b) - 3} {
		bad := bytes.Clone(b)
		bad[i] ^= 1
		if _, err := decodeTombstone(bad, ByGC, KindSegments); !errors.Is(err, errTombstone) {
			t.Fatalf("flipped byte %d: %v", i, err)
		}
	}
	for _, n := range []int{0, 1, len(b) / 2, len(b) - 1} {
		if _, err := decodeTombstone(b[:n], ByGC, KindSegments); !errors.Is(err, errTombstone) {
			t.Fatalf("truncated to %d: %v", n, err)
		}
	}
	// Another version is recognised as such (left alone, not deleted).
	v2 := bytes.Replace(b, []byte(`{"v":1,`), []byte(`{"v":2,`), 1)
	body := v2[:bytes.LastIndex(v2[:len(v2)-1], []byte("\n"))+1]
	v2, _ = encodeRaw(body)
	if _, err := decodeTombstone(v2, ByGC, KindSegments); !errors.Is(err, errTombstoneVersion) {
		t.Fatalf("version 2: %v", err)
	}
}

// encodeRaw adds a valid trailer to an arbitrary body.
func encodeRaw(body []byte) ([]byte, error) {
	sum := segments.Sum(body) // SHA-256, as the trailer is
	return append(append(bytes.Clone(body), tombTrailerPrefix+sum.String()...), '\n'), nil
}

func TestTombstoneKey(t *testing.T) {
	now := time.Date(2030, 6, 1, 12, 0, 0, 5, time.UTC)
	k, err := newTombstoneKey(now, ByForget, KindManifests)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(k, "tombstones/20300601T120000.000000005Z-") || !strings.HasSuffix(k, ".forget-manifests") {
		t.Fatalf("key %q", k)
	}
	tk, ok := parseTombstoneKey(k)
	if !ok || tk.Kind != KindManifests || tk.By != ByForget || !tk.Time.Equal(now) {
		t.Fatalf("parse %q: %+v %v", k, tk, ok)
	}
	later, _ := newTombstoneKey(now.Add(time.Nanosecond), ByGC, KindSegments)
	if later <= k {
		t.Fatalf("keys do not sort by time: %q <= %q", later, k)
	}
	if tk, ok := parseTombstoneKey(later); !ok || tk.By != ByGC || tk.Kind != KindSegments {
		t.Fatalf("parse %q: %+v", later, tk)
	}
	const ts = "tombstones/20300601T120000.000000005Z-0123456789abcdef"
	for _, bad := range []string{
		"tombstones/x", ts, ts + ".segments", ts + ".gc-other", ts + ".forget-segments", ts + ".someone-manifests",
		"tombstones/20300601T120000.000000005Z-0123456789abcdeg.gc-segments",
		"tombstones/2030-06-01-0123456789abcdef.gc-segments", "other/20300601T120000.000000005Z-0123456789abcdef.gc-segments",
	} {
		if _, ok := parseTombstoneKey(bad); ok {
			t.Fatalf("%q parsed", bad)
		}
	}
}

func TestParseKeys(t *testing.T) {
	id := segments.Sum([]byte("x"))
	if got, ok := parseSegmentKey(segments.Key(id)); !ok || got != id {
		t.Fatal("segment key not parsed")
	}
	h := id.String()
	for _, bad := range []string{"segments/" + h, "segments/00/" + h, "segments/" + h[:2] + "/" + h + "x",
		"segments/" + h[:2] + "/" + strings.ToUpper(h), "config", "segments/" + h[:2] + "/" + h[:63]} {
		if _, ok := parseSegmentKey(bad); ok {
			t.Fatalf("%q parsed as a segment key", bad)
		}
	}
	if l, seq, ok := parseManifestKey(manifest.Key("a.b-c", 42)); !ok || l != "a.b-c" || seq != 42 {
		t.Fatal("manifest key not parsed")
	}
	for _, bad := range []string{"manifests/a/42", "manifests/a/00000000000000000000", "manifests/a/b/00000000000000000001",
		"manifests/-a/00000000000000000001", "manifests//00000000000000000001", "manifests/a/0000000000000000000x"} {
		if _, _, ok := parseManifestKey(bad); ok {
			t.Fatalf("%q parsed as a manifest key", bad)
		}
	}
}

func TestListPages(t *testing.T) {
	entries := func(prefixes int) []Entry {
		var es []Entry
		for i := range prefixes {
			es = append(es, Entry{Key: fmt.Sprintf("segments/%02x/x", i)})
		}
		return es
	}
	for _, tc := range []struct {
		listed   int64
		prefixes int
		want     int64
	}{
		{0, 3, 1},         // an older tombstone without the count
		{500, 1, 1},       // one page
		{256_000, 256, 1}, // 1000 keys per prefix
		{2_560_000, 256, 10},
		{40_000, 4, 10},
	} {
		got := listPages(&tombstone{header: tombHeader{Listed: tc.listed}, entries: entries(tc.prefixes)})
		if got != tc.want {
			t.Errorf("listed %d over %d prefixes: %d pages, want %d", tc.listed, tc.prefixes, got, tc.want)
		}
	}
}
