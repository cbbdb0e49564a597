// Package adapters holds harness semantics: an Adapter says which directory
// is one lineage's live state, what to exclude, which files are append-only
// transcripts (shipped as complete-line segments) and which are SQLite
// databases (captured with the online backup API, see sqlite.go). It has
// built-in presets for Codex, Claude Code, Gemini CLI, OpenClaw, opencode
// and Hermes, and reads a YAML config for custom adapters and overrides.
package adapters
