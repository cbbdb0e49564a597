package store

import (
	"context"
	"crypto/md5"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"iter"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/minio/minio-go/v7/pkg/s3utils"
)

// ErrNoCredentials: no credentials were found for the s3 backend and
// anonymous access was not allowed. minio-go's credential chain silently
// falls back to anonymous requests, which fail later with a confusing
// AccessDenied (or, worse, succeed against a public bucket); the s3
// backend refuses up front instead.
var ErrNoCredentials = errors.New("no S3 credentials found")

const (
	awsEndpoint = "s3.amazonaws.com"
	// defaultCustomRegion is assumed for a custom endpoint without a
	// region. It is MinIO's default, and setting any region saves the
	// GetBucketLocation round trip minio-go makes otherwise.
	defaultCustomRegion = "us-east-1"
	// Bounds on one store operation, so an unreachable store fails a
	// checkpoint instead of hanging it: each request must connect within
	// dialTimeout and see headers within headerTimeout; each operation,
	// retries included, ends within opTimeout plus its body at opRate.
	dialTimeout    = 10 * time.Second
	headerTimeout  = 30 * time.Second
	opTimeout      = time.Minute
	opRate         = 1 << 20 // bytes per second, a floor no working link is below
	clientAttempts = 5

	// credentialTimeout bounds credential lookups that go over the network
	// (instance metadata, container credentials, STS), which on a machine
	// without them can otherwise hang until a TCP timeout.
	credentialTimeout = 5 * time.Second
	// condAttempts bounds attempts of one conditional put.
	condAttempts = 5
	// deleteBatch is the most keys one S3 DeleteObjects request takes.
	deleteBatch = 1000
)

// Options configure the s3 backend. The zero value means AWS, region from
// the bucket, credentials from the shared credentials file or an IAM role.
// Options never prints its secrets: String, GoString and LogValue redact
// them.
type Options struct {
	// Endpoint is the S3 API's base URL: "https://host[:port]", or
	// "http://host:port" for a local server (no TLS). Empty means AWS
	// (s3.amazonaws.com, virtual-host-style). Any other endpoint is
	// addressed path-style, which every S3-compatible server supports.
	Endpoint string
	// Region signs requests. Empty means: ask the bucket (one extra request
	// per process) on AWS, "us-east-1" on a custom endpoint.
	Region string
	// AccessKeyID and SecretAccessKey are static credentials; both or
	// neither must be set. SessionToken goes with temporary ones.
	AccessKeyID     string
	SecretAccessKey string
	SessionToken    string
	// Profile and CredentialsFile select a profile of an AWS shared
	// credentials file. Setting either makes that profile the only source:
	// a user who names a profile wants that one, not a silent fallback.
	Profile         string
	CredentialsFile string
	// AllowAnonymous permits unsigned requests when no credentials are
	// found, for public buckets. Without it that is ErrNoCredentials.
	AllowAnonymous bool
	// DisableIMDS skips the EC2 instance metadata service when looking for
	// an IAM role (container and web-identity credentials configured by
	// environment still work). AWS_EC2_METADATA_DISABLED=true sets it.
	DisableIMDS bool
	// CABundle is a PEM file of extra CAs to trust for an https endpoint
	// (AWS_CA_BUNDLE), as for a MinIO with a private CA.
	CABundle string
	// Logger receives the backend's rare warnings; nil means slog.Default().
	Logger *slog.Logger
}

// PrivateCredentialVars are agentstate's own names for static S3
// credentials. Set, they win over AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
// and AWS_SESSION_TOKEN, and `agentstate run` never passes them on to the
// harness: an agent that runs tools must not be able to read (or delete)
// the bucket that holds every lineage, while a harness that needs AWS
// credentials of its own (Bedrock) still gets the standard variables.
var PrivateCredentialVars = []string{"AGENTSTATE_S3_ACCESS_KEY_ID", "AGENTSTATE_S3_SECRET_ACCESS_KEY", "AGENTSTATE_S3_SESSION_TOKEN"}

// OptionsFromEnv reads Options from the standard AWS environment variables
// through getenv (os.Getenv in production, a map in tests), with static
// credentials from PrivateCredentialVars first. minio-go itself reads no
// endpoint or region from the environment.
func OptionsFromEnv(getenv func(string) string) Options {
	first := func(names ...string) string {
		for _, n := range names {
			if v := getenv(n); v != "" {
				return v
			}
		}
		return ""
	}
	keys := []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
	if getenv(PrivateCredentialVars[0]) != "" || getenv(PrivateCredentialVars[1]) != "" || getenv(PrivateCredentialVars[2]) != "" {
		keys = PrivateCredentialVars // never half of one set and half of the other
	}
	return Options{
		Endpoint:        first("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
		Region:          first("AWS_REGION", "AWS_DEFAULT_REGION"),
		AccessKeyID:     getenv(keys[0]),
		SecretAccessKey: getenv(keys[1]),
		SessionToken:    getenv(keys[2]),
		Profile:         getenv("AWS_PROFILE"),
		CredentialsFile: getenv("AWS_SHARED_CREDENTIALS_FILE"),
		DisableIMDS:     strings.EqualFold(getenv("AWS_EC2_METADATA_DISABLED"), "true"),
		CABundle:        getenv("AWS_CA_BUNDLE"),
	}
}

// String describes o without secrets: it says whether keys are set, never
// what they are.
func (o Options) String() string {
	set := func(v string) string {
		if v == "" {
			return "unset"
		}
		return "set"
	}
	endpoint := o.Endpoint
	if endpoint == "" {
		endpoint = awsEndpoint
	} else {
		endpoint = redactURL(endpoint)
	}
	return fmt.Sprintf("endpoint=%s region=%q access_key=%s secret_key=%s session_token=%s profile=%q credentials_file=%q allow_anonymous=%t disable_imds=%t",
		endpoint, o.Region, set(o.AccessKeyID), set(o.SecretAccessKey), set(o.SessionToken),
		o.Profile, o.CredentialsFile, o.AllowAnonymous, o.DisableIMDS)
}

// GoString keeps %#v from printing the secret fields.
func (o Options) GoString() string { return "store.Options{" + o.String() + "}" }

// LogValue keeps slog from printing the secret fields.
func (o Options) LogValue() slog.Value { return slog.StringValue(o.String()) }

// S3 is the "s3" backend: objects in one bucket under an optional prefix,
// through minio-go.
//
// LastModified has one-second resolution, the resolution of S3's HTTP
// Last-Modified header.
//
// Every put is a single PUT request (never multipart), because S3 checks
// If-None-Match / If-Match only on a single PUT, and because one request
// per object is what keeps a checkpoint at a few requests. AWS caps a
// single PUT at 5 GiB, far above the repository's segment size.
type S3 struct {
	// client retries transient failures itself (minio-go's default).
	client *minio.Client
	// once makes exactly one attempt per call. Conditional puts retry by
	// hand so they know when an attempt may have been applied before it
	// failed: see putConditional.
	once     *minio.Client
	bucket   string
	prefix   string // "" or ending in '/'
	endpoint string // for String: host or URL, never credentials
	region   string // "" means: ask the bucket
	log      *slog.Logger
}

// OpenS3 opens the s3 store at rawURL, "s3://bucket[/prefix]". It resolves
// credentials (refusing anonymous access unless opts.AllowAnonymous) but
// sends no request to the bucket: opening costs nothing, so an idle
// checkpoint stays at zero requests.
func OpenS3(ctx context.Context, rawURL string, opts Options) (*S3, error) {
	bucket, prefix, err := parseS3URL(rawURL)
	if err != nil {
		return nil, err
	}
	name := strings.TrimSuffix("s3://"+bucket+"/"+prefix, "/")
	host, secure, custom, err := parseEndpoint(opts.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	creds, err := resolveCredentials(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	region := opts.Region
	if region == "" && custom {
		region = defaultCustomRegion
	}
	lookup := minio.BucketLookupAuto // virtual-host style on AWS where the name allows it
	endpoint := host
	if custom {
		lookup = minio.BucketLookupPath
		endpoint = "http://" + host
		if secure {
			endpoint = "https://" + host
		}
	}
	transport, err := minio.DefaultTransport(secure)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	if secure && opts.CABundle != "" {
		pool, err := caPool(opts.CABundle)
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", name, err)
		}
		transport.TLSClientConfig.RootCAs = pool
	}
	// A store that went away must fail a checkpoint in bounded time, so the
	// next tick (or the final checkpoint) can run: minio-go's defaults wait
	// a minute for headers, ten times over.
	transport.DialContext = (&net.Dialer{Timeout: dialTimeout, KeepAlive: 15 * time.Second}).DialContext
	transport.ResponseHeaderTimeout = headerTimeout
	newClient := func(maxRetries int) (*minio.Client, error) {
		return minio.New(host, &minio.Options{
			Creds:        creds,
			Secure:       secure,
			Region:       region,
			BucketLookup: lookup,
			Transport:    transport,
			MaxRetries:   maxRetries,
		})
	}
	client, err := newClient(clientAttempts)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	once, err := newClient(1)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	return &S3{client: client, once: once, bucket: bucket, prefix: prefix, endpoint: endpoint, region: region, log: log}, nil
}

// parseS3URL splits "s3://bucket/a/b" into "bucket" and "a/b/".
func parseS3URL(rawURL string) (bucket, prefix string, err error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", "", fmt.Errorf("store URL %s: %w", redactURL(rawURL), unwrapURLError(err))
	}
	if u.Scheme != "s3" {
		return "", "", fmt.Errorf("store URL %s: want s3://bucket[/prefix]", redactURL(rawURL))
	}
	if u.User != nil {
		return "", "", fmt.Errorf("store URL %s: credentials in the URL are not supported; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", redactURL(rawURL))
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return "", "", fmt.Errorf("store URL %s: query and fragment are not supported; configure the endpoint and region with AWS_ENDPOINT_URL_S3 and AWS_REGION", rawURL)
	}
	bucket = u.Host
	if err := s3utils.CheckValidBucketName(bucket); err != nil {
		return "", "", fmt.Errorf("store URL %s: bucket %q: %w", rawURL, bucket, err)
	}
	p := strings.Trim(u.Path, "/")
	if p != "" {
		if err := CheckKey(p); err != nil {
			return "", "", fmt.Errorf("store URL %s: prefix: %w", rawURL, err)
		}
		p += "/"
	}
	return bucket, p, nil
}

// parseEndpoint turns Options.Endpoint into minio-go's host[:port] and TLS
// flag. custom reports a non-AWS endpoint.
func parseEndpoint(raw string) (host string, secure, custom bool, err error) {
	if raw == "" {
		return awsEndpoint, true, false, nil
	}
	if !strings.Contains(raw, "://") {
		return "", false, false, fmt.Errorf("endpoint %q: want http://host:port or https://host[:port]", redactURL(raw))
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", false, false, fmt.Errorf("endpoint %s: %w", redactURL(raw), unwrapURLError(err))
	}
	switch {
	case u.User != nil:
		return "", false, false, fmt.Errorf("endpoint %s: credentials in the endpoint URL are not supported; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", redactURL(raw))
	case u.Scheme != "http" && u.Scheme != "https":
		return "", false, false, fmt.Errorf("endpoint %q: want http://host:port or https://host[:port]", raw)
	case u.Host == "":
		return "", false, false, fmt.Errorf("endpoint %q: no host", raw)
	case u.Path != "" && u.Path != "/", u.RawQuery != "", u.Fragment != "":
		return "", false, false, fmt.Errorf("endpoint %q: a path, query or fragment is not supported", raw)
	}
	return u.Host, u.Scheme == "https", !s3utils.IsAmazonEndpoint(*u), nil
}

// resolveCredentials picks credentials in order: static keys, a shared
// credentials file profile, an IAM role. It returns ErrNoCredentials rather
// than anonymous credentials unless opts.AllowAnonymous.
func resolveCredentials(ctx context.Context, opts Options) (*credentials.Credentials, error) {
	switch {
	case opts.AccessKeyID != "" && opts.SecretAccessKey != "":
		return credentials.NewStaticV4(opts.AccessKeyID, opts.SecretAccessKey, opts.SessionToken), nil
	case opts.AccessKeyID != "":
		return nil, errors.New("an access key id is set but no secret access key: set AWS_SECRET_ACCESS_KEY, or AGENTSTATE_S3_SECRET_ACCESS_KEY if any AGENTSTATE_S3_ variable is set")
	case opts.SecretAccessKey != "":
		return nil, errors.New("a secret access key is set but no access key id: set AWS_ACCESS_KEY_ID, or AGENTSTATE_S3_ACCESS_KEY_ID if any AGENTSTATE_S3_ variable is set")
	case opts.SessionToken != "":
		return nil, errors.New("a session token is set without an access key id and secret: set both (AGENTSTATE_S3_ACCESS_KEY_ID and AGENTSTATE_S3_SECRET_ACCESS_KEY with AGENTSTATE_S3_SESSION_TOKEN)")
	}
	cc := &credentials.CredContext{Client: &http.Client{Timeout: credentialTimeout}, Context: ctx}
	file := &credentials.FileAWSCredentials{Filename: opts.CredentialsFile, Profile: opts.Profile}

	if opts.Profile != "" || opts.CredentialsFile != "" {
		creds := credentials.New(file)
		v, err := creds.GetWithContext(cc)
		if err != nil || v.AccessKeyID == "" {
			return nil, fmt.Errorf("%w in profile %q of %s: %s", ErrNoCredentials, profileName(opts.Profile), credentialsFileName(opts.CredentialsFile), describeFileError(err))
		}
		return creds, nil
	}

	creds := credentials.NewChainCredentials([]credentials.Provider{
		file,
		&iamProvider{noIMDS: opts.DisableIMDS},
	})
	// The chain never fails: without credentials it answers anonymous.
	if v, err := creds.GetWithContext(cc); err == nil && v.AccessKeyID != "" {
		return creds, nil
	}
	if opts.AllowAnonymous {
		// A fixed anonymous value: the chain would retry every provider,
		// instance metadata included, before each request.
		return credentials.NewStatic("", "", "", credentials.SignatureAnonymous), nil
	}
	return nil, fmt.Errorf("%w: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (and AWS_SHARED_CREDENTIALS_FILE) for a shared credentials file, or run with an IAM role; anonymous access to a public bucket must be allowed explicitly", ErrNoCredentials)
}

func profileName(p string) string {
	if p == "" {
		return "default"
	}
	return p
}

func credentialsFileName(f string) string {
	if f == "" {
		return "the default AWS config and credentials files"
	}
	return f
}

// describeFileError says why a profile gave no credentials without quoting
// the file: an ini parse error can echo a line, and that line can be a key.
func describeFileError(err error) string {
	var pe *fs.PathError
	switch {
	case err == nil:
		return "no aws_access_key_id in the profile"
	case errors.As(err, &pe):
		return pe.Op + ": " + pe.Err.Error()
	default:
		return "the profile is missing or cannot be read"
	}
}

// iamProvider is minio-go's IAM provider (container credentials, web
// identity, EC2 instance metadata) that can skip instance metadata.
type iamProvider struct {
	credentials.IAM
	noIMDS bool
}

var errIMDSDisabled = errors.New("instance metadata disabled")

func (p *iamProvider) RetrieveWithCredContext(cc *credentials.CredContext) (credentials.Value, error) {
	// minio-go's IAM provider reads these from the process environment
	// itself; with none set it falls through to instance metadata.
	if p.noIMDS && os.Getenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") == "" &&
		os.Getenv("AWS_CONTAINER_CREDENTIALS_FULL_URI") == "" && os.Getenv("AWS_WEB_IDENTITY_TOKEN_FILE") == "" {
		return credentials.Value{}, errIMDSDisabled
	}
	return p.IAM.RetrieveWithCredContext(cc)
}

func (p *iamProvider) Retrieve() (credentials.Value, error) {
	return p.RetrieveWithCredContext(nil)
}

// String names the store and its endpoint, never credentials.
func (s *S3) String() string {
	return "s3://" + s.bucket + "/" + strings.TrimSuffix(s.prefix, "/") + " (" + s.endpoint + ")"
}

// Put implements Store. A conditional put is one PUT with If-None-Match: *
// or If-Match: <etag>.
// caPool trusts the system's CAs plus those of a PEM bundle (AWS_CA_BUNDLE),
// as the AWS SDKs do, for an endpoint with a private CA.
func caPool(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("CA bundle (AWS_CA_BUNDLE): %w", err)
	}
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("CA bundle %s (AWS_CA_BUNDLE) holds no PEM certificate", path)
	}
	return pool, nil
}

// bounded gives one operation moving n bytes its deadline.
func bounded(ctx context.Context, n int64) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, opTimeout+time.Duration(max(n, 0)/opRate)*time.Second)
}

func (s *S3) Put(ctx context.Context, key string, body io.ReadSeeker, size int64, opts PutOptions) (ObjectInfo, error) {
	ctx, cancel := bounded(ctx, size)
	defer cancel()
	if err := CheckKey(key); err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	if err := checkPutOptions(opts); err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	start, err := bodyStart(body, size)
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
	}
	if start != 0 {
		body = &offsetReadSeeker{r: body, base: start}
	}
	// The body stays an io.ReadSeeker so minio-go can rewind and retry it;
	// DisableMultipart with the known size makes it one PUT.
	po := minio.PutObjectOptions{DisableMultipart: true}
	if !opts.CreateOnly && opts.IfMatch == "" {
		ui, err := s.client.PutObject(ctx, s.bucket, s.prefix+key, body, size, po)
		if err != nil {
			return ObjectInfo{}, s.wrap("put", key, err)
		}
		return putInfo(key, size, ui), nil
	}
	return s.putConditional(ctx, key, body, size, po, opts)
}

// putConditional makes a conditional PUT, retrying transient failures by
// hand. minio-go's own retries would hide the one case that needs care: an
// attempt can be applied by the server and still fail on the way back (a
// reset connection, a 5xx from a proxy), and the retry then meets a 412
// caused by our own first attempt. So after such an ambiguous failure a 412
// is checked: if the object's ETag is the MD5 of our body (S3's ETag of a
// single-PUT object), the put is reported as done; someone else having
// written the very same bytes is indistinguishable and equally harmless.
//
// 409 ConditionalRequestConflict (another conditional write to the key is
// in flight) is retried with backoff; if it persists, that other write is
// taking the key, and the put fails with ErrPrecondition, which tells the
// caller to re-read, as a 412 would.
func (s *S3) putConditional(ctx context.Context, key string, body io.ReadSeeker, size int64, po minio.PutObjectOptions, opts PutOptions) (ObjectInfo, error) {
	if opts.CreateOnly {
		po.SetMatchETagExcept("*")
	} else {
		po.SetMatchETag(strings.Trim(opts.IfMatch, `"`))
	}
	ambiguous := false // an earlier attempt may have been applied
	for attempt := 1; ; attempt++ {
		if _, err := body.Seek(0, io.SeekStart); err != nil {
			return ObjectInfo{}, fmt.Errorf("put %s: rewind body: %w", key, err)
		}
		ui, err := s.once.PutObject(ctx, s.bucket, s.prefix+key, body, size, po)
		if err == nil {
			return putInfo(key, size, ui), nil
		}
		if ctx.Err() != nil {
			return ObjectInfo{}, fmt.Errorf("put %s: %w", key, ctx.Err())
		}
		var er minio.ErrorResponse
		isResp := errors.As(err, &er)
		switch {
		case isResp && (er.StatusCode == http.StatusPreconditionFailed || er.Code == "PreconditionFailed"),
			// If-Match on a missing key: AWS answers 404, the interface says precondition.
			isResp && opts.IfMatch != "" && er.Code != "NoSuchBucket" && (er.StatusCode == http.StatusNotFound || er.Code == "NoSuchKey"):
			if ambiguous {
				if info, ok := s.ownWrite(ctx, key, body, size); ok {
					s.log.Warn("conditional put failed its precondition after an ambiguous attempt; the object holds our bytes, so that attempt was applied",
						"store", s.String(), "key", key, "attempts", attempt)
					return info, nil
				}
			}
			return ObjectInfo{}, fmt.Errorf("put %s: %w: %w", key, ErrPrecondition, err)
		case isResp && er.StatusCode == http.StatusConflict:
			if attempt >= condAttempts {
				return ObjectInfo{}, fmt.Errorf("put %s: concurrent conditional writes to the key kept conflicting (%d attempts): %w: %w", key, attempt, ErrPrecondition, err)
			}
		case retryable(err):
			// A response of 5xx or none at all: the server may have
			// applied the write. A 429/503 throttle is not ambiguous, but
			// treating it so only costs a HEAD in the rare 412 case.
			ambiguous = true
			if attempt >= condAttempts {
				return ObjectInfo{}, s.wrap("put", key, err)
			}
		default:
			return ObjectInfo{}, s.wrap("put", key, err)
		}
		s.log.Debug("retrying conditional put", "store", s.String(), "key", key, "attempt", attempt, "err", err)
		if err := sleepCtx(ctx, backoff(attempt)); err != nil {
			return ObjectInfo{}, fmt.Errorf("put %s: %w", key, err)
		}
	}
}

// ownWrite reports whether the object at key holds exactly body's bytes.
func (s *S3) ownWrite(ctx context.Context, key string, body io.ReadSeeker, size int64) (ObjectInfo, bool) {
	info, err := s.Stat(ctx, key)
	if err != nil || info.Size != size {
		return ObjectInfo{}, false
	}
	if _, err := body.Seek(0, io.SeekStart); err != nil {
		return ObjectInfo{}, false
	}
	h := md5.New()
	if _, err := io.Copy(h, body); err != nil {
		return ObjectInfo{}, false
	}
	return info, strings.EqualFold(info.ETag, hex.EncodeToString(h.Sum(nil)))
}

// retryable reports whether a failed request is worth another attempt.
func retryable(err error) bool {
	var er minio.ErrorResponse
	if !errors.As(err, &er) {
		// No S3 response: a network failure.
		return !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
	}
	switch er.Code {
	case "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "RequestThrottled":
		return true
	}
	return er.StatusCode >= 500 || er.StatusCode == http.StatusTooManyRequests
}

// backoff is exponential with jitter: 100 ms, 200 ms, ... capped at 2 s.
func backoff(attempt int) time.Duration {
	d := min(100*time.Millisecond<<(attempt-1), 2*time.Second)
	return d/2 + rand.N(d/2+1)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func putInfo(key string, size int64, ui minio.UploadInfo) ObjectInfo {
	// A PUT response carries no Last-Modified; finding the store's clock
	// would cost a HEAD, so LastModified stays zero unless minio-go has it.
	return ObjectInfo{Key: key, Size: size, ETag: ui.ETag, LastModified: ui.LastModified}
}

// Get implements Store with one GET (a ranged one for a part). It uses
// minio-go's Core.GetObject, which sends the request before returning, so a
// missing key or bad range is Get's error; Client.GetObject is lazy and
// would report it on the first Read.
func (s *S3) Get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	if err := CheckKey(key); err != nil {
		return nil, fmt.Errorf("get %s: %w", key, err)
	}
	if offset < 0 {
		return nil, fmt.Errorf("get %s: negative offset %d: %w", key, offset, ErrInvalidRange)
	}
	if length == 0 {
		// HTTP cannot ask for zero bytes; a HEAD still checks the key
		// exists and the offset is inside it.
		return s.emptyAt(ctx, key, offset)
	}
	// The deadline covers reading the body too: it ends when it is closed.
	ctx, cancel := bounded(ctx, length)
	rc, err := s.get(ctx, key, offset, length)
	if err != nil {
		cancel()
		return nil, err
	}
	return readCloser{Reader: rc, Closer: closeFunc(func() error { err := rc.Close(); cancel(); return err })}, nil
}

type closeFunc func() error

func (f closeFunc) Close() error { return f() }

func (s *S3) get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	var o minio.GetObjectOptions
	ranged := offset > 0 || length > 0
	if ranged {
		end := int64(0) // with offset > 0: "bytes=offset-", to the end
		if length > 0 {
			end = offset + length - 1
		}
		if err := o.SetRange(offset, end); err != nil {
			return nil, fmt.Errorf("get %s: %w", key, err)
		}
	}
	body, _, hdr, err := minio.Core{Client: s.client}.GetObject(ctx, s.bucket, s.prefix+key, o)
	if err != nil {
		var er minio.ErrorResponse
		if errors.As(err, &er) && (er.StatusCode == http.StatusRequestedRangeNotSatisfiable || er.Code == "InvalidRange") {
			// 416 also answers a range that starts exactly at the end
			// (or any range of an empty object), which the interface
			// treats as an empty read.
			return s.emptyAt(ctx, key, offset)
		}
		return nil, s.wrap("get", key, err)
	}
	var r io.Reader = body
	if ranged && hdr.Get("Content-Range") == "" && offset > 0 {
		// The server ignored the range and sent the whole object.
		if _, err := io.CopyN(io.Discard, body, offset); err != nil {
			_ = body.Close()
			return nil, fmt.Errorf("get %s: skip to offset %d: %w", key, offset, err)
		}
	}
	if length > 0 {
		r = io.LimitReader(r, length)
	}
	return readCloser{Reader: r, Closer: body}, nil
}

type readCloser struct {
	io.Reader
	io.Closer
}

// emptyAt returns an empty body if offset is within or at the end of key.
func (s *S3) emptyAt(ctx context.Context, key string, offset int64) (io.ReadCloser, error) {
	info, err := s.Stat(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", key, err)
	}
	if offset > info.Size {
		return nil, fmt.Errorf("get %s: offset %d past end %d: %w", key, offset, info.Size, ErrInvalidRange)
	}
	return io.NopCloser(strings.NewReader("")), nil
}

// Stat implements Store with one HEAD.
func (s *S3) Stat(ctx context.Context, key string) (ObjectInfo, error) {
	if err := CheckKey(key); err != nil {
		return ObjectInfo{}, fmt.Errorf("stat %s: %w", key, err)
	}
	ctx, cancel := bounded(ctx, 0)
	defer cancel()
	oi, err := s.client.StatObject(ctx, s.bucket, s.prefix+key, minio.StatObjectOptions{})
	if err != nil {
		return ObjectInfo{}, s.wrap("stat", key, err)
	}
	return ObjectInfo{Key: key, Size: oi.Size, ETag: oi.ETag, LastModified: oi.LastModified}, nil
}

// List implements Store with ListObjectsV2 pages of up to 1000 keys. It
// uses minio-go's iterator form, which fetches a page only when the loop
// wants it and stops with the loop: nothing to drain, no goroutine left.
func (s *S3) List(ctx context.Context, prefix string) iter.Seq2[ObjectInfo, error] {
	return func(yield func(ObjectInfo, error) bool) {
		if err := checkPrefix(prefix); err != nil {
			yield(ObjectInfo{}, fmt.Errorf("list %s: %w", prefix, err))
			return
		}
		noOwner := false
		opts := minio.ListObjectsOptions{Prefix: s.prefix + prefix, Recursive: true, FetchOwner: &noOwner}
		last := ""
		for obj := range s.client.ListObjectsIter(ctx, s.bucket, opts) {
			if obj.Err != nil {
				yield(ObjectInfo{}, s.wrap("list", prefix, obj.Err))
				return
			}
			key, ok := strings.CutPrefix(obj.Key, s.prefix)
			if !ok {
				continue
			}
			// Callers rely on the order (the newest manifest sorts last);
			// a server that breaks it must not go unnoticed.
			if key <= last && last != "" {
				yield(ObjectInfo{}, fmt.Errorf("list %s: server returned %q after %q, out of order", prefix, key, last))
				return
			}
			last = key
			// Truncated to the second, as HEAD's Last-Modified header is:
			// listing XML has milliseconds, and Stat and List must agree.
			info := ObjectInfo{Key: key, Size: obj.Size, ETag: obj.ETag, LastModified: obj.LastModified.Truncate(time.Second)}
			if !yield(info, nil) {
				return
			}
		}
		// minio-go ends a listing silently when the context is cancelled
		// between pages; a truncated listing must not look complete.
		if err := ctx.Err(); err != nil {
			yield(ObjectInfo{}, fmt.Errorf("list %s: %w", prefix, err))
		}
	}
}

// Delete implements Store with DeleteObjects requests of up to 1000 keys.
// Keys that do not exist are not errors. Failures are counted and the first
// one is returned (wrapped), because a failing batch would otherwise
// produce a thousand near-identical messages.
func (s *S3) Delete(ctx context.Context, keys []string) error {
	var failed int
	var first error
	fail := func(err error) {
		failed++
		if first == nil {
			first = err
		}
	}
	for i := 0; i < len(keys); i += deleteBatch {
		batch := keys[i:min(i+deleteBatch, len(keys))]
		ch := make(chan minio.ObjectInfo, len(batch))
		for _, k := range batch {
			if err := CheckKey(k); err != nil {
				fail(fmt.Errorf("delete %s: %w", k, err))
				continue
			}
			ch <- minio.ObjectInfo{Key: s.prefix + k}
		}
		close(ch)
		for rerr := range s.client.RemoveObjects(ctx, s.bucket, ch, minio.RemoveObjectsOptions{}) {
			var er minio.ErrorResponse
			if errors.As(rerr.Err, &er) && er.Code == "NoSuchKey" {
				continue
			}
			fail(s.wrap("delete", strings.TrimPrefix(rerr.ObjectName, s.prefix), rerr.Err))
		}
	}
	if failed == 0 {
		return nil
	}
	return fmt.Errorf("delete %d keys: %d failed, first: %w", len(keys), failed, first)
}

// wrap adds op and key to an error from minio-go and the sentinel the
// interface promises for it. minio.ToErrorResponse does not unwrap, so
// this uses errors.As.
func (s *S3) wrap(op, key string, err error) error {
	where := op
	if key != "" {
		where += " " + key
	}
	var er minio.ErrorResponse
	if !errors.As(err, &er) {
		return fmt.Errorf("%s: %w", where, err)
	}
	switch {
	case er.Code == "NoSuchBucket":
		return fmt.Errorf("%s: bucket %s does not exist at %s: %w", where, s.bucket, s.endpoint, err)
	case er.Code == "NoSuchKey" || er.StatusCode == http.StatusNotFound:
		return fmt.Errorf("%s: %w", where, ErrNotFound)
	case er.Code == "PreconditionFailed" || er.StatusCode == http.StatusPreconditionFailed:
		return fmt.Errorf("%s: %w: %w", where, ErrPrecondition, err)
	case er.Code == "InvalidRange" || er.StatusCode == http.StatusRequestedRangeNotSatisfiable:
		return fmt.Errorf("%s: %w: %w", where, ErrInvalidRange, err)
	}
	if er.Code != "" && !strings.Contains(err.Error(), er.Code) {
		return fmt.Errorf("%s: %w (%s, HTTP %d)", where, err, er.Code, er.StatusCode)
	}
	return fmt.Errorf("%s: %w", where, err)
}

// redactURL removes a userinfo part ("user:secret@") from a URL-ish string
// without parsing it, so it is safe even on input url.Parse rejects.
func redactURL(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return raw
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	if at := strings.LastIndex(rest[:end], "@"); at >= 0 {
		rest = "REDACTED@" + rest[at+1:]
	}
	return scheme + "://" + rest
}

// unwrapURLError drops url.Error's copy of the input, which may hold
// credentials.
func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// EnsureBucket creates the bucket when it does not exist yet. Provisioning
// (`agentstate init`, docker-compose's create-bucket step) uses it; the
// checkpoint path never does, since it must not send requests it does not
// need.
func (s *S3) EnsureBucket(ctx context.Context) error {
	ok, err := s.client.BucketExists(ctx, s.bucket)
	if err != nil {
		return s.wrap("check bucket "+s.bucket, "", err)
	}
	if ok {
		return nil
	}
	err = s.client.MakeBucket(ctx, s.bucket, minio.MakeBucketOptions{Region: s.region})
	var er minio.ErrorResponse
	if errors.As(err, &er) && (er.Code == "BucketAlreadyOwnedByYou" || er.Code == "BucketAlreadyExists") {
		return nil // created by a concurrent init
	}
	if err != nil {
		return s.wrap("create bucket "+s.bucket, "", err)
	}
	s.log.Info("created bucket", "bucket", s.bucket, "endpoint", s.endpoint)
	return nil
}
