package adapters

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Config is the YAML config file:
//
//	am_local: /am              # root of the presets (default: $AM_LOCAL)
//	adapters:
//	  - preset: claude         # a built-in preset, as is
//	  - preset: codex
//	    name: codex-alice      # another lineage name
//	    exclude: ["*.bak"]     # added to the preset's lists
//	  - name: notes            # a custom adapter
//	    dir: $HOME/notes
//	    append_only: ["journal/*.jsonl"]
//	    sqlite: ["index.db"]
//
// Without a config file, the configured adapters are the six presets
// rooted at $AM_LOCAL.
type Config struct {
	AMLocal  string    `yaml:"am_local,omitempty"`
	Adapters []Adapter `yaml:"adapters"`
}

// ErrUnknownAdapter: a name that is neither configured nor a preset.
var ErrUnknownAdapter = errors.New("unknown adapter")

// LoadConfig reads a config file strictly (unknown keys are errors, so a
// typo does not silently drop an exclude).
func LoadConfig(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config %s: %w", path, err)
	}
	var c Config
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil && !errors.Is(err, io.EOF) { // io.EOF: an empty file
		return nil, fmt.Errorf("parse config %s: %w", path, err)
	}
	return &c, nil
}

// Resolve returns the configured adapters with presets merged, variables
// ($VAR, ${VAR}, a leading ~) expanded and every adapter validated.
// getenv supplies the environment (AM_LOCAL, HOME, ...).
func (c *Config) Resolve(getenv func(string) string) ([]Adapter, error) {
	amLocal := getenv("AM_LOCAL")
	if c != nil && c.AMLocal != "" {
		amLocal = expand(c.AMLocal, getenv)
	}
	var entries []Adapter
	if c == nil || len(c.Adapters) == 0 {
		for _, name := range PresetNames() {
			entries = append(entries, Adapter{Preset: name})
		}
	} else {
		entries = c.Adapters
	}
	var out []Adapter
	var errs []error
	seen := map[string]bool{}
	for _, en := range entries {
		a := en
		if en.Preset != "" {
			p, ok := Preset(en.Preset, amLocal)
			if !ok {
				errs = append(errs, fmt.Errorf("preset %q: %w (presets: %s)", en.Preset, ErrUnknownAdapter, strings.Join(PresetNames(), ", ")))
				continue
			}
			a = p
			if en.Name != "" {
				a.Name = en.Name
			}
			if en.Dir != "" {
				a.Dir = en.Dir
			}
			a.Exclude = append(a.Exclude, en.Exclude...)
			a.AppendOnly = append(a.AppendOnly, en.AppendOnly...)
			a.SQLite = append(a.SQLite, en.SQLite...)
		}
		a.Dir = expand(a.Dir, getenv)
		if a.Dir != "" {
			a.Dir = filepath.Clean(a.Dir)
		}
		if err := a.Validate(); err != nil {
			errs = append(errs, err)
			continue
		}
		if seen[a.Name] {
			errs = append(errs, fmt.Errorf("adapter %q is configured twice: lineage names must be unique", a.Name))
			continue
		}
		seen[a.Name] = true
		out = append(out, a)
	}
	return out, errors.Join(errs...)
}

func expand(s string, getenv func(string) string) string {
	if rest, ok := strings.CutPrefix(s, "~/"); ok {
		s = "$HOME/" + rest
	}
	return os.Expand(s, getenv)
}

// Select picks adapters by name from the resolved list; a name that is not
// configured but is a preset is taken from the presets (rooted at
// $AM_LOCAL), so `--adapter claude` works without a config file.
func Select(configured []Adapter, names []string, getenv func(string) string) ([]Adapter, error) {
	var out []Adapter
	for _, n := range names {
		found := false
		for _, a := range configured {
			if a.Name == n {
				out = append(out, a)
				found = true
				break
			}
		}
		if found {
			continue
		}
		p, ok := Preset(n, getenv("AM_LOCAL"))
		if !ok {
			return nil, fmt.Errorf("adapter %q: %w (configured: %s; presets: %s)", n, ErrUnknownAdapter,
				adapterNames(configured), strings.Join(PresetNames(), ", "))
		}
		if err := p.Validate(); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

func adapterNames(as []Adapter) string {
	if len(as) == 0 {
		return "none"
	}
	n := make([]string, len(as))
	for i, a := range as {
		n[i] = a.Name
	}
	return strings.Join(n, ", ")
}
