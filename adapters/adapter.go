package adapters

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/agentstate/agentstate/manifest"
)

// Adapter is one lineage's live state and how to capture it.
type Adapter struct {
	// Name is the lineage name: one harness of one deployment.
	Name string `yaml:"name" json:"name"`
	// Preset names the built-in preset this adapter starts from, if any.
	Preset string `yaml:"preset,omitempty" json:"preset,omitempty"`
	// Dir is the live directory (absolute once resolved).
	Dir string `yaml:"dir" json:"dir"`
	// Exclude, AppendOnly and SQLite are patterns (see Match). A config
	// entry's lists are added to its preset's.
	Exclude    []string `yaml:"exclude,omitempty" json:"exclude,omitempty"`
	AppendOnly []string `yaml:"append_only,omitempty" json:"append_only,omitempty"`
	SQLite     []string `yaml:"sqlite,omitempty" json:"sqlite,omitempty"`
}

// alwaysExcluded applies to every adapter: files that are never state
// (locks, pids, sockets are skipped by type anyway) and SQLite's journals,
// which are never copied raw.
var alwaysExcluded = []string{"*.lock", "*.pid", ".agentstate-*"}

// sqliteCompanions are the files SQLite keeps beside a database.
var sqliteCompanions = []string{"-wal", "-shm", "-journal"}

// Excluded reports whether rel (a directory when isDir) is left out of the
// checkpoint. A database's -wal, -shm and -journal are always left out: the
// database is captured through the backup API, never as raw files.
func (a *Adapter) Excluded(rel string, isDir bool) bool {
	for _, list := range [][]string{alwaysExcluded, a.Exclude} {
		for _, p := range list {
			if Match(p, rel, isDir) {
				return true
			}
		}
	}
	if !isDir {
		for _, suf := range sqliteCompanions {
			if db, ok := strings.CutSuffix(rel, suf); ok && a.IsSQLite(db) {
				return true
			}
		}
	}
	return false
}

// IsAppendOnly reports whether the file rel is an append-only transcript.
func (a *Adapter) IsAppendOnly(rel string) bool { return matchAny(a.AppendOnly, rel) }

// IsSQLite reports whether the file rel is a SQLite database.
func (a *Adapter) IsSQLite(rel string) bool { return matchAny(a.SQLite, rel) }

func matchAny(patterns []string, rel string) bool {
	for _, p := range patterns {
		if Match(p, rel, false) {
			return true
		}
	}
	return false
}

// Validate checks the adapter once its Dir is resolved.
func (a *Adapter) Validate() error {
	var errs []error
	if err := manifest.ValidLineage(a.Name); err != nil {
		errs = append(errs, err)
	}
	if a.Dir == "" {
		errs = append(errs, errors.New("no dir: set dir, or AM_LOCAL for a preset"))
	} else if !filepath.IsAbs(a.Dir) {
		errs = append(errs, fmt.Errorf("dir %q is not absolute", a.Dir))
	}
	for _, list := range [][]string{a.Exclude, a.AppendOnly, a.SQLite} {
		for _, p := range list {
			if err := validPattern(p); err != nil {
				errs = append(errs, fmt.Errorf("pattern %q: %w", p, err))
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("adapter %q: %w", a.Name, err)
	}
	return nil
}
