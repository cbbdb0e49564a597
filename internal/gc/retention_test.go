package gc

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func TestRetain(t *testing.T) {
	now := time.Date(2030, 6, 10, 12, 30, 0, 0, time.UTC)
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	// every15 returns n manifests 15 minutes apart, the newest at now-start.
	every := func(n int, step, start time.Duration) []Item {
		var items []Item
		for i := range n {
			items = append(items, Item{Seq: uint64(n - i), Time: ago(start + time.Duration(i)*step)})
		}
		return items
	}
	tests := []struct {
		name   string
		items  []Item
		policy Policy
		keep   []uint64 // sequences kept
	}{
		{"empty", nil, DefaultPolicy(), nil},
		{"single is the newest", []Item{{Seq: 7, Time: ago(1000 * time.Hour)}}, Policy{}, []uint64{7}},
		{"all rules disabled keep only the newest", every(10, time.Minute, 0), Policy{}, []uint64{10}},
		{"keep last 3", every(10, time.Minute, 0), Policy{KeepLast: 3}, []uint64{10, 9, 8}},
		{"keep last more than there are", every(2, time.Minute, 0), Policy{KeepLast: 5}, []uint64{2, 1}},
		{"unsorted input", []Item{{3, ago(3 * time.Minute)}, {5, ago(time.Minute)}, {4, ago(2 * time.Minute)}}, Policy{KeepLast: 2}, []uint64{5, 4}},
		{
			// seq 12, 11, 10 at 12:30, 12:15, 12:00; 9..6 at 11:45..11:00; ...
			"hourly keeps the newest of each hour",
			every(12, 15*time.Minute, 0), Policy{KeepHourly: 24},
			[]uint64{12, 9, 5, 1},
		},
		{
			"hourly window ends: older hours are retired",
			every(12, 15*time.Minute, 0), Policy{KeepHourly: 2},
			// hour 12's newest (seq 12, age 0), hour 11's (seq 9, age 45m)
			// and hour 10's (seq 5, age 1h45m) are younger than 2 h; hour
			// 9's newest (seq 1, age 2h45m) is not.
			[]uint64{12, 9, 5},
		},
		{
			"daily keeps the newest of each day for N days",
			every(10, 24*time.Hour, 0), Policy{KeepDaily: 3},
			[]uint64{10, 9, 8},
		},
		{
			"daily buckets are UTC days, not 24 h spans",
			[]Item{{4, ago(30 * time.Minute)}, {3, ago(11 * time.Hour)}, {2, ago(13 * time.Hour)}, {1, ago(14 * time.Hour)}},
			Policy{KeepDaily: 7},
			// 12:00 and 01:30 on the 10th; 23:30 and 22:30 on the 9th.
			[]uint64{4, 2},
		},
		{
			"rules combine",
			every(100, 15*time.Minute, 0), Policy{KeepLast: 3, KeepHourly: 3, KeepDaily: 2},
			// last 3: 100 99 98; hourly, the newest of hours 12, 11, 10, 9
			// (ages 0, 45m, 1h45m, 2h45m, all under 3 h): 100 97 93 89;
			// daily: today's 100 and yesterday's newest (23:45 on the 9th: 49).
			[]uint64{100, 99, 98, 97, 93, 89, 49},
		},
		{
			"a manifest from the future counts as age 0",
			[]Item{{2, now.Add(time.Hour)}, {1, ago(30 * time.Minute)}}, Policy{KeepHourly: 1},
			[]uint64{2, 1},
		},
		{
			"duplicate sequences are one decision",
			[]Item{{2, ago(time.Minute)}, {2, ago(time.Minute)}, {1, ago(2 * time.Minute)}}, Policy{},
			[]uint64{2},
		},
		{
			"idle lineage: the time rules expire but keep-last holds",
			every(10, time.Minute, 30*24*time.Hour), DefaultPolicy(),
			[]uint64{10, 9, 8},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ds := Retain(tt.items, tt.policy, now)
			var keep []uint64
			for i, d := range ds {
				if i > 0 && ds[i-1].Seq <= d.Seq {
					t.Fatalf("decisions not newest first: %v", ds)
				}
				if d.Keep != (len(d.Reasons) > 0) {
					t.Fatalf("seq %d: keep %v with reasons %v", d.Seq, d.Keep, d.Reasons)
				}
				if d.Keep {
					keep = append(keep, d.Seq)
				}
			}
			if !slices.Equal(keep, tt.keep) {
				t.Fatalf("kept %v, want %v\n%v", keep, tt.keep, ds)
			}
			if len(ds) > 0 && !slices.Contains(ds[0].Reasons, ReasonNewest) {
				t.Fatalf("newest not marked newest: %v", ds[0])
			}
		})
	}
}

func TestRetainReasons(t *testing.T) {
	now := time.Date(2030, 6, 10, 12, 30, 0, 0, time.UTC)
	ds := Retain([]Item{{2, now.Add(-time.Minute)}, {1, now.Add(-2 * time.Hour)}}, DefaultPolicy(), now)
	got := strings.Join(ds[0].Reasons, ",")
	if got != "newest,last,hourly 2030-06-10T12,daily 2030-06-10" {
		t.Fatalf("reasons of the newest: %s", got)
	}
	if got := strings.Join(ds[1].Reasons, ","); got != "last,hourly 2030-06-10T10" {
		t.Fatalf("reasons of the second: %s", got)
	}
}

// TestRetainMonotone: once retired, a manifest is never retained again as
// time passes and newer manifests arrive; this is what lets a sweep trust
// the mark of an earlier run.
func TestRetainMonotone(t *testing.T) {
	start := time.Date(2030, 6, 1, 0, 0, 0, 0, time.UTC)
	p := Policy{KeepLast: 2, KeepHourly: 5, KeepDaily: 2}
	var items []Item
	retired := map[uint64]bool{}
	seq := uint64(0)
	for step := range 400 {
		now := start.Add(time.Duration(step) * 7 * time.Minute)
		if step%3 != 0 { // irregular commits
			seq++
			items = append(items, Item{Seq: seq, Time: now})
		}
		for _, d := range Retain(items, p, now) {
			if d.Keep && retired[d.Seq] {
				t.Fatalf("step %d: seq %d was retired and is retained again (%v)", step, d.Seq, d.Reasons)
			}
			if !d.Keep {
				retired[d.Seq] = true
			}
		}
		// Deleting retired manifests must not change the decisions either.
		items = slices.DeleteFunc(items, func(it Item) bool { return retired[it.Seq] })
	}
	if len(retired) == 0 {
		t.Fatal("nothing was ever retired")
	}
}

func TestPolicyValidate(t *testing.T) {
	if err := DefaultPolicy().Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (Policy{}).Validate(); err != nil {
		t.Fatal(err)
	}
	for _, p := range []Policy{{KeepLast: -1}, {KeepHourly: -1}, {KeepDaily: maxRule + 1}} {
		if p.Validate() == nil {
			t.Fatalf("%+v: no error", p)
		}
	}
}
