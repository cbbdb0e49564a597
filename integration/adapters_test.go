package integration

import (
	"bytes"
	"database/sql"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	_ "modernc.org/sqlite"
)

// Fixtures shaped like each harness's real layout (see the harness
// reference): what must survive, what the preset must leave out, and the
// SQLite databases it must capture through the backup API.
type fixture struct {
	files    map[string]string // path → content, all expected back
	excluded map[string]string // written, must not come back
	dbs      []string          // SQLite databases (rows in table t)
}

var harnessFixtures = map[string]struct {
	root string
	fx   fixture
}{
	"codex": {"codex-home", fixture{
		files: map[string]string{
			"config.toml": "model = \"gpt-5\"\n", "auth.json": `{"tokens":{"access":"x"}}`,
			"history.jsonl": `{"text":"fix it"}` + "\n", "session_index.jsonl": `{"id":"u1"}` + "\n",
			"sessions/2026/12/01/rollout-2026-12-01T07-00-00-u1.jsonl": `{"type":"session_meta"}` + "\n",
			"archived_sessions/rollout-2026-11-01T07-00-00-u0.jsonl":   `{"type":"session_meta"}` + "\n",
		},
		excluded: map[string]string{"log/codex-tui.log": "x", "shell_snapshots/s.sh": "x",
			"state_5.sqlite": "cache", "state_5.sqlite-wal": "x", "history.lock": ""},
	}},
	"claude": {"agent-state/claude", fixture{
		files: map[string]string{
			"settings.json": `{"theme":"dark"}`, ".credentials.json": `{"claudeAiOauth":{}}`,
			"history.jsonl":                                       `{"display":"hi"}` + "\n",
			"projects/-work-app/5f1c2a9e.jsonl":                   `{"type":"user"}` + "\n",
			"projects/-work-app/5f1c2a9e/subagents/agent-1.jsonl": `{"type":"assistant"}` + "\n",
			"projects/-work-app/memory/notes.md":                  "# memory\n",
			"todos/5f1c2a9e.json":                                 `[]`, "plans/plan.md": "plan\n",
		},
		excluded: map[string]string{"sessions/4242.json": "{}", "statsig/cache": "x",
			"shell-snapshots/snap.sh": "x", "debug/log.txt": "x", "ide/1.lock": "x"},
	}},
	"gemini": {"agent-state/gemini-home/.gemini", fixture{
		files: map[string]string{
			"settings.json": `{}`, "projects.json": `{"/work/app":"app"}`, "oauth_creds.json": `{}`,
			"tmp/app/chats/session-2026-12-01T07-00-abc.jsonl": `{"type":"user"}` + "\n",
			"tmp/app/logs.json": `[]`, "tmp/app/checkpoint-tag.json": `{}`, ".env": "GEMINI_API_KEY=x\n",
		},
		excluded: map[string]string{"tmp/bin/rg": "x", "tmp/background-processes/p.json": "x"},
	}},
	"openclaw": {"oc-home/.openclaw", fixture{
		files: map[string]string{
			"openclaw.json": `{}`, "credentials/profile.json": `{}`, "secrets.json": `{}`,
			"agents/main/sessions/s1.jsonl": `{"role":"user"}` + "\n", "workspace/MEMORY.md": "m\n",
		},
		excluded: map[string]string{"logs/gateway.log": "x", "gateway.pid": "1", "x.tmp": "x"},
		dbs:      []string{"state/openclaw.sqlite", "agents/main/agent/openclaw-agent.sqlite"},
	}},
	"opencode": {"opencode-share", fixture{
		files: map[string]string{
			"auth.json": `{}`, "mcp-auth.json": `{}`, "storage/session/s1.json": `{}`,
		},
		excluded: map[string]string{"log/2026.log": "x", "bin/rg": "x"},
		dbs:      []string{"opencode.db"},
	}},
	"hermes": {"hermes", fixture{
		files: map[string]string{
			"config.yaml": "model: x\n", "SOUL.md": "soul\n", "memories/m.md": "m\n",
			"skills/s.md": "s\n", ".env": "KEY=x\n", "auth.json": `{}`,
		},
		excluded: map[string]string{"logs/agent.log": "x"},
		dbs:      []string{"state.db"},
	}},
}

// makeDB creates a WAL-mode database with rows 1..n in table t.
func makeDB(t testing.TB, p string, n int) {
	t.Helper()
	os.MkdirAll(filepath.Dir(p), 0o700)
	db, err := sql.Open("sqlite", "file:"+p+"?_pragma=journal_mode(WAL)&_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, body TEXT)`); err != nil {
		t.Fatal(err)
	}
	tx, _ := db.Begin()
	for i := 1; i <= n; i++ {
		tx.Exec(`INSERT OR REPLACE INTO t (id, body) VALUES (?, ?)`, i, strings.Repeat("row", 50))
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// dbRows checks quick_check and returns the row count of table t.
func dbRows(t testing.TB, p string) int {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+p+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var ok string
	if err := db.QueryRow(`PRAGMA quick_check`).Scan(&ok); err != nil || ok != "ok" {
		t.Fatalf("quick_check %s: %q, %v", p, ok, err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM t`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func writeFixture(t testing.TB, dir string, fx fixture) {
	t.Helper()
	for _, m := range []map[string]string{fx.files, fx.excluded} {
		for p, c := range m {
			full := filepath.Join(dir, p)
			os.MkdirAll(filepath.Dir(full), 0o700)
			if err := os.WriteFile(full, []byte(c), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, p := range fx.dbs {
		makeDB(t, filepath.Join(dir, p), 500)
	}
}

// adapterCLI runs agentstate with AM_LOCAL set, as in a container.
func adapterCLI(t testing.TB, storeURL string, env []string, amLocal string) *cli {
	return newCLI(t, storeURL, append(append([]string{}, env...), "AM_LOCAL="+amLocal))
}

// TestHarnessPresetsRestore: each of the six presets checkpoints a fixture
// of its harness's layout and restores it onto empty local storage: every
// file that is state comes back, nothing excluded does, and databases come
// back as single valid files with all their rows.
func TestHarnessPresetsRestore(t *testing.T) {
	for name, h := range harnessFixtures {
		t.Run(name, func(t *testing.T) {
			storeURL, env := newBucket(t)
			am := t.TempDir()
			dir := filepath.Join(am, h.root)
			writeFixture(t, dir, h.fx)
			c := adapterCLI(t, storeURL, env, am)
			var res []checkpointOut
			c.mustJSON(&res, "checkpoint", "--adapter", name)
			if len(res) != 1 || !res[0].Committed {
				t.Fatalf("checkpoint: %+v", res)
			}
			fresh := t.TempDir() // a new container: empty AM_LOCAL, no state
			rc := adapterCLI(t, storeURL, env, fresh)
			var rres []restoreOut
			rc.mustJSON(&rres, "restore", "--adapter", name)
			got := filepath.Join(fresh, h.root)
			for p, want := range h.fx.files {
				b, err := os.ReadFile(filepath.Join(got, p))
				if err != nil || string(b) != want {
					t.Errorf("%s: %q, %v; want %q", p, b, err, want)
				}
			}
			for p := range h.fx.excluded {
				if _, err := os.Lstat(filepath.Join(got, p)); err == nil {
					t.Errorf("excluded %s was restored", p)
				}
			}
			for _, p := range h.fx.dbs {
				if n := dbRows(t, filepath.Join(got, p)); n != 500 {
					t.Errorf("%s: %d rows, want 500", p, n)
				}
				for _, suf := range []string{"-wal", "-shm"} {
					if _, err := os.Lstat(filepath.Join(got, p+suf)); err == nil {
						t.Errorf("%s%s restored beside the database", p, suf)
					}
				}
			}
			// A machine that restored the lineage checkpoints it again at
			// no cost.
			time.Sleep(1100 * time.Millisecond)
			rc.mustJSON(&res, "checkpoint", "--adapter", name)
			rc.mustJSON(&res, "checkpoint", "--adapter", name)
			if res[0].Committed || res[0].Requests != 0 {
				t.Fatalf("idle checkpoint after restore: %+v; want no commit and 0 requests", res[0])
			}
		})
	}
}

// TestHotRestartKeepsNewerLocalState: restore into a tree that already has
// newer work (the container restarted, the disk survived) keeps that work
// and fills in only what is missing.
func TestHotRestartKeepsNewerLocalState(t *testing.T) {
	storeURL, env := newBucket(t)
	am := t.TempDir()
	h := harnessFixtures["claude"]
	dir := filepath.Join(am, h.root)
	writeFixture(t, dir, h.fx)
	c := adapterCLI(t, storeURL, env, am)
	var res []checkpointOut
	c.mustJSON(&res, "checkpoint", "--adapter", "claude")

	transcript := filepath.Join(dir, "projects/-work-app/5f1c2a9e.jsonl")
	newer := `{"type":"user"}` + "\n" + `{"type":"assistant","text":"newer work"}` + "\n"
	os.WriteFile(transcript, []byte(newer), 0o600)
	os.Remove(filepath.Join(dir, "settings.json"))
	var rres []restoreOut
	c.mustJSON(&rres, "restore", "--adapter", "claude")
	if b, _ := os.ReadFile(transcript); string(b) != newer {
		t.Fatalf("hot restart overwrote newer local work: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "settings.json")); string(b) != h.fx.files["settings.json"] {
		t.Fatalf("missing file not restored: %q", b)
	}
}

func startWriter(t testing.TB, file string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(agentstateBin(t), append([]string{"demo-writer", file}, args...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
	return cmd
}

// checkCompleteLines fails unless got is a prefix of live that ends at a
// line boundary and every line in it is complete JSON.
func checkCompleteLines(t testing.TB, got, live []byte) {
	t.Helper()
	if !bytes.HasPrefix(live, got) {
		t.Fatalf("restored transcript (%d bytes) is not a prefix of the live one (%d bytes)", len(got), len(live))
	}
	if len(got) > 0 && got[len(got)-1] != '\n' {
		t.Fatalf("restored transcript ends in a torn line: %q", got[max(0, len(got)-40):])
	}
	for _, l := range bytes.Split(bytes.TrimSuffix(got, []byte("\n")), []byte("\n")) {
		if len(l) > 0 && !json.Valid(l) {
			t.Fatalf("restored line is not complete JSON: %q", l)
		}
	}
}

// TestCodexRolloutWhileWriterAppends: a separate process holds the rollout
// open and keeps appending (in torn halves) while checkpoints run; every
// checkpoint restores to complete lines only, and after the writer is
// SIGKILLed the rollout is reconstructed up to the last line shipped.
func TestCodexRolloutWhileWriterAppends(t *testing.T) {
	storeURL, env := newBucket(t)
	am := t.TempDir()
	dir := filepath.Join(am, "codex-home")
	rollout := filepath.Join(dir, "sessions/2026/12/01/rollout-2026-12-01T07-00-00-u1.jsonl")
	os.MkdirAll(filepath.Dir(rollout), 0o700)
	os.WriteFile(filepath.Join(dir, "config.toml"), []byte("model = \"x\"\n"), 0o600)
	writer := startWriter(t, rollout, "--torn")
	c := adapterCLI(t, storeURL, env, am)
	var last int64
	for i := range 4 {
		time.Sleep(300 * time.Millisecond)
		var res []checkpointOut
		c.mustJSON(&res, "checkpoint", "--adapter", "codex")
		if i > 0 && res[0].BytesUploaded > 64<<10 {
			t.Fatalf("checkpoint %d uploaded %d bytes for ~300 ms of appends", i, res[0].BytesUploaded)
		}
		fresh := t.TempDir()
		adapterCLI(t, storeURL, env, fresh).restoreAdapter("codex")
		got, _ := os.ReadFile(filepath.Join(fresh, "codex-home", strings.TrimPrefix(rollout, dir)))
		live, _ := os.ReadFile(rollout)
		checkCompleteLines(t, got, live)
		if int64(len(got)) < last {
			t.Fatalf("checkpoint %d shipped less than the one before", i)
		}
		last = int64(len(got))
	}
	if last == 0 {
		t.Fatal("nothing of the rollout was shipped")
	}

	// Kill -9 the writer, as a container stop would; the lines it wrote
	// after the last checkpoint are the only loss.
	sizeBefore, _ := os.Stat(rollout)
	var res []checkpointOut
	c.mustJSON(&res, "checkpoint", "--adapter", "codex")
	writer.Process.Signal(syscall.SIGKILL)
	writer.Wait()
	fresh := t.TempDir()
	adapterCLI(t, storeURL, env, fresh).restoreAdapter("codex")
	got, _ := os.ReadFile(filepath.Join(fresh, "codex-home", strings.TrimPrefix(rollout, dir)))
	live, _ := os.ReadFile(rollout)
	checkCompleteLines(t, got, live)
	if cut := bytes.LastIndexByte(live[:sizeBefore.Size()], '\n') + 1; len(got) < cut {
		t.Fatalf("restored %d bytes; the last checkpoint started with %d bytes of complete lines", len(got), cut)
	}
}

// restore with an adapter target ignores dir: the adapter says where.
func (c *cli) restoreAdapter(name string) []restoreOut {
	c.t.Helper()
	var out []restoreOut
	c.mustJSON(&out, "restore", "--adapter", name)
	return out
}
