package store_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentstate/agentstate/store"
)

const secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"

// staticOpts are credentials that need no network to resolve.
var staticOpts = store.Options{Endpoint: "http://127.0.0.1:9", AccessKeyID: "AKIDEXAMPLE", SecretAccessKey: secret}

func TestOpen(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		url     string
		want    string // String() of the store, "" for an error
		errHas  string // substring of the error
		noMatch string // must not appear in the error
	}{
		{url: dir, want: "file://" + dir},
		{url: "file://" + dir + "/sub", want: "file://" + dir + "/sub"},
		{url: "file://localhost" + dir, want: "file://" + dir},
		{url: "s3://bucket", want: "s3://bucket/ (http://127.0.0.1:9)"},
		{url: "s3://bucket/some/prefix/", want: "s3://bucket/some/prefix (http://127.0.0.1:9)"},
		{url: "", errHas: "s3://bucket"},
		{url: "relative/dir", errHas: "absolute"},
		{url: "./dir", errHas: "file:///"},
		{url: "file://host/x", errHas: "host"},
		{url: "file:relative", errHas: "supported"},
		{url: "gs://bucket", errHas: `unsupported scheme "gs"`},
		{url: "gs://bucket", errHas: "s3://bucket[/prefix]"},
		{url: "s3://AKID:" + secret + "@bucket/p", errHas: "credentials in the URL", noMatch: secret},
		{url: "s3://x/p", errHas: "bucket"},
		{url: "s3://bucket/a/../b", errHas: "prefix"},
		{url: "s3://bucket/p?region=x", errHas: "query"},
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			s, err := store.Open(t.Context(), tt.url, staticOpts)
			if tt.want != "" {
				if err != nil {
					t.Fatalf("Open: %v", err)
				}
				if got := s.String(); got != tt.want {
					t.Errorf("String() = %q, want %q", got, tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("Open succeeded: %v", s)
			}
			if !strings.Contains(err.Error(), tt.errHas) {
				t.Errorf("error %q does not mention %q", err, tt.errHas)
			}
			if tt.noMatch != "" && strings.Contains(err.Error(), tt.noMatch) {
				t.Errorf("error %q leaks %q", err, tt.noMatch)
			}
		})
	}
}

func TestOpenEndpoint(t *testing.T) {
	tests := []struct {
		endpoint string
		want     string
		errHas   string
	}{
		{"", "s3://bkt/ (s3.amazonaws.com)", ""},
		{"https://s3.eu-west-1.amazonaws.com", "s3://bkt/ (s3.eu-west-1.amazonaws.com)", ""},
		{"https://minio.example:9000", "s3://bkt/ (https://minio.example:9000)", ""},
		{"http://127.0.0.1:9000/", "s3://bkt/ (http://127.0.0.1:9000)", ""},
		{"127.0.0.1:9000", "", "http://"},
		{"ftp://host", "", "http://"},
		{"http://host/path", "", "path"},
		{"http://AKID:" + secret + "@host", "", "credentials"},
	}
	for _, tt := range tests {
		t.Run(tt.endpoint, func(t *testing.T) {
			opts := staticOpts
			opts.Endpoint = tt.endpoint
			s, err := store.Open(t.Context(), "s3://bkt", opts)
			if tt.errHas != "" {
				if err == nil || !strings.Contains(err.Error(), tt.errHas) {
					t.Fatalf("err = %v, want one mentioning %q", err, tt.errHas)
				}
				if strings.Contains(err.Error(), secret) {
					t.Errorf("error leaks the secret: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := s.String(); got != tt.want {
				t.Errorf("String() = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestOptionsFromEnv(t *testing.T) {
	tests := []struct {
		name string
		env  map[string]string
		want store.Options
	}{
		{"empty", nil, store.Options{}},
		{
			"everything",
			map[string]string{
				"AWS_ENDPOINT_URL_S3": "http://s3only:9000", "AWS_ENDPOINT_URL": "http://generic:9000",
				"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "us-west-2",
				"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": "tok",
				"AWS_PROFILE": "prof", "AWS_SHARED_CREDENTIALS_FILE": "/creds", "AWS_EC2_METADATA_DISABLED": "TRUE",
			},
			store.Options{
				Endpoint: "http://s3only:9000", Region: "eu-west-1", AccessKeyID: "AKID", SecretAccessKey: secret,
				SessionToken: "tok", Profile: "prof", CredentialsFile: "/creds", DisableIMDS: true,
			},
		},
		{
			"private credentials win, as a set",
			map[string]string{
				"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": "tok",
				"AGENTSTATE_S3_ACCESS_KEY_ID": "MINE", "AGENTSTATE_S3_SECRET_ACCESS_KEY": "my-" + secret,
			},
			store.Options{AccessKeyID: "MINE", SecretAccessKey: "my-" + secret},
		},
		{
			"a private token alone selects the private set",
			map[string]string{"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": secret, "AGENTSTATE_S3_SESSION_TOKEN": "mine"},
			store.Options{SessionToken: "mine"},
		},
		{
			"fallbacks",
			map[string]string{"AWS_ENDPOINT_URL": "http://generic:9000", "AWS_DEFAULT_REGION": "us-west-2", "AWS_EC2_METADATA_DISABLED": "false"},
			store.Options{Endpoint: "http://generic:9000", Region: "us-west-2"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := store.OptionsFromEnv(func(k string) string { return tt.env[k] })
			if got != tt.want {
				t.Errorf("OptionsFromEnv =\n %s\nwant\n %s", got, tt.want)
			}
		})
	}
}

func TestOptionsRedacted(t *testing.T) {
	opts := store.Options{AccessKeyID: "AKIDVISIBLE", SecretAccessKey: secret, SessionToken: "session-" + secret, Endpoint: "http://u:" + secret + "@h"}
	var log strings.Builder
	slog.New(slog.NewTextHandler(&log, nil)).Info("opening", "opts", opts)
	for _, s := range []string{fmt.Sprint(opts), fmt.Sprintf("%v %+v %#v %s", opts, opts, opts, opts), log.String()} {
		for _, leak := range []string{secret, "AKIDVISIBLE"} {
			if strings.Contains(s, leak) {
				t.Errorf("%q leaks %q", s, leak)
			}
		}
	}
	if !strings.Contains(fmt.Sprint(opts), "secret_key=set") {
		t.Errorf("String() = %q does not say the secret is set", opts)
	}
}

func TestOpenCredentials(t *testing.T) {
	// No credentials anywhere: an empty HOME, no AWS variables, and no
	// instance metadata (which would also be traffic off this machine).
	home := t.TempDir()
	t.Setenv("HOME", home)
	for _, k := range []string{"AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_PROFILE",
		"AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	credFile := filepath.Join(home, "credentials")
	if err := os.WriteFile(credFile, []byte("[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = "+secret+"\n[broken]\naws_access_key_id = AKIDONLY\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := store.Options{Endpoint: "http://127.0.0.1:9", DisableIMDS: true}
	tests := []struct {
		name     string
		mod      func(*store.Options)
		noCreds  bool   // want ErrNoCredentials
		errHas   string // or another error mentioning this
		succeeds bool
	}{
		{name: "nothing", mod: func(*store.Options) {}, noCreds: true, errHas: "AWS_ACCESS_KEY_ID"},
		{name: "anonymous allowed", mod: func(o *store.Options) { o.AllowAnonymous = true }, succeeds: true},
		{name: "static", mod: func(o *store.Options) { o.AccessKeyID, o.SecretAccessKey = "AKID", secret }, succeeds: true},
		{name: "key without secret", mod: func(o *store.Options) { o.AccessKeyID = "AKID" }, errHas: "no secret access key: set AWS_SECRET_ACCESS_KEY"},
		{name: "secret without key", mod: func(o *store.Options) { o.SecretAccessKey = secret }, errHas: "no access key id: set AWS_ACCESS_KEY_ID"},
		{name: "token without keys", mod: func(o *store.Options) { o.SessionToken = "tok" }, errHas: "session token is set without"},
		{name: "credentials file", mod: func(o *store.Options) { o.CredentialsFile = credFile }, succeeds: true},
		{name: "missing profile", mod: func(o *store.Options) { o.CredentialsFile, o.Profile = credFile, "nope" }, noCreds: true, errHas: `"nope"`},
		{name: "partial profile", mod: func(o *store.Options) { o.CredentialsFile, o.Profile = credFile, "broken" }, noCreds: true},
		{name: "missing file", mod: func(o *store.Options) { o.CredentialsFile = filepath.Join(home, "none") }, noCreds: true, errHas: "no such file"},
		{name: "missing file, anonymous allowed", mod: func(o *store.Options) {
			o.CredentialsFile, o.AllowAnonymous = filepath.Join(home, "none"), true
		}, noCreds: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := base
			tt.mod(&opts)
			s, err := store.Open(t.Context(), "s3://bucket/p", opts)
			if tt.succeeds {
				if err != nil {
					t.Fatalf("Open: %v", err)
				}
				if strings.Contains(s.String(), secret) {
					t.Errorf("String() leaks the secret: %s", s)
				}
				return
			}
			if err == nil {
				t.Fatal("Open succeeded")
			}
			if tt.noCreds != errors.Is(err, store.ErrNoCredentials) {
				t.Errorf("err = %v; errors.Is(ErrNoCredentials) = %t, want %t", err, !tt.noCreds, tt.noCreds)
			}
			if !strings.Contains(err.Error(), tt.errHas) {
				t.Errorf("err = %v, want it to mention %q", err, tt.errHas)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("error leaks the secret: %v", err)
			}
		})
	}
}

func TestS3CABundle(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.pem")
	os.WriteFile(bad, []byte("not a certificate"), 0o600)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "ca.pem")
	os.WriteFile(good, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	opts := store.Options{Endpoint: "https://127.0.0.1:1", Region: "us-east-1", AccessKeyID: "a", SecretAccessKey: "b", DisableIMDS: true}
	opts.CABundle = bad
	if _, err := store.OpenS3(context.Background(), "s3://bucket", opts); err == nil || !strings.Contains(err.Error(), "AWS_CA_BUNDLE") {
		t.Fatalf("a bundle without certificates: %v", err)
	}
	opts.CABundle = good
	if _, err := store.OpenS3(context.Background(), "s3://bucket", opts); err != nil {
		t.Fatalf("a valid bundle: %v", err)
	}
	if o := store.OptionsFromEnv(func(k string) string { return map[string]string{"AWS_CA_BUNDLE": good}[k] }); o.CABundle != good {
		t.Fatal("AWS_CA_BUNDLE is not read")
	}
}
