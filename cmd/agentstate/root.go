package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentstate/agentstate/adapters"
	"github.com/agentstate/agentstate/internal/engine"
	"github.com/agentstate/agentstate/store"
)

const rootHelp = `agentstate checkpoints the live on-disk state of AI agent harnesses (JSONL
transcripts, config, credentials, SQLite databases) straight into S3-compatible
object storage, and restores it when a container starts again.

Each checkpoint uploads only new content, as immutable content-addressed
segments, and commits a checksummed manifest last (create-only), so a crash at
any moment leaves the previous checkpoint intact. Restore takes the newest
manifest that verifies and checks every byte it writes.

Stores (--store, default $AGENTSTATE_STORE, else a local folder):
  file:///path/to/folder    a local folder (the embedded default)
  s3://bucket/prefix        S3 or any S3-compatible server (MinIO, ...)

S3 settings come from flags or the standard variables: AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL (e.g. http://127.0.0.1:9000 for MinIO), AWS_REGION,
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE
with the shared credentials file, or an IAM role. AGENTSTATE_S3_ACCESS_KEY_ID /
AGENTSTATE_S3_SECRET_ACCESS_KEY / AGENTSTATE_S3_SESSION_TOKEN: if any is set,
these are the keys (not AWS_*), and 'agentstate run' keeps them from the harness. agentstate refuses to run
without credentials unless --s3-anonymous is given.

Exit codes:
  0  success
  1  error (I/O, store unreachable, bad configuration)
  2  usage error (bad flags or arguments)
  3  concurrent writer: another writer committed to the lineage first
  4  restore incomplete: some paths could not be written (they are named)
  5  no manifest verifies, or verify found damage`

type globalFlags struct {
	config      string
	store       string
	stateDir    string
	jsonOut     bool
	logLevel    string
	s3Endpoint  string
	s3Region    string
	s3Anonymous bool
	parallel    int
	rawSQLite   bool
	keepDeleted time.Duration
}

// registerKeepDeleted adds --keep-deleted to a command that checkpoints.
func (g *globalFlags) registerKeepDeleted(cmd *cobra.Command) {
	cmd.Flags().DurationVar(&g.keepDeleted, "keep-deleted", engine.DefaultKeepDeleted,
		"keep deleted paths restorable for this long (see 'agentstate ls --deleted'); 0 keeps none")
}

func newRootCmd() *cobra.Command {
	g := &globalFlags{}
	root := &cobra.Command{
		Use:           "agentstate",
		Short:         "Checkpoint AI agent harness state into S3-compatible storage",
		Long:          rootHelp,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usageError{fmt.Errorf("%w (see '%s --help')", err, c.CommandPath())}
	})
	pf := root.PersistentFlags()
	pf.StringVar(&g.config, "config", "", "adapters config file (default $AGENTSTATE_CONFIG, else ~/.config/agentstate/config.yaml if present)")
	pf.StringVar(&g.store, "store", "", "store URL: file:///path or s3://bucket/prefix (default $AGENTSTATE_STORE, else "+defaultStoreHint()+")")
	pf.StringVar(&g.stateDir, "state-dir", "", "local state (index, lock, writer id), owner-only (default $AGENTSTATE_STATE_DIR, else "+defaultStateHint()+")")
	pf.BoolVar(&g.jsonOut, "json", false, "print results as JSON")
	pf.StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn, error (logs go to stderr)")
	pf.StringVar(&g.s3Endpoint, "s3-endpoint", "", "S3 endpoint URL (default $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, else AWS)")
	pf.StringVar(&g.s3Region, "s3-region", "", "S3 region (default $AWS_REGION)")
	pf.BoolVar(&g.s3Anonymous, "s3-anonymous", false, "allow S3 access without credentials (public buckets only)")
	pf.IntVar(&g.parallel, "parallel", 4, "concurrent uploads and downloads")

	root.AddCommand(newCheckpointCmd(g), newRestoreCmd(g), newLsCmd(g), newVerifyCmd(g),
		newRunCmd(g), newStatusCmd(g), newAdaptersCmd(g), newInitCmd(g), newGCCmd(g), newForgetCmd(g), newDemoCmd(g), newDemoWriterCmd(), newProbeCmd())
	return root
}

func defaultStoreHint() string { return "file://" + filepath.Join(dataHome(), "agentstate", "store") }
func defaultStateHint() string { return filepath.Join(stateHome(), "agentstate") }

func dataHome() string {
	if d := os.Getenv("XDG_DATA_HOME"); d != "" {
		return d
	}
	h, _ := os.UserHomeDir()
	return filepath.Join(h, ".local", "share")
}

func stateHome() string {
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return d
	}
	h, _ := os.UserHomeDir()
	return filepath.Join(h, ".local", "state")
}

func (g *globalFlags) storeURL() string {
	switch {
	case g.store != "":
		return g.store
	case os.Getenv("AGENTSTATE_STORE") != "":
		return os.Getenv("AGENTSTATE_STORE")
	}
	return defaultStoreHint()
}

func (g *globalFlags) stateDirPath() string {
	switch {
	case g.stateDir != "":
		return g.stateDir
	case os.Getenv("AGENTSTATE_STATE_DIR") != "":
		return os.Getenv("AGENTSTATE_STATE_DIR")
	}
	return defaultStateHint()
}

func (g *globalFlags) logger(w io.Writer) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(g.logLevel)); err != nil {
		return nil, usageError{fmt.Errorf("--log-level %q: use debug, info, warn or error", g.logLevel)}
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl})), nil
}

// openStore opens the store the command works on, with S3 settings from
// the flags over the standard variables.
func (g *globalFlags) openStore(ctx context.Context, cmd *cobra.Command) (store.Store, *slog.Logger, error) {
	log, err := g.logger(cmd.ErrOrStderr())
	if err != nil {
		return nil, nil, err
	}
	opts := store.OptionsFromEnv(os.Getenv)
	if g.s3Endpoint != "" {
		opts.Endpoint = g.s3Endpoint
	}
	if g.s3Region != "" {
		opts.Region = g.s3Region
	}
	opts.AllowAnonymous = g.s3Anonymous
	opts.Logger = log
	st, err := store.Open(ctx, g.storeURL(), opts)
	if err != nil {
		return nil, nil, err
	}
	return st, log, nil
}

// openEngine opens the store and the engine the command works on.
func (g *globalFlags) openEngine(ctx context.Context, cmd *cobra.Command) (*engine.Engine, store.Store, error) {
	st, log, err := g.openStore(ctx, cmd)
	if err != nil {
		return nil, nil, err
	}
	e, err := engine.New(st, engine.Options{StateDir: g.stateDirPath(), Parallel: g.parallel, Logger: log,
		Databases: adapters.Databases{RawCopies: g.rawSQLite}})
	if err != nil {
		return nil, nil, err
	}
	return e, st, nil
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// noArgs rejects positional arguments as a usage error (exit code 2).
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("%s takes no arguments, got %q (see '%s --help')", cmd.CommandPath(), args, cmd.CommandPath())}
	}
	return nil
}

// requireFlags turns missing required flags into a usage error that says
// what to pass.
func requireFlags(cmd *cobra.Command, names ...string) error {
	var missing []string
	for _, n := range names {
		if !cmd.Flags().Changed(n) {
			missing = append(missing, "--"+n)
		}
	}
	if len(missing) > 0 {
		return usageError{fmt.Errorf("%s needs %s (see '%s --help')", cmd.CommandPath(), strings.Join(missing, " and "), cmd.CommandPath())}
	}
	return nil
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
