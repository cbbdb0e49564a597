//go:build linux

package supervisor

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// sampleLine is one sample of the text exposition format.
var sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*\})? (\S+)$`)

// scrape serves m over HTTP, GETs it, checks the format line by line and
// returns every sample by "name{labels}".
func scrape(t *testing.T, m *Metrics) map[string]float64 {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
		t.Errorf("content type %q", ct)
	}
	out := map[string]float64{}
	typed := map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "# TYPE ") {
			f := strings.Fields(line)
			if len(f) != 4 {
				t.Errorf("bad TYPE line %q", line)
				continue
			}
			if _, dup := typed[f[2]]; dup {
				t.Errorf("metric %s typed twice", f[2])
			}
			typed[f[2]] = f[3]
			continue
		}
		if strings.HasPrefix(line, "# HELP ") {
			continue
		}
		mm := sampleLine.FindStringSubmatch(line)
		if mm == nil {
			t.Errorf("bad sample line %q", line)
			continue
		}
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(mm[1], "_bucket"), "_sum"), "_count")
		if typed[mm[1]] == "" && typed[base] != "histogram" {
			t.Errorf("sample %q before its TYPE", line)
		}
		v, err := strconv.ParseFloat(mm[3], 64)
		if err != nil {
			t.Errorf("bad value in %q", line)
		}
		out[mm[1]+mm[2]] = v
	}
	return out
}

func TestMetricsScrape(t *testing.T) {
	o := fast("/bin/sleep", "30")
	o.Interval = 20 * time.Millisecond
	o.Metrics = NewMetrics()
	cp := &fakeCP{failFirst: 1, results: []AdapterResult{
		{Adapter: "codex", Bytes: 1000, Requests: 3},
		{Adapter: `we"ird\name`, Bytes: 1, Requests: 1},
	}}
	r := startRun(t, context.Background(), cp, o)
	eventually(t, 10*time.Second, "3 checkpoints", func() bool { return cp.count("") >= 3 })
	before := float64(time.Now().Add(-time.Minute).Unix())
	m := scrape(t, o.Metrics)
	n := m["agentstate_checkpoints_total"]
	if n < 3 || m["agentstate_checkpoint_duration_seconds_count"] != n || m[`agentstate_checkpoint_duration_seconds_bucket{le="+Inf"}`] != n {
		t.Errorf("checkpoint counts: %v", m)
	}
	if m["agentstate_checkpoint_failures_total"] != 1 || m[`agentstate_adapter_checkpoint_failures_total{adapter="codex"}`] != 1 {
		t.Errorf("failures: %v", m)
	}
	if got := m[`agentstate_uploaded_bytes_total{adapter="codex"}`]; got != 1000*n {
		t.Errorf("bytes %v, want %v", got, 1000*n)
	}
	if got := m[`agentstate_upload_requests_total{adapter="we\"ird\\name"}`]; got != n {
		t.Errorf("requests of the escaped adapter %v, want %v (%v)", got, n, m)
	}
	if ts := m[`agentstate_adapter_last_success_timestamp_seconds{adapter="codex"}`]; ts < before {
		t.Errorf("last success %v", ts)
	}
	if m["agentstate_child_up"] != 1 || m["agentstate_child_restarts_total"] != 0 {
		t.Errorf("child: %v", m)
	}
	r.sigs <- syscall.SIGTERM
	r.wait(t)
	if m := scrape(t, o.Metrics); m["agentstate_child_up"] != 0 {
		t.Errorf("child_up %v after exit", m["agentstate_child_up"])
	}
}

func TestMetricsFormat(t *testing.T) {
	m := NewMetrics()
	m.observeCheckpoint(75*time.Millisecond, nil, []AdapterResult{{Adapter: "a", Bytes: 5, Requests: 2}}, time.Unix(1700000000, 500e6))
	m.observeCheckpoint(3*time.Second, errors.New("x"), []AdapterResult{{Adapter: "a", Err: errors.New("x")}, {Adapter: "b\nc"}}, time.Unix(1700000010, 0))
	var b strings.Builder
	if _, err := m.WriteTo(&b); err != nil {
		t.Fatal(err)
	}
	text := b.String()
	for _, want := range []string{
		"# TYPE agentstate_checkpoint_duration_seconds histogram\n",
		`agentstate_checkpoint_duration_seconds_bucket{le="0.05"} 0` + "\n",
		`agentstate_checkpoint_duration_seconds_bucket{le="0.1"} 1` + "\n",
		`agentstate_checkpoint_duration_seconds_bucket{le="5"} 2` + "\n",
		"agentstate_checkpoint_duration_seconds_sum 3.075\n",
		"agentstate_checkpoint_last_duration_seconds 3\n",
		"agentstate_checkpoint_last_success_timestamp_seconds 1.7000000005e+09\n",
		`agentstate_adapter_last_success_timestamp_seconds{adapter="a"} 1.7000000005e+09` + "\n",
		`agentstate_adapter_last_success_timestamp_seconds{adapter="b\nc"} 1.70000001e+09` + "\n",
		`agentstate_adapter_checkpoint_failures_total{adapter="a"} 1` + "\n",
		`agentstate_uploaded_bytes_total{adapter="a"} 5` + "\n",
		"agentstate_checkpoint_failures_total 1\n",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("missing %q in\n%s", want, text)
		}
	}
	var nilM *Metrics
	nilM.observeCheckpoint(time.Second, nil, nil, time.Now())
	nilM.restarted()
	if n, err := nilM.WriteTo(io.Discard); n != 0 || err != nil {
		t.Errorf("nil metrics wrote %d, %v", n, err)
	}
}
