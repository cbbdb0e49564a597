package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentstate/agentstate/adapters"
	"github.com/agentstate/agentstate/internal/engine"
)

// targetFlags select what a command works on: adapters by name (or all
// configured ones), or one plain directory as a lineage.
type targetFlags struct {
	adapters []string
	all      bool
	lineage  string
	dir      string
	needDir  bool
}

func (t *targetFlags) register(cmd *cobra.Command, needDir bool) {
	t.needDir = needDir
	fs := cmd.Flags()
	fs.StringArrayVar(&t.adapters, "adapter", nil, "a configured adapter or built-in preset (repeatable): "+strings.Join(adapters.PresetNames(), ", "))
	fs.BoolVar(&t.all, "all", false, "every configured adapter (without a config file: the six presets under $AM_LOCAL)")
	fs.StringVar(&t.lineage, "lineage", "", "lineage name for a plain directory: letters, digits, . _ -")
	if needDir {
		fs.StringVar(&t.dir, "dir", "", "the plain directory (with --lineage)")
	}
}

// target is one lineage to work on; Adapter is nil for a plain directory.
type target struct {
	Lineage string
	Dir     string
	Adapter *adapters.Adapter
}

func (t *targetFlags) resolve(cmd *cobra.Command, g *globalFlags) ([]target, error) {
	modes := 0
	for _, set := range []bool{len(t.adapters) > 0, t.all, t.lineage != ""} {
		if set {
			modes++
		}
	}
	if modes != 1 {
		what := "--adapter NAME, --all, or --lineage NAME"
		if t.needDir {
			what += " with --dir PATH"
		}
		return nil, usageError{fmt.Errorf("%s needs exactly one of %s (see '%s --help')", cmd.CommandPath(), what, cmd.CommandPath())}
	}
	if t.lineage != "" {
		if t.needDir && t.dir == "" {
			return nil, usageError{fmt.Errorf("%s --lineage needs --dir (see '%s --help')", cmd.CommandPath(), cmd.CommandPath())}
		}
		return []target{{Lineage: t.lineage, Dir: t.dir}}, nil
	}
	if t.dir != "" {
		return nil, usageError{errors.New("--dir goes with --lineage; an adapter's directory comes from its config or preset")}
	}
	configured, err := g.adapters()
	if err != nil && (t.all || !errors.Is(err, errNoAMLocal)) {
		return nil, err
	}
	list := configured
	if !t.all {
		if list, err = adapters.Select(configured, t.adapters, os.Getenv); err != nil {
			return nil, err
		}
	}
	out := make([]target, len(list))
	for i := range list {
		out[i] = target{Lineage: list[i].Name, Dir: list[i].Dir, Adapter: &list[i]}
	}
	return out, nil
}

var errNoAMLocal = errors.New("no adapters resolved")

// adapters returns the configured adapters: from the config file, or the
// six presets rooted at $AM_LOCAL.
func (g *globalFlags) adapters() ([]adapters.Adapter, error) {
	path, err := g.configPath()
	if err != nil {
		return nil, err
	}
	var cfg *adapters.Config
	if path != "" {
		if cfg, err = adapters.LoadConfig(path); err != nil {
			return nil, err
		}
	}
	list, err := cfg.Resolve(os.Getenv)
	if err != nil {
		if cfg == nil {
			return list, fmt.Errorf("%w: %w", errNoAMLocal, err)
		}
		return nil, err
	}
	return list, nil
}

// configPath is --config, $AGENTSTATE_CONFIG, or the user's config file if
// it exists; "" means none.
func (g *globalFlags) configPath() (string, error) {
	for _, p := range []string{g.config, os.Getenv("AGENTSTATE_CONFIG")} {
		if p != "" {
			if _, err := os.Stat(p); err != nil {
				return "", fmt.Errorf("config file: %w", err)
			}
			return p, nil
		}
	}
	dir := os.Getenv("XDG_CONFIG_HOME")
	if dir == "" {
		h, _ := os.UserHomeDir()
		dir = filepath.Join(h, ".config")
	}
	p := filepath.Join(dir, "agentstate", "config.yaml")
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	return "", nil
}

// checkpointOptions turns a target into what the engine needs.
func (t target) checkpointOptions(authoritative bool, keepDeleted time.Duration) engine.CheckpointOptions {
	if keepDeleted <= 0 {
		keepDeleted = -1 // the flag's 0 means none; the engine's means default
	}
	opts := engine.CheckpointOptions{Lineage: t.Lineage, Dir: t.Dir, Authoritative: authoritative,
		KeepDeleted: keepDeleted}
	if a := t.Adapter; a != nil {
		opts.Exclude = a.Excluded
		opts.AppendOnly = a.IsAppendOnly
		if len(a.SQLite) > 0 {
			opts.SQLite = a.IsSQLite
		}
	}
	return opts
}

func newAdaptersCmd(g *globalFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "adapters",
		Short: "List the configured adapters with their resolved directories",
		Long: `Adapters lists what --all works on: the adapters of the config file
(--config, $AGENTSTATE_CONFIG, or ~/.config/agentstate/config.yaml), or without
one the six built-in presets rooted at $AM_LOCAL. A config file looks like:

  am_local: /am              # root of the presets (default: $AM_LOCAL)
  adapters:
    - preset: claude         # a built-in preset, as is
    - preset: codex
      name: codex-alice      # another lineage name
      exclude: ["*.bak"]     # added to the preset's patterns
    - name: notes            # a custom adapter
      dir: $HOME/notes
      append_only: ["journal/*.jsonl"]
      sqlite: ["index.db"]

Patterns follow gitignore: "*.lock" matches a name at any depth, "logs/"
only directories, "sessions/**/*.jsonl" is anchored and ** spans directories.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			list, err := g.adapters()
			if err != nil {
				return err
			}
			if g.jsonOut {
				return printJSON(cmd.OutOrStdout(), list)
			}
			w := cmd.OutOrStdout()
			for _, a := range list {
				state := "missing"
				if fi, err := os.Stat(a.Dir); err == nil && fi.IsDir() {
					state = "exists"
				}
				fmt.Fprintf(w, "%s\t%s (%s)\n", a.Name, a.Dir, state)
				for _, l := range []struct {
					what string
					p    []string
				}{{"append-only", a.AppendOnly}, {"sqlite", a.SQLite}, {"exclude", a.Exclude}} {
					if len(l.p) > 0 {
						fmt.Fprintf(w, "  %-12s %s\n", l.what, strings.Join(l.p, " "))
					}
				}
			}
			return nil
		},
	}
}
