package gc

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Policy decides which manifests of one lineage are retained. A manifest is
// retained if any rule keeps it; the newest manifest of a lineage is always
// retained, whatever the policy. A rule of 0 is disabled.
//
// The time rules use windows ending now on the store's clock, and calendar
// buckets in UTC: KeepHourly 24 keeps, for every UTC hour, the newest
// manifest of that hour whose age is under 24 h. Ages only grow and a
// bucket's newest manifest is only ever replaced by a newer one, so a
// manifest once retired is never retained again: retention is monotone,
// which is what lets a later sweep trust an earlier mark.
type Policy struct {
	// KeepLast keeps the newest N manifests.
	KeepLast int `json:"keep_last"`
	// KeepHourly keeps the newest manifest of each UTC hour, for manifests
	// younger than N hours.
	KeepHourly int `json:"keep_hourly"`
	// KeepDaily keeps the newest manifest of each UTC day, for manifests
	// younger than N days.
	KeepDaily int `json:"keep_daily"`
}

// DefaultPolicy keeps the last 3 manifests, one per hour for 24 hours and
// one per day for 7 days.
func DefaultPolicy() Policy { return Policy{KeepLast: 3, KeepHourly: 24, KeepDaily: 7} }

// maxRule bounds every rule: 100 years of hours, far past any use, and far
// below a time.Duration overflow.
const maxRule = 100 * 366 * 24

// Validate refuses negative or absurd rules.
func (p Policy) Validate() error {
	var errs []error
	for _, r := range []struct {
		name string
		v    int
	}{{"keep-last", p.KeepLast}, {"keep-hourly", p.KeepHourly}, {"keep-daily", p.KeepDaily}} {
		if r.v < 0 || r.v > maxRule {
			errs = append(errs, fmt.Errorf("%s %d: want 0 (disabled) to %d", r.name, r.v, maxRule))
		}
	}
	return errors.Join(errs...)
}

// String describes the policy for messages.
func (p Policy) String() string {
	var parts []string
	if p.KeepLast > 0 {
		parts = append(parts, fmt.Sprintf("the last %d", p.KeepLast))
	}
	if p.KeepHourly > 0 {
		parts = append(parts, fmt.Sprintf("one per hour for %d h", p.KeepHourly))
	}
	if p.KeepDaily > 0 {
		parts = append(parts, fmt.Sprintf("one per day for %d d", p.KeepDaily))
	}
	if len(parts) == 0 {
		return "keep only the newest"
	}
	return "keep " + strings.Join(parts, ", ") + " and the newest"
}

// Item is one manifest as retention sees it: its sequence number and the
// time it was committed (the manifest object's LastModified, store clock).
type Item struct {
	Seq  uint64    `json:"seq"`
	Time time.Time `json:"time"`
}

// Decision is what the policy decided for one manifest, with the rules
// that keep it.
type Decision struct {
	Seq     uint64    `json:"seq"`
	Time    time.Time `json:"time"`
	Keep    bool      `json:"keep"`
	Reasons []string  `json:"reasons,omitempty"`
}

// Reasons a Decision keeps a manifest.
const (
	ReasonNewest = "newest"
	ReasonLast   = "last"
	ReasonHourly = "hourly"
	ReasonDaily  = "daily"
)

// Retain applies p to the manifests of one lineage at time now (store clock)
// and returns one decision per distinct sequence, newest first. It is a pure
// function: the same input gives the same answer.
func Retain(items []Item, p Policy, now time.Time) []Decision {
	ds := make([]Decision, 0, len(items))
	for _, it := range items {
		ds = append(ds, Decision{Seq: it.Seq, Time: it.Time})
	}
	slices.SortFunc(ds, func(a, b Decision) int { return cmp.Compare(b.Seq, a.Seq) })
	ds = slices.CompactFunc(ds, func(a, b Decision) bool { return a.Seq == b.Seq })
	keep := func(i int, why string) {
		ds[i].Keep = true
		ds[i].Reasons = append(ds[i].Reasons, why)
	}
	for i := range ds {
		if i == 0 {
			keep(i, ReasonNewest)
		}
		if i < p.KeepLast {
			keep(i, ReasonLast)
		}
	}
	bucketRule(ds, p.KeepHourly, time.Hour, now, func(t time.Time) string {
		return ReasonHourly + " " + t.Format("2006-01-02T15")
	}, keep)
	bucketRule(ds, p.KeepDaily, 24*time.Hour, now, func(t time.Time) string {
		return ReasonDaily + " " + t.Format("2006-01-02")
	}, keep)
	return ds
}

// bucketRule keeps, for each calendar bucket (named by name of the UTC
// time), the newest manifest in it, if that manifest is younger than n
// units. ds is sorted newest first, so the first one met in a bucket is its
// newest. A manifest from the future (a skewed writer) has age 0.
func bucketRule(ds []Decision, n int, unit time.Duration, now time.Time, name func(time.Time) string, keep func(int, string)) {
	if n <= 0 {
		return
	}
	window := time.Duration(n) * unit
	seen := map[string]bool{}
	for i := range ds {
		b := name(ds[i].Time.UTC())
		if seen[b] {
			continue
		}
		seen[b] = true
		if now.Sub(ds[i].Time) < window {
			keep(i, b)
		}
	}
}
