package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/agentstate/agentstate/internal/engine"
	"github.com/agentstate/agentstate/manifest"
)

func TestExitCodes(t *testing.T) {
	tests := []struct {
		err  error
		want int
	}{
		{errors.New("boom"), exitError},
		{usageError{errors.New("bad flag")}, exitUsage},
		{fmt.Errorf("checkpoint: %w", manifest.ErrConflict), exitConflict},
		{fmt.Errorf("restore: %w: a, b", engine.ErrIncomplete), exitIncomplete},
		{fmt.Errorf("restore: %w", engine.ErrNoValidManifest), exitInvalid},
		{fmt.Errorf("verify: %w: %w", engine.ErrVerify, errors.New("x")), exitInvalid},
	}
	for _, tc := range tests {
		if got := exitCode(tc.err); got != tc.want {
			t.Errorf("exitCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

func TestCommandLine(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "sub", "a.txt"), []byte("hello"), 0o600)
	common := []string{"--store", "file://" + filepath.Join(dir, "store"), "--state-dir", filepath.Join(dir, "state")}
	tests := []struct {
		name string
		args []string
		want int
	}{
		{"help", []string{"--help"}, exitOK},
		{"missing flags", []string{"checkpoint"}, exitUsage},
		{"unknown flag", []string{"checkpoint", "--nope"}, exitUsage},
		{"extra argument", append([]string{"ls", "--lineage", "x", "extra"}, common...), exitUsage},
		{"bad log level", append([]string{"ls", "--lineage", "x", "--log-level", "loud"}, common...), exitUsage},
		{"bad lineage", append([]string{"ls", "--lineage", "../x"}, common...), exitError},
		{"unknown store scheme", []string{"ls", "--lineage", "x", "--store", "ftp://x", "--state-dir", dir}, exitError},
		{"restore of an empty lineage is a first start", append([]string{"restore", "--lineage", "x", "--dir", filepath.Join(dir, "empty")}, common...), exitOK},
		{"verify of an empty lineage", append([]string{"verify", "--lineage", "x"}, common...), exitError},
		{"checkpoint", append([]string{"checkpoint", "--lineage", "x", "--dir", src, "--json"}, common...), exitOK},
		{"ls", append([]string{"ls", "--lineage", "x"}, common...), exitOK},
		{"verify", append([]string{"verify", "--lineage", "x"}, common...), exitOK},
		{"restore", append([]string{"restore", "--lineage", "x", "--dir", filepath.Join(dir, "dst")}, common...), exitOK},
		{"restore of a missing sequence", append([]string{"restore", "--lineage", "x", "--dir", filepath.Join(dir, "dst2"), "--seq", "9"}, common...), exitError},
		{"init", append([]string{"init"}, common...), exitOK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := run(context.Background(), tc.args); got != tc.want {
				t.Fatalf("agentstate %v: exit %d, want %d", tc.args, got, tc.want)
			}
		})
	}
	if b, err := os.ReadFile(filepath.Join(dir, "dst", "sub", "a.txt")); err != nil || string(b) != "hello" {
		t.Fatalf("restored file: %q, %v", b, err)
	}
}
