package sqlitedb

import (
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
	// db is the database file, and its size and time: another file, or
	// one written in rollback mode, is a change.
	db           fileID
	dbSize, dbAt int64
	// shm is the -shm file: one made anew starts a new index. Its size
	// and time are not part of the mark: readers write their marks into
	// it.
	shm fileID
}

// fileID is a file's identity.
type fileID struct{ dev, ino uint64 }

// ReadCommitMark reads the mark of the database at path. ok is false when
// there is none to read (no -shm file: the database is not in WAL mode, or
// no connection has opened it since its last one closed) or it cannot be
// read; the caller then looks at the database. It reads through the -shm
// file a DB of the process holds open, if one does (see indexFiles).
func ReadCommitMark(path string) (CommitMark, bool) {
	path = absPath(path)
	release := useIndex(path)
	defer release()
	idx := indexFileOf(path)
	if idx == nil {
		return CommitMark{}, false
	}
	return markOf(path, idx)
}

// CommitMark is ReadCommitMark through the -shm file s reads its commit
// watch's headers from; ok is false when there is none (the database is
// not in WAL mode).
func (s *DB) CommitMark() (m CommitMark, ok bool) {
	idx := s.index()
	if idx == nil {
		return m, false
	}
	return markOf(s.path, idx)
}

// markOf reads the mark of the database at path through its -shm file.
func markOf(path string, shm *walIndex) (m CommitMark, ok bool) {
	db, err := os.Stat(path)
	if m.db, ok = idOf(db, err); !ok {
		return m, false
	}
	m.dbSize, m.dbAt = db.Size(), db.ModTime().UnixNano()
	m.shm = shm.id
	if _, err := shm.f.ReadAt(m.header[:], 0); err != nil {
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
	return fileID{dev: uint64(st.Dev), ino: st.Ino}, true
}

// walIndex reads the WAL index header of a database this process holds
// open, for its commit watch: one read of the header's two copies (96
// bytes) from the -shm file, where PRAGMA data_version is a read
// transaction (its locks on the application's file, and a query through
// database/sql). While a connection of the process is open, SQLite keeps
// the -shm file it opened (a first connection rebuilds it in place), and
// the descriptor read here stays open too (indexFiles): closing it would
// drop SQLite's locks on the file (POSIX locks belong to the process),
// among them the one that tells another process's first connection that
// the index is in use and must not be rebuilt.
type walIndex struct {
	f  *os.File
	id fileID
}

// header returns the WAL index header; settled is false while a commit
// writes it (its two copies differ), as SQLite's readers find it.
func (w *walIndex) header() (h [walIndexHeaders / 2]byte, settled bool, err error) {
	var both [walIndexHeaders]byte
	if _, err := w.f.ReadAt(both[:], 0); err != nil {
		return h, false, err
	}
	copy(h[:], both[:len(h)])
	return h, h == [len(h)]byte(both[len(h):]), nil
}
