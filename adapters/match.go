package adapters

import (
	"path"
	"strings"
)

// Match reports whether pattern matches rel, a slash-separated path
// relative to the adapter's directory. The rules are gitignore's, the ones
// users know:
//   - a pattern without '/' matches a name at any depth ("*.lock", "cache");
//   - a pattern with '/' is anchored at the directory, and "**" stands for
//     any number of path components ("sessions/**/*.jsonl");
//   - a trailing '/' matches directories only ("logs/").
//
// Each component is matched with path.Match. A malformed pattern matches
// nothing (Validate reports it).
func Match(pattern, rel string, isDir bool) bool {
	dirOnly := strings.HasSuffix(pattern, "/")
	pattern = strings.TrimSuffix(pattern, "/")
	if dirOnly && !isDir {
		return false
	}
	if !strings.Contains(pattern, "/") {
		ok, _ := path.Match(pattern, path.Base(rel))
		return ok
	}
	return matchParts(strings.Split(pattern, "/"), strings.Split(rel, "/"))
}

func matchParts(pat, parts []string) bool {
	for len(pat) > 0 {
		if pat[0] == "**" {
			for i := 0; i <= len(parts); i++ {
				if matchParts(pat[1:], parts[i:]) {
					return true
				}
			}
			return false
		}
		if len(parts) == 0 {
			return false
		}
		if ok, _ := path.Match(pat[0], parts[0]); !ok {
			return false
		}
		pat, parts = pat[1:], parts[1:]
	}
	return len(parts) == 0
}

// validPattern reports a pattern path.Match cannot use.
func validPattern(p string) error {
	for _, part := range strings.Split(strings.TrimSuffix(p, "/"), "/") {
		if part == "**" {
			continue
		}
		if _, err := path.Match(part, ""); err != nil {
			return err
		}
	}
	return nil
}
