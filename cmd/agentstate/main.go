// Command agentstate checkpoints the on-disk state of AI agent harnesses
// into S3-compatible object storage (or a local folder) and restores it.
// This package is the CLI only: flags, config, exit codes and output.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/agentstate/agentstate/internal/engine"
	"github.com/agentstate/agentstate/manifest"
)

// Exit codes, documented in `agentstate --help` and the README.
const (
	exitOK         = 0
	exitError      = 1 // anything else: I/O, store unreachable, bad config
	exitUsage      = 2 // bad flags or arguments
	exitConflict   = 3 // another writer committed to the lineage first
	exitIncomplete = 4 // restore could not write every path
	exitInvalid    = 5 // no manifest verifies / verify found damage
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:]))
}

func run(ctx context.Context, args []string) int {
	cmd := newRootCmd()
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(ctx)
	if err == nil {
		return exitOK
	}
	var ew exitWith
	if errors.As(err, &ew) {
		return ew.code // run: the child's status, already reported
	}
	fmt.Fprintln(os.Stderr, "agentstate:", err)
	return exitCode(err)
}

type usageError struct{ err error }

func (u usageError) Error() string { return u.err.Error() }
func (u usageError) Unwrap() error { return u.err }

func exitCode(err error) int {
	var ue usageError
	switch {
	case errors.As(err, &ue):
		return exitUsage
	case errors.Is(err, manifest.ErrConflict):
		return exitConflict
	case errors.Is(err, engine.ErrIncomplete):
		return exitIncomplete
	case errors.Is(err, engine.ErrNoValidManifest), errors.Is(err, engine.ErrVerify):
		return exitInvalid
	}
	return exitError
}
