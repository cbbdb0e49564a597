package adapters

import "context"

// Databases captures and checks SQLite databases for the checkpoint engine
// (it implements engine.Databases) with the online backup API.
type Databases struct {
	// RawCopies treats every database as a legacy raw copy (db, -wal and
	// -shm copied as plain files by the old sync script, written by nobody
	// now): SQLite recovers a private copy before the backup, and the raw
	// files are never touched. For a one-time migration.
	RawCopies bool
}

// Stamp is the database's stat stamp as a string: equal strings mean the
// database provably did not change (Stamp.Key: a racy stamp never equals
// the next one, so that database is captured again).
func (d Databases) Stamp(path string) (string, error) {
	s, err := DBStamp(path)
	if err != nil {
		return "", err
	}
	return s.Key(), nil
}

// Snapshot captures the database at src into dst (see Snapshot and
// SnapshotRawCopy).
func (d Databases) Snapshot(ctx context.Context, src, dst string) error {
	var err error
	if d.RawCopies {
		_, err = SnapshotRawCopy(ctx, src, dst)
	} else {
		_, err = Snapshot(ctx, src, dst)
	}
	return err
}

// Valid reports whether the database at path passes quick_check.
func (d Databases) Valid(ctx context.Context, path string) bool { return LocalIsValid(ctx, path) }
