package manifest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/agentstate/agentstate/store"
)

// ConfigKey is the repository config object, written once, create-only.
const ConfigKey = "config"

// RepoVersion is the repository format version this build reads and writes.
const RepoVersion = 1

// Config holds the repository's format version and the parameters every
// writer must agree on, so all lineages in one bucket chunk alike and dedup.
type Config struct {
	Version int       `json:"version"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	// Chunker parameters for content-defined chunking. The seed is random
	// per repository, so chunk boundaries do not fingerprint content across
	// repositories.
	ChunkMin    int    `json:"chunk_min"`
	ChunkAvg    int    `json:"chunk_avg"`
	ChunkMax    int    `json:"chunk_max"`
	ChunkSeed   uint64 `json:"chunk_seed"`
	SegmentSize int64  `json:"segment_size"`
}

// Validate checks that this build can use the config.
func (c *Config) Validate() error {
	switch {
	case c.Version != RepoVersion:
		return fmt.Errorf("%w: repository format version %d, this agentstate reads %d (upgrade agentstate)", ErrInvalid, c.Version, RepoVersion)
	case c.ChunkMin <= 0 || c.ChunkAvg < c.ChunkMin || c.ChunkMax < c.ChunkAvg || c.ChunkMax > 16<<20:
		return fmt.Errorf("%w: chunk sizes %d/%d/%d", ErrInvalid, c.ChunkMin, c.ChunkAvg, c.ChunkMax)
	case c.SegmentSize < 1<<20 || c.SegmentSize > 1<<30:
		return fmt.Errorf("%w: segment size %d", ErrInvalid, c.SegmentSize)
	case c.ID == "":
		return fmt.Errorf("%w: repository id missing", ErrInvalid)
	}
	return nil
}

// NewConfig returns a fresh config with the given defaults and random ids.
func NewConfig(chunkMin, chunkAvg, chunkMax int, segmentSize int64, now time.Time) (*Config, error) {
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("new repository config: %w", err)
	}
	return &Config{
		Version: RepoVersion, ID: hex.EncodeToString(b[:16]), Created: now.UTC(),
		ChunkMin: chunkMin, ChunkAvg: chunkAvg, ChunkMax: chunkMax,
		ChunkSeed: binary.LittleEndian.Uint64(b[16:]), SegmentSize: segmentSize,
	}, nil
}

// LoadConfig reads the repository config; store.ErrNotFound if there is none.
func LoadConfig(ctx context.Context, st Getter) (*Config, error) {
	b, err := readAll(ctx, st, ConfigKey)
	if err != nil {
		return nil, fmt.Errorf("read repository config: %w", err)
	}
	return ParseConfig(b)
}

// ParseConfig decodes and validates a config object.
func ParseConfig(b []byte) (*Config, error) {
	var c Config
	if err := strictJSON(b, &c); err != nil {
		return nil, fmt.Errorf("parse repository config: %w", err)
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("parse repository config: %w", err)
	}
	return &c, nil
}

// EncodeConfig is the stored form of c.
func EncodeConfig(c *Config) ([]byte, error) { return json.MarshalIndent(c, "", "  ") }

// InitConfig returns the repository's config, creating it create-only when
// the repository is new. Two writers initialising at once agree: the loser
// of the create-only race reads the winner's config.
func InitConfig(ctx context.Context, st ReadWriter, fresh *Config) (*Config, error) {
	c, err := LoadConfig(ctx, st)
	if err == nil || !errors.Is(err, store.ErrNotFound) {
		return c, err
	}
	b, err := EncodeConfig(fresh)
	if err != nil {
		return nil, err
	}
	_, err = st.Put(ctx, ConfigKey, bytes.NewReader(b), int64(len(b)), store.PutOptions{CreateOnly: true})
	if err == nil {
		return fresh, nil
	}
	if errors.Is(err, store.ErrPrecondition) {
		return LoadConfig(ctx, st)
	}
	return nil, fmt.Errorf("create repository config: %w", err)
}
