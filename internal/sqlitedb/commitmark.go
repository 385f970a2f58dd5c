package sqlitedb

import (
	"io"
	"os"
	"syscall"
)

// walIndexHeaders is the size of the two copies of the WAL index header
// at the start of a -shm file. A commit becomes visible to readers when
// its writer copies the new header there (both copies), so every commit
// changes them: the frame count, the running checksum of the frames and,
// after a checkpoint restarted the WAL, its salts. Readers' marks and
// checkpoint progress come after them and are not part of the mark.
const walIndexHeaders = 96

// CommitMark says which commits of a database in WAL mode can be read. Two
// equal marks, read at two moments, say that no commit became visible in
// between: a look at the file's rows after the first saw everything the
// second can show. The header is written through shared memory, which
// sends no file-system notification: a commit's notification (a write to
// its -wal file) can come before the commit shows, and a mark read after
// it tells whether it shows yet without opening the database.
type CommitMark struct {
	header [walIndexHeaders]byte
	db     fileID // the database file: another file, or one written in rollback mode, is a change
	// shm is the -shm file's identity: one made anew starts a new index
	// (readers write their marks into it, changing its time).
	shm fileID
}

// fileID is what a mark keeps of a file: its identity and, for the
// database, its size and time.
type fileID struct {
	dev, ino    uint64
	size, mtime int64
}

// ReadCommitMark reads the mark of the database at path. ok is false when
// there is none to read (no -shm file: the database is not in WAL mode, or
// no connection has opened it since its last one closed) or it cannot be
// read; the caller then looks at the database.
func ReadCommitMark(path string) (m CommitMark, ok bool) {
	if m.db, ok = idOf(os.Stat(path)); !ok {
		return m, false
	}
	f, err := os.Open(path + "-shm")
	if err != nil {
		return m, false
	}
	defer f.Close()
	if m.shm, ok = idOf(f.Stat()); !ok {
		return m, false
	}
	m.shm.size, m.shm.mtime = 0, 0
	if _, err := io.ReadFull(f, m.header[:]); err != nil {
		return m, false
	}
	return m, true
}

func idOf(fi os.FileInfo, err error) (fileID, bool) {
	if err != nil {
		return fileID{}, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileID{}, false
	}
	return fileID{dev: uint64(st.Dev), ino: st.Ino, size: fi.Size(), mtime: fi.ModTime().UnixNano()}, true
}
