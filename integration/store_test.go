package integration

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/minio/minio-go/v7"

	"github.com/agentstate/agentstate/store"
	"github.com/agentstate/agentstate/store/storetest"
)

func TestStoreConformance(t *testing.T) {
	requireS3(t)
	storetest.Run(t, func(t *testing.T) store.Store {
		u, _ := newBucket(t)
		return openS3(t, u)
	})
}

// TestStoreS3AnonymousRefused: minio-go's credential chain falls back to
// anonymous requests when it finds nothing; the store must refuse instead,
// and say what to set.
func TestStoreS3AnonymousRefused(t *testing.T) {
	u, _ := newBucket(t)
	t.Setenv("HOME", t.TempDir()) // no ~/.aws
	for _, k := range []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
		"AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
		"AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	opts := store.Options{Endpoint: s3Srv.endpoint, Region: s3TestRegion, DisableIMDS: true}

	_, err := store.Open(t.Context(), u, opts)
	if !errors.Is(err, store.ErrNoCredentials) {
		t.Fatalf("Open without credentials: err = %v, want ErrNoCredentials", err)
	}
	for _, want := range []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not tell the user to set %s", err, want)
		}
	}

	// Allowed explicitly, anonymous requests are made, and a private
	// bucket refuses them: an error, not "not found" or "precondition".
	opts.AllowAnonymous = true
	s, err := store.Open(t.Context(), u, opts)
	if err != nil {
		t.Fatalf("Open with AllowAnonymous: %v", err)
	}
	_, err = s.Put(t.Context(), "k", strings.NewReader("x"), 1, store.PutOptions{CreateOnly: true})
	if err == nil || errors.Is(err, store.ErrPrecondition) {
		t.Errorf("anonymous put to a private bucket: err = %v, want access denied", err)
	}
	if _, err := s.Stat(t.Context(), "k"); err == nil || errors.Is(err, store.ErrNotFound) {
		t.Errorf("anonymous stat in a private bucket: err = %v, want access denied", err)
	}
}

// TestStoreS3FromEnv opens the store the way the CLI does, from the
// environment newBucket hands to subprocesses.
func TestStoreS3FromEnv(t *testing.T) {
	u, env := newBucket(t)
	vars := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		vars[k] = v
	}
	s, err := store.Open(t.Context(), u, store.OptionsFromEnv(func(k string) string { return vars[k] }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(t.Context(), "config", strings.NewReader("v1"), 2, store.PutOptions{CreateOnly: true}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(s.String(), s3Srv.secretKey) || !strings.Contains(s.String(), s3Srv.addr) {
		t.Errorf("String() = %q: want the endpoint and no secret", s)
	}
}

// TestStoreS3Prefix: a store's prefix is a folder, not a string prefix, and
// List strips it.
func TestStoreS3Prefix(t *testing.T) {
	u, _ := newBucket(t)
	bucket := strings.TrimPrefix(strings.TrimSuffix(u, "/repo"), "s3://")
	a := openS3(t, "s3://"+bucket+"/repo")
	b := openS3(t, "s3://"+bucket+"/repo2") // "repo" is a string prefix of "repo2"
	root := openS3(t, "s3://"+bucket)
	for _, s := range []store.Store{a, b} {
		if _, err := s.Put(t.Context(), "k", strings.NewReader("x"), 1, store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	listKeys := func(s store.Store) []string {
		var keys []string
		for info, err := range s.List(t.Context(), "") {
			if err != nil {
				t.Fatal(err)
			}
			keys = append(keys, info.Key)
		}
		return keys
	}
	if got := listKeys(a); !slices.Equal(got, []string{"k"}) {
		t.Errorf("store repo lists %q, want [k]", got)
	}
	if got := listKeys(root); !slices.Equal(got, []string{"repo/k", "repo2/k"}) {
		t.Errorf("bucket root lists %q", got)
	}
	if _, err := s3Srv.admin.StatObject(t.Context(), bucket, "repo/k", minio.StatObjectOptions{}); err != nil {
		t.Errorf("object not under the prefix in the bucket: %v", err)
	}
}

func TestStoreS3MissingBucket(t *testing.T) {
	requireS3(t)
	s := openS3(t, "s3://agentstate-no-such-bucket-"+minioRandomHex(4)+"/p")
	ctx := t.Context()
	_, err := s.Put(ctx, "k", strings.NewReader("x"), 1, store.PutOptions{CreateOnly: true})
	if err == nil || errors.Is(err, store.ErrNotFound) || errors.Is(err, store.ErrPrecondition) {
		t.Errorf("put into a missing bucket: err = %v", err)
	} else if !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("put into a missing bucket: err = %v, want it to say the bucket does not exist", err)
	}
	// A missing bucket is a configuration error, never "empty": a restore
	// that took it for an empty lineage would start the agent from scratch.
	for _, err := range s.List(ctx, "manifests/") {
		if err == nil || errors.Is(err, store.ErrNotFound) {
			t.Errorf("list in a missing bucket: err = %v, want a bucket error", err)
		}
		break
	}
	if _, err := s.Get(ctx, "k", 0, -1); errors.Is(err, store.ErrNotFound) || err == nil {
		t.Errorf("get in a missing bucket: err = %v, want a bucket error", err)
	}
}

func TestStoreS3WrongSecret(t *testing.T) {
	u, _ := newBucket(t)
	opts := s3Options()
	opts.SecretAccessKey = "wrong-" + minioRandomHex(8)
	s, err := store.Open(t.Context(), u, opts)
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Put(t.Context(), "k", strings.NewReader("x"), 1, store.PutOptions{})
	if err == nil {
		t.Fatal("put with a wrong secret succeeded")
	}
	for _, leak := range []string{opts.SecretAccessKey, s3Srv.secretKey} {
		if strings.Contains(err.Error(), leak) || strings.Contains(s.String(), leak) {
			t.Errorf("secret leaked: err %q, store %q", err, s)
		}
	}
}

// s3FaultProxy sits between the store and MinIO and misbehaves on
// conditional PUTs as fault says. It counts every request it sees.
type s3FaultProxy struct {
	*httptest.Server
	requests atomic.Int64 // all requests
	condPuts atomic.Int64 // conditional PUTs
	forward  http.Handler // to MinIO
}

func newS3FaultProxy(t *testing.T, fault func(p *s3FaultProxy, n int64, w http.ResponseWriter, r *http.Request) bool) *s3FaultProxy {
	t.Helper()
	target, err := url.Parse(s3Srv.endpoint)
	if err != nil {
		t.Fatal(err)
	}
	p := &s3FaultProxy{forward: httputil.NewSingleHostReverseProxy(target)}
	// The signed Host header is the proxy's; NewSingleHostReverseProxy
	// keeps it, so MinIO verifies the signature the client made.
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.requests.Add(1)
		if r.Method == http.MethodPut && (r.Header.Get("If-None-Match") != "" || r.Header.Get("If-Match") != "") {
			if fault(p, p.condPuts.Add(1), w, r) {
				return
			}
		}
		p.forward.ServeHTTP(w, r)
	}))
	t.Cleanup(p.Close)
	return p
}

// applyThenDrop forwards r to MinIO, then drops the connection without an
// answer: the write happened, the client cannot know.
func (p *s3FaultProxy) applyThenDrop(r *http.Request) {
	p.forward.ServeHTTP(httptest.NewRecorder(), r)
	panic(http.ErrAbortHandler)
}

func openS3Via(t *testing.T, p *s3FaultProxy, storeURL string) store.Store {
	t.Helper()
	opts := s3Options()
	opts.Endpoint = p.URL
	s, err := store.Open(t.Context(), storeURL, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestStoreS3CreateOnlyAmbiguousRetry: a create-only PUT that the server
// applied but whose answer was lost is retried, meets 412, and must be
// recognised as our own write; one where someone else's write got in must
// still fail.
func TestStoreS3CreateOnlyAmbiguousRetry(t *testing.T) {
	u, _ := newBucket(t)
	direct := openS3(t, u)

	t.Run("own write", func(t *testing.T) {
		p := newS3FaultProxy(t, func(p *s3FaultProxy, n int64, w http.ResponseWriter, r *http.Request) bool {
			if n == 1 {
				p.applyThenDrop(r)
			}
			return false
		})
		s := openS3Via(t, p, u)
		if got := p.requests.Load(); got != 0 {
			t.Errorf("Open made %d requests, want 0", got)
		}
		body := []byte("manifest 1 by writer A")
		if _, err := s.Put(t.Context(), "manifests/l/1", bytes.NewReader(body), int64(len(body)), store.PutOptions{CreateOnly: true}); err != nil {
			t.Fatalf("put whose first answer was lost: %v", err)
		}
		if p.condPuts.Load() != 2 {
			t.Errorf("%d conditional PUTs, want 2 (the lost one and the retry)", p.condPuts.Load())
		}
		if got := storeGet(t, direct, "manifests/l/1"); got != string(body) {
			t.Errorf("content %q", got)
		}
	})

	t.Run("someone else's write", func(t *testing.T) {
		p := newS3FaultProxy(t, func(p *s3FaultProxy, n int64, w http.ResponseWriter, r *http.Request) bool {
			if n == 1 {
				// Writer B commits first, then our request is lost.
				other := []byte("manifest 2 by writer B")
				if _, err := direct.Put(r.Context(), "manifests/l/2", bytes.NewReader(other), int64(len(other)), store.PutOptions{CreateOnly: true}); err != nil {
					t.Error(err)
				}
				panic(http.ErrAbortHandler)
			}
			return false
		})
		s := openS3Via(t, p, u)
		body := []byte("manifest 2 by writer A")
		_, err := s.Put(t.Context(), "manifests/l/2", bytes.NewReader(body), int64(len(body)), store.PutOptions{CreateOnly: true})
		if !errors.Is(err, store.ErrPrecondition) {
			t.Fatalf("err = %v, want ErrPrecondition", err)
		}
		if got := storeGet(t, direct, "manifests/l/2"); got != "manifest 2 by writer B" {
			t.Errorf("content %q, want writer B's", got)
		}
	})
}

// TestStoreS3ConditionalConflict: 409 ConditionalRequestConflict is retried;
// if it persists the put fails with ErrPrecondition.
func TestStoreS3ConditionalConflict(t *testing.T) {
	u, _ := newBucket(t)
	conflict := func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusConflict)
		io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict</Code><Message>A conflicting conditional operation is currently in progress against this resource.</Message></Error>`)
	}
	t.Run("transient", func(t *testing.T) {
		p := newS3FaultProxy(t, func(p *s3FaultProxy, n int64, w http.ResponseWriter, r *http.Request) bool {
			if n <= 2 {
				conflict(w)
				return true
			}
			return false
		})
		s := openS3Via(t, p, u)
		if _, err := s.Put(t.Context(), "a", strings.NewReader("x"), 1, store.PutOptions{CreateOnly: true}); err != nil {
			t.Fatalf("put after two conflicts: %v", err)
		}
	})
	t.Run("persistent", func(t *testing.T) {
		p := newS3FaultProxy(t, func(p *s3FaultProxy, n int64, w http.ResponseWriter, r *http.Request) bool {
			conflict(w)
			return true
		})
		s := openS3Via(t, p, u)
		_, err := s.Put(t.Context(), "b", strings.NewReader("x"), 1, store.PutOptions{CreateOnly: true})
		if !errors.Is(err, store.ErrPrecondition) {
			t.Fatalf("err = %v, want ErrPrecondition", err)
		}
		if n := p.condPuts.Load(); n < 2 || n > 10 {
			t.Errorf("%d attempts, want a few", n)
		}
	})
}

func storeGet(t *testing.T, s store.Store, key string) string {
	t.Helper()
	rc, err := s.Get(context.Background(), key, 0, -1)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
