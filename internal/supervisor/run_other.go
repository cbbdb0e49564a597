//go:build !linux

package supervisor

import (
	"context"
	"errors"
)

// Run needs Linux (process groups, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG,
// wait4); elsewhere it fails without starting anything.
func Run(ctx context.Context, cp Checkpointer, opts Options) (exitCode int, err error) {
	return 1, errors.New("supervisor: agentstate run needs Linux")
}
