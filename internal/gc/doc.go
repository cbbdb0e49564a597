// Package gc is the only place agentstate deletes anything from a
// repository: retention of manifests per lineage, and a two-phase,
// lock-free (with respect to checkpoints) garbage collection of the
// manifests retention retires and of the segments no retained manifest
// lists.
//
// # Retention
//
// Retain is a pure function from a lineage's (sequence, time) list, a
// Policy and the store's "now" to keep/retire decisions: keep the last N,
// the newest per UTC hour for N hours, the newest per UTC day for N days,
// and always the newest manifest of the lineage.
//
// # Mark and sweep
//
// One Run does, holding the repository's GC lease (locks/gc):
//
//  1. Scan: list manifests/ (streaming, one lineage at a time) and apply
//     the policy; a manifest listed in a forget tombstone (`forget
//     --apply`, an operator's decision) is retired too, unless it is the
//     newest of its lineage. Load every retained manifest: the live set is
//     the union of their segment lists. Memory is proportional to the live
//     set and the number of manifests, never to the number of segments.
//  2. Sweep the tombstones older than the grace period, manifests first,
//     then segments. A manifest is deleted only if it is retired now (by
//     the policy as it is now, or by forget) and not the newest of its
//     lineage; a segment only if, now, no retained manifest lists it
//     (including manifests committed after the tombstone: the live set is
//     computed at the start of the run and refreshed before every delete
//     request), no retired manifest that still exists after the manifest
//     sweep lists it either, and its current LastModified is older than
//     the grace period. So a manifest, as long as it exists, is complete:
//     `restore --seq` and `ls` never meet one whose segments are gone.
//     Deletes go 1000 keys a request; a tombstone goes once every key in
//     it was handled. Segment tombstones are read one at a time (at most
//     Batch entries), and each segments/<xx>/ prefix is checked with HEADs
//     or one listing, whichever the mark's recorded key counts say is
//     cheaper.
//  3. Mark: write every retired manifest, and every segment not in the
//     live set, into tombstones (create-only, at most Batch keys each,
//     streamed from the listing: never all in memory). A run marks only
//     when none of GC's own tombstones is still in its grace period, so
//     nothing is marked twice; a young GC tombstone is never even read.
//
// Ages are measured on the store's clock: "now" is the LastModified of the
// lease this run just wrote, and every age compared to the grace period
// includes a second of slack for S3's one-second timestamps. The local
// clock is used only for durations (lease renewal) and, in a dry run,
// which writes nothing and so cannot read the store's clock.
//
// Safety does not rest on the lease: two GCs at once would each only
// delete what is dead by a fresh live set. The lease keeps them from
// duplicating work and bounds how stale a stalled GC's decisions can be
// (deletes stop when the lease is not renewed for half its TTL).
//
// What GC relies on from writers: a checkpoint references only segments
// listed by the newest manifest of its lineage (which is never retired) or
// segments it uploaded itself less than the grace period before it
// commits. See docs/architecture.md for the cases where that is not yet
// true.
//
// Not here yet (hooks for later issues): compaction of lineages whose
// newest manifest needs too many segments, and the retention window of
// deletion tombstones inside trees.
package gc
