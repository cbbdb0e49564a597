// Package adapters will hold harness semantics: which paths of an agent
// home to checkpoint, which files are append-only transcripts, which are
// SQLite databases, what to exclude, and presets for Codex, Claude Code,
// Gemini CLI, OpenClaw, opencode and Hermes (issue #3). Until then the
// engine checkpoints a plain directory tree.
package adapters
