//go:build linux

package sqlitedb

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// SQLite's lock bytes: a write lock in this range is a lock that keeps
// readers out (PENDING or EXCLUSIVE).
const (
	lockBytesStart = 1 << 30
	lockBytesEnd   = lockBytesStart + 512
)

// lockHolders returns the ids of the processes holding a write lock on
// SQLite's lock bytes of the file at path, as /proc/locks lists them: 0
// for a process in another PID namespace, -1 for an open-file-description
// lock. It matches the file by inode number and the lock's range, not by
// device, which overlay file systems report differently.
//
// The kernel lists the locks a page at a time, by position: a lock
// released while the list is read moves the next one back past the page
// boundary, and it is missed. Under a churn of locks on other files a
// read missed a lock held all along up to about once in a hundred times;
// lockHolders reads the list readsOfLocks times and takes every holder
// any read shows.
func lockHolders(path string) []int {
	fi, err := os.Stat(path)
	if err != nil {
		return nil
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	var pids []int
	for range readsOfLocks {
		locks, err := os.ReadFile("/proc/locks")
		if err != nil {
			break
		}
		pids = appendHolders(pids, string(locks), st.Ino)
	}
	return pids
}

// readsOfLocks is how many times lockHolders reads /proc/locks.
const readsOfLocks = 3

// appendHolders appends to pids the holders of a write lock on SQLite's
// lock bytes of inode ino that the /proc/locks text locks lists.
func appendHolders(pids []int, locks string, ino uint64) []int {
	for line := range strings.Lines(locks) {
		// "1: POSIX  ADVISORY  WRITE 1234 fe:00:9982397 1073741826 1073742335";
		// a waiter's line has "->" in second place.
		f := strings.Fields(line)
		if len(f) < 8 || f[1] == "->" || f[3] != "WRITE" {
			continue
		}
		dev := strings.Split(f[5], ":")
		n, err := strconv.ParseUint(dev[len(dev)-1], 10, 64)
		if err != nil || n != ino {
			continue
		}
		if start, err := strconv.ParseInt(f[6], 10, 64); err != nil || start < lockBytesStart || start >= lockBytesEnd {
			continue
		}
		if pid, err := strconv.Atoi(f[4]); err == nil && !slices.Contains(pids, pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}
