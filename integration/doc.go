// Package integration holds agentstate's integration tests against a real
// MinIO server: the store conformance suite over the s3 backend, and
// end-to-end tests of the CLI with a bucket.
//
// TestMain uses the server at AGENTSTATE_TEST_S3_ENDPOINT (with
// AGENTSTATE_TEST_S3_ACCESS_KEY and AGENTSTATE_TEST_S3_SECRET_KEY) if set.
// Otherwise it starts its own MinIO on 127.0.0.1 with a temporary data
// directory, from $AGENTSTATE_MINIO_BIN or a pinned build cached under
// ${XDG_CACHE_HOME:-$HOME/.cache}/agentstate, which it installs with
// `go install` the first time. Without MinIO the tests are skipped, except
// with CI=true, where that is a failure.
package integration
