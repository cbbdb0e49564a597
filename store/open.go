package store

import (
	"context"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
)

// supportedURLs is quoted by every "which store?" error.
const supportedURLs = "file:///absolute/path or /absolute/path (a local folder), s3://bucket[/prefix] (S3 or an S3-compatible server)"

// Open opens the store rawURL names:
//
//	/abs/path, file:///abs/path   the dir backend (opts is ignored)
//	s3://bucket[/prefix]          the s3 backend, configured by opts
//
// Opening sends no request to the store.
func Open(ctx context.Context, rawURL string, opts Options) (Store, error) {
	switch {
	case rawURL == "":
		return nil, fmt.Errorf("no store URL given; supported: %s", supportedURLs)
	case strings.HasPrefix(rawURL, "/"):
		return OpenDir(rawURL)
	case !strings.Contains(rawURL, "://"):
		return nil, fmt.Errorf("store URL %q is neither an absolute path nor a URL; supported: %s", redactURL(rawURL), supportedURLs)
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("store URL %s: %w; supported: %s", redactURL(rawURL), unwrapURLError(err), supportedURLs)
	}
	switch u.Scheme {
	case "file":
		if u.Host != "" && u.Host != "localhost" {
			return nil, fmt.Errorf("store URL %s: file URLs name a local path, not host %q; write file:///absolute/path", redactURL(rawURL), u.Host)
		}
		if u.RawQuery != "" || u.Fragment != "" {
			return nil, fmt.Errorf("store URL %s: query and fragment are not supported", redactURL(rawURL))
		}
		if !filepath.IsAbs(u.Path) {
			return nil, fmt.Errorf("store URL %s: path must be absolute (file:///absolute/path)", redactURL(rawURL))
		}
		return OpenDir(u.Path)
	case "s3":
		return OpenS3(ctx, rawURL, opts)
	default:
		return nil, fmt.Errorf("store URL %s: unsupported scheme %q; supported: %s", redactURL(rawURL), u.Scheme, supportedURLs)
	}
}
