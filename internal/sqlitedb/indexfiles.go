package sqlitedb

import (
	"os"
	"slices"
	"sync"
)

// indexFiles are the -shm files this process reads WAL index headers
// from, by database path (made absolute, as Open names it), shared by
// every DB of the path and every ReadCommitMark. Closing any descriptor
// of a file drops every POSIX lock the process holds on it, SQLite's
// among them (see walIndex), so a -shm file is closed only once no DB of
// the path is open (from Open to Close, or to the process's exit for one
// that keeps its writers) and no ReadCommitMark of it is reading. Another
// path to the same file (a symbolic or hard link) counts apart: the relay
// names each file by one path.
var indexFiles = struct {
	mu sync.Mutex
	m  map[string]*indexFile
}{m: map[string]*indexFile{}}

type indexFile struct {
	users int
	// files are the -shm files opened at the path: one replaced meanwhile
	// (a restore) stays open with the others.
	files []*walIndex
}

// useIndex counts a user of the database at path until release is
// called (release may be called more than once).
func useIndex(path string) (release func()) {
	indexFiles.mu.Lock()
	x := indexFiles.m[path]
	if x == nil {
		x = &indexFile{}
		indexFiles.m[path] = x
	}
	x.users++
	indexFiles.mu.Unlock()
	return sync.OnceFunc(func() {
		indexFiles.mu.Lock()
		defer indexFiles.mu.Unlock()
		if x.users--; x.users > 0 {
			return
		}
		for _, idx := range x.files {
			idx.f.Close()
		}
		delete(indexFiles.m, path)
	})
}

// indexFileOf returns the -shm file of the database at path, for a user
// counted by useIndex; nil when there is none (the database is not in WAL
// mode).
func indexFileOf(path string) *walIndex {
	indexFiles.mu.Lock()
	defer indexFiles.mu.Unlock()
	x := indexFiles.m[path]
	if x == nil { // no user counted (a DB read after its Close)
		return nil
	}
	if len(x.files) > 0 {
		if id, ok := idOf(os.Stat(path + "-shm")); ok {
			if i := slices.IndexFunc(x.files, func(idx *walIndex) bool { return idx.id == id }); i >= 0 {
				return x.files[i]
			}
		}
	}
	f, err := os.Open(path + "-shm")
	if err != nil {
		return nil
	}
	id, ok := idOf(f.Stat())
	idx := &walIndex{f: f, id: id}
	x.files = append(x.files, idx) // kept even so: closing it could drop a lock
	if !ok {
		return nil
	}
	return idx
}
