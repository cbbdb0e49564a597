package supervisor

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// durationBuckets are the upper bounds (seconds) of the checkpoint duration
// histogram: an idle checkpoint takes milliseconds, a large first upload minutes.
var durationBuckets = []float64{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}

// Metrics is a tiny Prometheus text-exposition registry for one supervisor.
// All methods are safe for concurrent use; a nil *Metrics does nothing.
type Metrics struct {
	mu           sync.Mutex
	checkpoints  uint64
	failures     uint64
	lastDuration float64
	lastSuccess  float64 // unix seconds, 0 = never
	buckets      []uint64
	sum          float64
	restarts     uint64
	childUp      bool
	adapters     map[string]*adapterMetrics
}

type adapterMetrics struct {
	bytes, requests uint64
	failures        uint64
	lastSuccess     float64
}

// NewMetrics returns an empty registry.
func NewMetrics() *Metrics {
	return &Metrics{buckets: make([]uint64, len(durationBuckets)), adapters: map[string]*adapterMetrics{}}
}

// observeCheckpoint records one checkpoint of all adapters.
func (m *Metrics) observeCheckpoint(d time.Duration, err error, results []AdapterResult, now time.Time) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	s := d.Seconds()
	m.checkpoints++
	m.lastDuration = s
	m.sum += s
	for i, le := range durationBuckets {
		if s <= le {
			m.buckets[i]++
		}
	}
	ts := float64(now.UnixNano()) / 1e9
	if err != nil {
		m.failures++
	} else {
		m.lastSuccess = ts
	}
	for _, r := range results {
		a := m.adapters[r.Adapter]
		if a == nil {
			a = &adapterMetrics{}
			m.adapters[r.Adapter] = a
		}
		a.bytes += uint64(max(r.Bytes, 0))
		a.requests += uint64(max(r.Requests, 0))
		if r.Err != nil {
			a.failures++
		} else {
			a.lastSuccess = ts
		}
	}
}

func (m *Metrics) restarted() {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.restarts++
	m.mu.Unlock()
}

func (m *Metrics) setChildUp(up bool) {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.childUp = up
	m.mu.Unlock()
}

// WriteTo writes the metrics in the Prometheus text exposition format 0.0.4.
func (m *Metrics) WriteTo(w io.Writer) (int64, error) {
	cw := &countWriter{w: w}
	bw := bufio.NewWriter(cw)
	if m != nil {
		m.write(bw)
	}
	err := bw.Flush()
	return cw.n, err
}

func (m *Metrics) write(w *bufio.Writer) {
	m.mu.Lock()
	defer m.mu.Unlock()
	head := func(name, typ, help string) {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	one := func(name, typ, help string, v float64) {
		head(name, typ, help)
		fmt.Fprintf(w, "%s %s\n", name, formatFloat(v))
	}
	one("agentstate_checkpoints_total", "counter", "Checkpoints (of all adapters) attempted.", float64(m.checkpoints))
	one("agentstate_checkpoint_failures_total", "counter", "Checkpoints that failed (retried at the next tick).", float64(m.failures))
	one("agentstate_checkpoint_last_duration_seconds", "gauge", "Duration of the last checkpoint.", m.lastDuration)
	one("agentstate_checkpoint_last_success_timestamp_seconds", "gauge", "Unix time of the last successful checkpoint of all adapters; 0 if none yet.", m.lastSuccess)

	head("agentstate_checkpoint_duration_seconds", "histogram", "Duration of checkpoints.")
	for i, le := range durationBuckets {
		fmt.Fprintf(w, "agentstate_checkpoint_duration_seconds_bucket{le=\"%s\"} %d\n", formatFloat(le), m.buckets[i])
	}
	fmt.Fprintf(w, "agentstate_checkpoint_duration_seconds_bucket{le=\"+Inf\"} %d\n", m.checkpoints)
	fmt.Fprintf(w, "agentstate_checkpoint_duration_seconds_sum %s\n", formatFloat(m.sum))
	fmt.Fprintf(w, "agentstate_checkpoint_duration_seconds_count %d\n", m.checkpoints)

	names := make([]string, 0, len(m.adapters))
	for n := range m.adapters {
		names = append(names, n)
	}
	slices.Sort(names)
	perAdapter := func(name, typ, help string, v func(*adapterMetrics) float64) {
		if len(names) == 0 {
			return
		}
		head(name, typ, help)
		for _, n := range names {
			fmt.Fprintf(w, "%s{adapter=\"%s\"} %s\n", name, escapeLabel(n), formatFloat(v(m.adapters[n])))
		}
	}
	perAdapter("agentstate_adapter_last_success_timestamp_seconds", "gauge", "Unix time of the adapter's last successful checkpoint; 0 if none yet.",
		func(a *adapterMetrics) float64 { return a.lastSuccess })
	perAdapter("agentstate_adapter_checkpoint_failures_total", "counter", "Failed checkpoints of the adapter.",
		func(a *adapterMetrics) float64 { return float64(a.failures) })
	perAdapter("agentstate_uploaded_bytes_total", "counter", "Bytes uploaded to the store by checkpoints.",
		func(a *adapterMetrics) float64 { return float64(a.bytes) })
	perAdapter("agentstate_upload_requests_total", "counter", "Store requests made by checkpoints.",
		func(a *adapterMetrics) float64 { return float64(a.requests) })

	one("agentstate_child_restarts_total", "counter", "Restarts of the harness after it exited unexpectedly.", float64(m.restarts))
	up := 0.0
	if m.childUp {
		up = 1
	}
	one("agentstate_child_up", "gauge", "1 while the harness process runs.", up)
}

// Handler serves the metrics (for --metrics-addr).
func (m *Metrics) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		if r.Method == http.MethodHead {
			return
		}
		_, _ = m.WriteTo(w)
	})
}

func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

var labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)

func escapeLabel(s string) string { return labelEscaper.Replace(s) }

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
