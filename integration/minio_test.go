package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/agentstate/agentstate/store"
)

// minioVersion is the MinIO server the tests run against when they start
// their own: a pseudo-version of github.com/minio/minio, built with
// `go install` (MinIO no longer publishes binaries for every release).
const minioVersion = "v0.0.0-20260212201848-7aac2a2c5b7c"

const s3TestRegion = "us-east-1"

// server is the S3 endpoint every test in this package uses, set up once
// by TestMain. s3SkipReason is set instead when there is none.
var (
	s3Srv        *s3Server
	s3SkipReason string
)

type s3Server struct {
	endpoint  string // "http://127.0.0.1:PORT"
	addr      string // "127.0.0.1:PORT"
	accessKey string
	secretKey string
	admin     *minio.Client
	proc      *minioProc // nil for an external server
}

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	srv, err := setupServer()
	if err != nil {
		if os.Getenv("CI") == "true" {
			fmt.Fprintf(os.Stderr, "integration: MinIO is required when CI=true: %v\n", err)
			return 1
		}
		s3SkipReason = fmt.Sprintf("no MinIO: %v", err)
		fmt.Printf("integration: skipping integration tests: %s\n", s3SkipReason)
	}
	s3Srv = srv
	code := m.Run()
	if srv != nil && srv.proc != nil {
		srv.proc.stop()
	}
	return code
}

func setupServer() (*s3Server, error) {
	if ep := os.Getenv("AGENTSTATE_TEST_S3_ENDPOINT"); ep != "" {
		srv := &s3Server{
			endpoint:  strings.TrimSuffix(ep, "/"),
			accessKey: os.Getenv("AGENTSTATE_TEST_S3_ACCESS_KEY"),
			secretKey: os.Getenv("AGENTSTATE_TEST_S3_SECRET_KEY"),
		}
		srv.addr = strings.TrimPrefix(strings.TrimPrefix(srv.endpoint, "http://"), "https://")
		if err := srv.connect(); err != nil {
			return nil, fmt.Errorf("AGENTSTATE_TEST_S3_ENDPOINT=%s: %w", ep, err)
		}
		fmt.Printf("integration: S3 endpoint %s (external, from AGENTSTATE_TEST_S3_ENDPOINT)\n", srv.endpoint)
		return srv, nil
	}

	bin, err := minioBinary()
	if err != nil {
		return nil, err
	}
	proc, err := startMinIO(bin)
	if err != nil {
		return nil, err
	}
	srv := &s3Server{
		endpoint:  "http://" + proc.addr,
		addr:      proc.addr,
		accessKey: proc.user,
		secretKey: proc.password,
		proc:      proc,
	}
	if err := srv.connect(); err != nil {
		proc.stop()
		return nil, err
	}
	fmt.Printf("integration: MinIO %s at %s\n", minioBinaryVersion(bin), proc.addr)
	return srv, nil
}

// connect makes the admin client that creates and removes test buckets,
// and checks the credentials work.
func (s *s3Server) connect() error {
	secure := strings.HasPrefix(s.endpoint, "https://")
	c, err := minio.New(s.addr, &minio.Options{
		Creds:        credentials.NewStaticV4(s.accessKey, s.secretKey, ""),
		Secure:       secure,
		Region:       s3TestRegion,
		BucketLookup: minio.BucketLookupPath,
	})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.ListBuckets(ctx); err != nil {
		return fmt.Errorf("list buckets: %w", err)
	}
	s.admin = c
	return nil
}

// minioBinary finds the MinIO server binary, installing the pinned
// version into the cache if needed.
func minioBinary() (string, error) {
	if p := os.Getenv("AGENTSTATE_MINIO_BIN"); p != "" {
		if !minioIsExecutable(p) {
			return "", fmt.Errorf("AGENTSTATE_MINIO_BIN=%s is not an executable file", p)
		}
		return p, nil
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("find cache directory: %w", err)
		}
		cache = filepath.Join(home, ".cache")
	}
	dir := filepath.Join(cache, "agentstate", "minio-"+minioVersion)
	bin := filepath.Join(dir, "minio")
	if minioIsExecutable(bin) {
		return bin, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	// One installer at a time: test binaries of several packages may
	// start together, and a second `go install` would only compete.
	lock, err := os.OpenFile(filepath.Join(dir, ".install.lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	if minioIsExecutable(bin) {
		return bin, nil // installed by whoever held the lock
	}
	if err := installMinIO(dir); err != nil {
		return "", err
	}
	return bin, nil
}

// installMinIO builds the pinned MinIO into a scratch GOBIN and renames it
// into dir, so a killed install never leaves a truncated binary behind.
func installMinIO(dir string) error {
	goTool, err := exec.LookPath("go")
	if err != nil {
		return fmt.Errorf("MinIO is not installed and there is no go command to install it: %w", err)
	}
	scratch, err := os.MkdirTemp(dir, ".install-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(scratch)
	logPath := filepath.Join(dir, "install.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	fmt.Printf("integration: installing MinIO %s into %s (takes a few minutes; log in %s)\n", minioVersion, dir, logPath)
	start := time.Now()
	cmd := exec.Command(goTool, "install", "github.com/minio/minio@"+minioVersion)
	cmd.Dir = scratch // outside any module, so only the pinned version counts
	cmd.Env = append(os.Environ(), "GOBIN="+scratch, "CGO_ENABLED=0", "GOWORK=off")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go install github.com/minio/minio@%s: %w\n%s", minioVersion, err, minioLogTail(logPath, 20))
	}
	if err := os.Rename(filepath.Join(scratch, "minio"), filepath.Join(dir, "minio")); err != nil {
		return err
	}
	fmt.Printf("integration: installed MinIO in %s\n", time.Since(start).Round(time.Second))
	return nil
}

func minioIsExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// minioBinaryVersion is what `minio --version` says; a `go install` build
// calls itself DEVELOPMENT, so the pinned module version is added.
func minioBinaryVersion(bin string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, bin, "--version").Output()
	line, _, _ := strings.Cut(string(out), "\n")
	line = strings.TrimSpace(strings.TrimPrefix(line, "minio version "))
	if os.Getenv("AGENTSTATE_MINIO_BIN") == "" && strings.HasPrefix(line, "DEVELOPMENT") {
		return minioVersion
	}
	return line
}

// minioProc is a MinIO server this test binary started.
type minioProc struct {
	cmd      *exec.Cmd
	done     chan struct{} // closed when the process has exited
	addr     string
	user     string
	password string
	tmp      string // data, certs and log
}

func startMinIO(bin string) (*minioProc, error) {
	var lastErr error
	// A free port can be taken between choosing and binding it: retry.
	for range 3 {
		p, err := tryStartMinIO(bin)
		if err == nil {
			return p, nil
		}
		lastErr = err
	}
	return nil, lastErr
}

func tryStartMinIO(bin string) (*minioProc, error) {
	tmp, err := os.MkdirTemp("", "agentstate-minio-")
	if err != nil {
		return nil, err
	}
	port, err := minioFreePort()
	if err != nil {
		return nil, err
	}
	consolePort, err := minioFreePort()
	if err != nil {
		return nil, err
	}
	p := &minioProc{
		addr:     fmt.Sprintf("127.0.0.1:%d", port),
		user:     "agentstate-test",
		password: "test-" + minioRandomHex(12),
		tmp:      tmp,
		done:     make(chan struct{}),
	}
	logPath := filepath.Join(tmp, "minio.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	dataDir := filepath.Join(tmp, "data")
	p.cmd = exec.Command(bin, "server",
		"--address", p.addr,
		"--console-address", fmt.Sprintf("127.0.0.1:%d", consolePort),
		"--certs-dir", filepath.Join(tmp, "certs"),
		dataDir)
	p.cmd.Env = append(withoutMinIOEnv(os.Environ()),
		"MINIO_ROOT_USER="+p.user,
		"MINIO_ROOT_PASSWORD="+p.password,
		"MINIO_BROWSER=off",
		"MINIO_UPDATE=off",
	)
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	// Its own process group, so stop can signal everything it started.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	setPdeathsig(p.cmd.SysProcAttr)
	if err := p.cmd.Start(); err != nil {
		os.RemoveAll(tmp)
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	if err := p.waitLive(60 * time.Second); err != nil {
		p.stop()
		return nil, fmt.Errorf("MinIO at %s: %w\n%s", p.addr, err, minioLogTail(logPath, 20))
	}
	return p, nil
}

func (p *minioProc) waitLive(timeout time.Duration) error {
	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(timeout)
	for {
		resp, err := client.Get("http://" + p.addr + "/minio/health/live")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-p.done:
			return errors.New("server exited during startup")
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not live after %s", timeout)
		}
	}
}

// stop ends the server's process group (SIGTERM, then SIGKILL) and removes
// its data.
func (p *minioProc) stop() {
	pgid := p.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-p.done
	}
	os.RemoveAll(p.tmp)
}

// setPdeathsig has Linux kill MinIO if this test binary dies without
// reaching stop (go test's timeout panics past TestMain's cleanup). The
// field exists only on Linux and this file builds everywhere, hence
// reflection.
func setPdeathsig(a *syscall.SysProcAttr) {
	if f := reflect.ValueOf(a).Elem().FieldByName("Pdeathsig"); f.IsValid() && f.CanSet() {
		f.Set(reflect.ValueOf(syscall.SIGKILL))
	}
}

func withoutMinIOEnv(env []string) []string {
	var out []string
	for _, kv := range env {
		if !strings.HasPrefix(kv, "MINIO_") {
			out = append(out, kv)
		}
	}
	return out
}

func minioFreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func minioRandomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// tail returns the last n lines of a file, for error messages.
func minioLogTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	var lines []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// requireS3 skips the test when there is no s3Srv.
func requireS3(t testing.TB) {
	t.Helper()
	if s3Srv == nil {
		t.Skip(s3SkipReason)
	}
}

// minioAddr is the server's host:port, "" without a s3Srv.
func minioAddr() string {
	if s3Srv == nil {
		return ""
	}
	return s3Srv.addr
}

// newBucket creates a fresh bucket for the test, removed with everything
// in it when the test ends. It returns the store URL (a prefix in that
// bucket) and the environment a subprocess needs to reach it.
func newBucket(t testing.TB) (storeURL string, env []string) {
	t.Helper()
	requireS3(t)
	name := s3BucketName(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s3Srv.admin.MakeBucket(ctx, name, minio.MakeBucketOptions{Region: s3TestRegion}); err != nil {
		t.Fatalf("create bucket %s: %v", name, err)
	}
	t.Cleanup(func() { s3RemoveBucket(t, name) })
	env = []string{
		"AWS_ENDPOINT_URL_S3=" + s3Srv.endpoint,
		"AWS_ACCESS_KEY_ID=" + s3Srv.accessKey,
		"AWS_SECRET_ACCESS_KEY=" + s3Srv.secretKey,
		"AWS_REGION=" + s3TestRegion,
		// Never fall back to instance metadata, which would be traffic
		// off this machine, if a subprocess drops the keys.
		"AWS_EC2_METADATA_DISABLED=true",
	}
	return "s3://" + name + "/repo", env
}

func s3RemoveBucket(t testing.TB, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// MinIO deletes a bucket with its objects in one request; other
	// servers need it emptied first.
	if err := s3Srv.admin.RemoveBucketWithOptions(ctx, name, minio.RemoveBucketOptions{ForceDelete: true}); err == nil {
		return
	}
	objects := s3Srv.admin.ListObjects(ctx, name, minio.ListObjectsOptions{Recursive: true})
	for rerr := range s3Srv.admin.RemoveObjects(ctx, name, objects, minio.RemoveObjectsOptions{}) {
		t.Logf("cleanup %s: remove %s: %v", name, rerr.ObjectName, rerr.Err)
	}
	if err := s3Srv.admin.RemoveBucket(ctx, name); err != nil {
		t.Logf("cleanup: remove bucket %s: %v", name, err)
	}
}

// bucketName makes a valid, unique bucket name from a test name.
func s3BucketName(testName string) string {
	var b strings.Builder
	dash := true // no leading dash
	for _, r := range strings.ToLower(testName) {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
			dash = false
		} else if !dash {
			b.WriteByte('-')
			dash = true
		}
	}
	name := strings.TrimRight(b.String(), "-")
	if len(name) > 45 {
		name = strings.TrimRight(name[:45], "-")
	}
	if name == "" {
		name = "t"
	}
	return name + "-" + minioRandomHex(4)
}

// s3Options are the store options for the test s3Srv.
func s3Options() store.Options {
	return store.Options{
		Endpoint:        s3Srv.endpoint,
		Region:          s3TestRegion,
		AccessKeyID:     s3Srv.accessKey,
		SecretAccessKey: s3Srv.secretKey,
		DisableIMDS:     true,
	}
}

// openS3 opens storeURL (from newBucket) as a store.
func openS3(t testing.TB, storeURL string) store.Store {
	t.Helper()
	requireS3(t)
	s, err := store.Open(context.Background(), storeURL, s3Options())
	if err != nil {
		t.Fatalf("open %s: %v", storeURL, err)
	}
	return s
}
