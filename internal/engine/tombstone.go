package engine

import (
	"path"
	"slices"
	"strings"

	"github.com/agentstate/agentstate/manifest"
)

// Deletion tombstones. A path that was in the last checkpoint and is gone
// from the tree stays in the next trees as an entry with Deleted set, its
// content still referenced (so GC keeps it), for CheckpointOptions.
// KeepDeleted; after that a checkpoint drops it. A deleted directory is a
// directory entry with Deleted set whose tree lists what it held, every
// entry of it deleted too, so one rule covers both: restore skips deleted
// entries unless asked for them. Tombstones are kept for files and
// symlinks; a directory comes back as the parent of what it held.

// prev returns the index's state of a live path: a tombstone is no
// previous version of a file that appears again at its path.
func (r *checkpointRun) prev(rel string) (fileState, bool) {
	st, ok := r.ix.Files[rel]
	if !ok || st.Deleted != 0 {
		return fileState{}, false
	}
	return st, true
}

// tombstones adds to the scanned tree every path the index has that the
// scan did not find, unless its window ended or the path is excluded now.
// A tombstone that conflicts with what the tree holds (a file where a
// directory would be needed) is dropped: the live tree wins.
func (r *checkpointRun) tombstones(root *node) {
	keep := r.opts.KeepDeleted
	if keep == 0 {
		keep = DefaultKeepDeleted
	}
	if keep < 0 {
		return
	}
	now := r.e.now().UnixNano()
	rels := make([]string, 0)
	for rel := range r.ix.Files {
		rels = append(rels, rel)
	}
	// Sorted, so a conflict resolves the same way every time (the parent
	// path first) and the tree is deterministic.
	slices.Sort(rels)
	touched := map[*node]bool{}
	for _, rel := range rels {
		st := r.ix.Files[rel]
		if st.Type != manifest.TypeFile && st.Type != manifest.TypeSymlink {
			continue
		}
		del := st.Deleted
		if del == 0 {
			del = now
		}
		if now-del > int64(keep) {
			continue // expired
		}
		if r.opts.Exclude != nil && r.opts.Exclude(rel, false) {
			continue
		}
		parent, ok := r.ghostParent(root, rel, del, touched)
		if !ok {
			continue
		}
		name := path.Base(rel)
		if slices.ContainsFunc(parent.children, func(c *node) bool { return c.name == name }) {
			continue // live again (or a tombstone of another type): the tree wins
		}
		st.Deleted = del
		c := &node{name: name, rel: rel, typ: st.Type, mode: st.Mode, mtime: st.MTime,
			target: st.Target, format: st.Format, state: st, deleted: del}
		if st.Type == manifest.TypeFile {
			r.reuse(c, st)
		}
		parent.children = append(parent.children, c)
		touched[parent] = true
	}
	for n := range touched {
		slices.SortFunc(n.children, func(a, b *node) int { return strings.Compare(a.name, b.name) })
	}
}

// ghostParent finds the directory node that holds rel, making ghost
// directories for the parts that are gone; false if a non-directory is in
// the way or a missing directory is excluded now. Nothing is made unless
// the tombstone goes in: an empty ghost would be a live directory that
// never existed.
func (r *checkpointRun) ghostParent(root *node, rel string, del int64, touched map[*node]bool) (*node, bool) {
	n := root
	parts := strings.Split(rel, "/")
	dirs := parts[:len(parts)-1]
	for i, part := range dirs {
		var next *node
		for _, c := range n.children {
			if c.name == part {
				next = c
				break
			}
		}
		if next == nil {
			for j := i; j < len(dirs); j++ {
				if r.opts.Exclude != nil && r.opts.Exclude(strings.Join(parts[:j+1], "/"), true) {
					return nil, false
				}
			}
			for j := i; j < len(dirs); j++ {
				g := &node{name: parts[j], rel: strings.Join(parts[:j+1], "/"), typ: manifest.TypeDir,
					mode: 0o700, mtime: del, ghost: true}
				n.children = append(n.children, g)
				touched[n] = true
				n = g
			}
			return n, true
		}
		if next.typ != manifest.TypeDir {
			return nil, false
		}
		n = next
	}
	return n, true
}
