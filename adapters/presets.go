package adapters

import (
	"path/filepath"
	"slices"
)

// preset is a built-in adapter, its directory relative to $AM_LOCAL (the
// container's fast local disk), as in the deployment table of the
// harness reference. Patterns follow what each harness writes; layouts
// change between releases, so they match shapes, not exact names.
type preset struct {
	Adapter
	relDir string
}

var presets = []preset{
	{relDir: "codex-home", Adapter: Adapter{
		Name: "codex",
		// Rollouts are held open and appended per item; history.jsonl is
		// appended but trimmed in place (a rewrite is detected and shipped
		// whole); the SQLite files are a rebuildable cache: excluded.
		AppendOnly: []string{"sessions/**/*.jsonl", "archived_sessions/**/*.jsonl", "session_index.jsonl", "history.jsonl"},
		Exclude: []string{"log/", "shell_snapshots/", "cache/", ".sandbox*", "tmp/",
			"*.sqlite", "*.sqlite-wal", "*.sqlite-shm", "*.sqlite-journal"},
	}},
	{relDir: "agent-state/claude", Adapter: Adapter{
		Name:       "claude",
		AppendOnly: []string{"projects/**/*.jsonl", "history.jsonl"},
		Exclude: []string{"sessions/", "shell-snapshots/", "session-env/", "debug/", "paste-cache/",
			"image-cache/", "statsig/", "telemetry/", "cache/", "ide/"},
	}},
	{relDir: "agent-state/gemini-home/.gemini", Adapter: Adapter{
		Name:       "gemini",
		AppendOnly: []string{"tmp/*/chats/*.jsonl"},
		Exclude:    []string{"tmp/bin/", "tmp/background-processes/"},
	}},
	{relDir: "oc-home/.openclaw", Adapter: Adapter{
		Name:       "openclaw",
		AppendOnly: []string{"agents/*/sessions/*.jsonl"},
		SQLite:     []string{"state/openclaw.sqlite", "agents/*/agent/openclaw-agent.sqlite"},
		Exclude:    []string{"logs/", "*.sock", "*.tmp", "node_modules/"},
	}},
	{relDir: "opencode-share", Adapter: Adapter{
		Name:    "opencode",
		SQLite:  []string{"opencode.db"},
		Exclude: []string{"log/", "bin/", "repos/", "worktree/"},
	}},
	{relDir: "hermes", Adapter: Adapter{
		Name:    "hermes",
		SQLite:  []string{"state.db"},
		Exclude: []string{"logs/"},
	}},
}

// PresetNames lists the built-in presets.
func PresetNames() []string {
	names := make([]string, len(presets))
	for i, p := range presets {
		names[i] = p.Name
	}
	return names
}

// Preset returns the built-in preset name rooted at amLocal ("" leaves Dir
// empty, which Validate reports).
func Preset(name, amLocal string) (Adapter, bool) {
	i := slices.IndexFunc(presets, func(p preset) bool { return p.Name == name })
	if i < 0 {
		return Adapter{}, false
	}
	a := presets[i].Adapter
	a.Preset = name
	a.Exclude = slices.Clone(a.Exclude)
	a.AppendOnly = slices.Clone(a.AppendOnly)
	a.SQLite = slices.Clone(a.SQLite)
	if amLocal != "" {
		a.Dir = filepath.Join(amLocal, presets[i].relDir)
	}
	return a, true
}
