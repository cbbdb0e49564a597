package main

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/spf13/cobra"
)

// bucketEnsurer is the optional store capability init uses: the s3 backend
// creates its bucket when it is missing.
type bucketEnsurer interface {
	EnsureBucket(ctx context.Context) error
}

func newInitCmd(g *globalFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "init",
		Short: "Create the bucket (if missing) and the repository config",
		Long: `Init prepares a store: on S3 it creates the bucket when it does not exist,
then it writes the repository config object (create-only, so running init
twice, or from two machines at once, is safe). checkpoint creates the config
by itself too; init is for provisioning steps such as docker-compose's
create-bucket service.`,
		Example: `  AWS_ENDPOINT_URL_S3=http://127.0.0.1:9000 agentstate init --store s3://agentstate`,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			e, st, err := g.openEngine(ctx, cmd)
			if err != nil {
				return err
			}
			if b, ok := st.(bucketEnsurer); ok {
				if err := b.EnsureBucket(ctx); err != nil {
					return err
				}
			}
			cfg, err := e.Init(ctx)
			if err != nil {
				return err
			}
			if g.jsonOut {
				return printJSON(cmd.OutOrStdout(), cfg)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "store %s ready: repository %s, format version %d\n", st, cfg.ID, cfg.Version)
			return nil
		},
	}
}

// newProbeCmd is a health check for images without a shell or curl.
func newProbeCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "probe URL",
		Short:  "Exit 0 if an HTTP GET of URL answers 200 (for container health checks)",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 2*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, args[0], nil)
			if err != nil {
				return usageError{err}
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("probe %s: HTTP %d", args[0], resp.StatusCode)
			}
			return nil
		},
	}
}
