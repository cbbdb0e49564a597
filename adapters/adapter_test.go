package adapters

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMatch(t *testing.T) {
	tests := []struct {
		pattern, rel string
		dir, want    bool
	}{
		{"*.lock", "a.lock", false, true},
		{"*.lock", "deep/in/b.lock", false, true},
		{"*.lock", "a.locker", false, false},
		{"cache", "x/cache", true, true},
		{"logs/", "logs", true, true},
		{"logs/", "logs", false, false},
		{"tmp/bin/", "tmp/bin", true, true},
		{"tmp/bin/", "x/tmp/bin", true, false},
		{"sessions/**/*.jsonl", "sessions/2026/12/01/rollout-x.jsonl", false, true},
		{"sessions/**/*.jsonl", "sessions/a.jsonl", false, true},
		{"sessions/**/*.jsonl", "other/sessions/a.jsonl", false, false},
		{"projects/**/*.jsonl", "projects/-work-app/abc/subagents/s.jsonl", false, true},
		{"tmp/*/chats/*.jsonl", "tmp/slug/chats/session-1.jsonl", false, true},
		{"tmp/*/chats/*.jsonl", "tmp/slug/x/chats/session-1.jsonl", false, false},
		{"opencode.db", "opencode.db", false, true},
		{"opencode.db", "sub/opencode.db", false, true},
		{"state/openclaw.sqlite", "state/openclaw.sqlite", false, true},
		{"[", "[", false, false},
	}
	for _, tc := range tests {
		if got := Match(tc.pattern, tc.rel, tc.dir); got != tc.want {
			t.Errorf("Match(%q, %q, dir=%v) = %v, want %v", tc.pattern, tc.rel, tc.dir, got, tc.want)
		}
	}
}

func TestPresetsMatchHarnessLayouts(t *testing.T) {
	type check struct {
		rel                        string
		dir                        bool
		excluded, appendOnly, isDB bool
	}
	tests := map[string][]check{
		"codex": {
			{rel: "sessions/2026/12/01/rollout-2026-12-01T07-00-00-uuid.jsonl", appendOnly: true},
			{rel: "history.jsonl", appendOnly: true},
			{rel: "auth.json"}, {rel: "config.toml"},
			{rel: "state_5.sqlite", excluded: true}, {rel: "logs_2.sqlite-wal", excluded: true},
			{rel: "log", dir: true, excluded: true}, {rel: "shell_snapshots", dir: true, excluded: true},
			{rel: "x.lock", excluded: true},
		},
		"claude": {
			{rel: "projects/-work-app/5f1c.jsonl", appendOnly: true},
			{rel: "projects/-work-app/5f1c/subagents/a.jsonl", appendOnly: true},
			{rel: ".credentials.json"}, {rel: "settings.json"}, {rel: "todos/a.json"},
			{rel: "sessions", dir: true, excluded: true}, {rel: "statsig", dir: true, excluded: true},
			{rel: "shell-snapshots", dir: true, excluded: true},
		},
		"gemini": {
			{rel: "tmp/abc/chats/session-1-x.jsonl", appendOnly: true},
			{rel: "tmp/abc/logs.json"}, {rel: "oauth_creds.json"},
			{rel: "tmp/bin", dir: true, excluded: true},
		},
		"openclaw": {
			{rel: "state/openclaw.sqlite", isDB: true},
			{rel: "state/openclaw.sqlite-wal", excluded: true},
			{rel: "agents/a1/agent/openclaw-agent.sqlite", isDB: true},
			{rel: "agents/a1/agent/openclaw-agent.sqlite-shm", excluded: true},
			{rel: "agents/a1/sessions/s.jsonl", appendOnly: true},
			{rel: "workspace/MEMORY.md"}, {rel: "gw.sock", excluded: true},
		},
		"opencode": {
			{rel: "opencode.db", isDB: true}, {rel: "opencode.db-wal", excluded: true},
			{rel: "opencode.db-shm", excluded: true}, {rel: "auth.json"},
			{rel: "log", dir: true, excluded: true}, {rel: "storage/session/a.json"},
		},
		"hermes": {
			{rel: "state.db", isDB: true}, {rel: "state.db-wal", excluded: true},
			{rel: "config.yaml"}, {rel: "memories/m.md"}, {rel: "logs", dir: true, excluded: true},
		},
	}
	for name, checks := range tests {
		a, ok := Preset(name, "/am")
		if !ok {
			t.Fatalf("no preset %q", name)
		}
		if err := a.Validate(); err != nil {
			t.Fatal(err)
		}
		for _, c := range checks {
			if got := a.Excluded(c.rel, c.dir); got != c.excluded {
				t.Errorf("%s: Excluded(%q) = %v", name, c.rel, got)
			}
			if c.dir {
				continue
			}
			if got := a.IsAppendOnly(c.rel); got != c.appendOnly {
				t.Errorf("%s: IsAppendOnly(%q) = %v", name, c.rel, got)
			}
			if got := a.IsSQLite(c.rel); got != c.isDB {
				t.Errorf("%s: IsSQLite(%q) = %v", name, c.rel, got)
			}
		}
	}
	if len(PresetNames()) != 6 {
		t.Fatalf("presets %v", PresetNames())
	}
}

func TestConfig(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "agentstate.yaml")
	os.WriteFile(p, []byte(`
am_local: /am
adapters:
  - preset: claude
  - preset: codex
    name: codex-alice
    exclude: ["*.bak"]
  - name: notes
    dir: ~/notes
    append_only: ["journal/*.jsonl"]
    sqlite: ["index.db"]
`), 0o600)
	c, err := LoadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"HOME": "/home/u"}
	as, err := c.Resolve(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	if len(as) != 3 || as[0].Dir != "/am/agent-state/claude" || as[1].Name != "codex-alice" ||
		as[1].Dir != "/am/codex-home" || as[2].Dir != "/home/u/notes" {
		t.Fatalf("resolved %+v", as)
	}
	if !as[1].Excluded("x.bak", false) || !as[1].Excluded("log", true) {
		t.Fatal("override excludes must add to the preset's")
	}
	if !as[2].IsSQLite("index.db") || !as[2].Excluded("index.db-wal", false) {
		t.Fatal("custom adapter patterns")
	}

	for name, bad := range map[string]string{
		"unknown key":    "adapters:\n  - preset: claude\n    exclud: [x]\n",
		"unknown preset": "adapters:\n  - preset: vim\n",
		"duplicate":      "adapters:\n  - preset: claude\n  - preset: claude\n",
		"relative dir":   "adapters:\n  - name: x\n    dir: rel/path\n",
		"bad lineage":    "adapters:\n  - name: ../x\n    dir: /x\n",
		"bad pattern":    "adapters:\n  - name: x\n    dir: /x\n    exclude: ['[']\n",
	} {
		os.WriteFile(p, []byte(bad), 0o600)
		c, err := LoadConfig(p)
		if err == nil {
			_, err = c.Resolve(func(string) string { return "" })
		}
		if err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestNoConfigMeansPresets(t *testing.T) {
	var c *Config
	as, err := c.Resolve(func(k string) string { return map[string]string{"AM_LOCAL": "/am"}[k] })
	if err != nil || len(as) != 6 {
		t.Fatalf("presets without config: %v, %v", as, err)
	}
	_, err = c.Resolve(func(string) string { return "" })
	if err == nil || !strings.Contains(err.Error(), "AM_LOCAL") {
		t.Fatalf("without AM_LOCAL the error must say to set it: %v", err)
	}
	sel, err := Select(nil, []string{"hermes"}, func(k string) string { return map[string]string{"AM_LOCAL": "/am"}[k] })
	if err != nil || sel[0].Dir != "/am/hermes" {
		t.Fatalf("select preset: %v %v", sel, err)
	}
	if _, err := Select(nil, []string{"vim"}, func(string) string { return "/am" }); err == nil {
		t.Fatal("unknown adapter selected")
	}
}
