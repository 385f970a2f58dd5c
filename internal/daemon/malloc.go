package daemon

/*
#include <malloc.h>

// keep_freed_memory raises glibc's trim threshold (see keepFreedMemory).
static void keep_freed_memory(int bytes) {
#ifdef M_TRIM_THRESHOLD
	mallopt(M_TRIM_THRESHOLD, bytes);
#endif
}
*/
import "C"

// keepFreedMemory stops the C allocator from handing freed memory back to
// the kernel until more than 32 MiB of it is free. SQLite empties a
// connection's page cache whenever another connection (the application)
// has committed, and allocates the pages again on the next read; with
// glibc's default threshold (128 KiB, adjusted as it goes) every such
// cycle returned the pages with madvise and took them back as page faults,
// which at a steady trickle of commits cost about a third of the relay's
// CPU. Peak memory is unchanged: the pages are reused, not added to.
func keepFreedMemory() { C.keep_freed_memory(32 << 20) }
