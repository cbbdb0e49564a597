// Package segments is agentstate's data plane: blobs, the immutable segment
// objects that pack them, the uploader that writes segments, the readers that
// fetch and verify blobs, and content-defined chunking of large files.
//
// A blob is a chunk of file content, a complete-lines segment of a
// transcript, or a tree. Its id is the SHA-256 of its plaintext. Blobs are
// stored as records (optionally zstd-compressed) packed into segments; a
// segment is named by the SHA-256 of all its bytes and stored once, create-only,
// under Key(id). Nothing in this package ever overwrites or deletes an object.
//
// Everything read back from the bucket is verified before it is returned: a
// record by its declared length, xxhash64 and SHA-256, a trailer by its magic,
// structure and xxhash64, a whole segment by its SHA-256. Lengths found in the
// bucket are never trusted to size an allocation beyond what the referring,
// already verified, metadata allows. Failures wrap ErrCorrupt.
//
// # Byte format, version 1
//
// All integers are little-endian unless said otherwise.
//
// A blob record, the unit a Ref points at (Ref.Offset, Ref.Length):
//
//	offset  size  field
//	0       1     record format version: 1
//	1       1     codec: 0 raw (payload is the plaintext), 1 zstd (payload is
//	              zstd frames that decompress to the plaintext)
//	2       n     plaintext length, unsigned varint (encoding/binary.Uvarint),
//	              minimally encoded, at most MaxBlobSize
//	2+n     8     xxhash64 of the plaintext
//	10+n    ...   payload, to the end of the record
//
// A record is zstd only if that is strictly smaller than raw, so a record is
// never longer than 10+n+plaintext length bytes, and a zstd record's
// plaintext is never empty. The blob id is not in the record: it is in the
// segment index and in every Ref, and Decode checks it.
//
// A segment:
//
//	offset        size      field
//	0             8         header: "AGSG", version 1, kind, 0x00, 0x00
//	8             ...       blob records back to back, in index order, no gaps
//	end-24-L      L         index: kind (1 byte), then count entries of 48 bytes:
//	                          blob id         32 bytes
//	                          record offset   uint64
//	                          record length   uint32
//	                          plaintext size  uint32
//	end-24        24        footer:
//	                          count           uint32
//	                          index length L  uint32, = 1 + 48*count
//	                          xxhash64 of the index  uint64
//	                          kind            1 byte
//	                          version         1 byte: 1
//	                          reserved        2 bytes: 0x00 0x00
//	                          magic           "AGSG"
//
// A trailer (index + footer) is valid only if: the magic, version and zero
// reserved bytes are right; the kind is a known Kind and the same in the
// footer and the index; L = 1 + 48*count; the xxhash64 matches; the first
// record starts at 8, each next one where the previous ended, and the last
// ends where the index starts; every record length is within the bounds a
// record of its plaintext size can have; no plaintext size exceeds
// MaxBlobSize; and no blob id appears twice. The id of a segment is the
// SHA-256 of all of its bytes, header to magic.
//
// # Reading
//
// A reader that has the whole segment calls ParseSegment (which checks the
// SHA-256 of everything) and decodes records from it; one that wants some
// blobs uses ReadBlob (one ranged GET per blob) or ReadBlobs (one ranged GET
// per segment, streamed). ReadTrailer fetches just the index of a stored
// segment, usually in one GET.
package segments
