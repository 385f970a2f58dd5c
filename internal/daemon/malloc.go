package daemon

/*
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// tune_malloc makes the C allocator reuse the memory SQLite frees. It runs
// as the program is loaded, before any thread allocates: an arena made
// before it would stay in use.
//
// It stops the allocator from handing freed memory back to the kernel
// until more than 32 MiB of it is free. SQLite empties a connection's page
// cache whenever another connection (the application) has committed, and
// allocates the pages again on the next read; with glibc's default
// threshold (128 KiB, adjusted as it goes) every such cycle returned the
// pages with madvise and took them back as page faults, which at a steady
// trickle of commits cost about a third of the relay's CPU. Peak memory
// is unchanged: the pages are reused, not added to.
//
// And it gives every thread the one arena. By default each thread that
// allocates gets an arena of its own (up to eight per core), and memory
// freed into one is not reused by the others: Go runs SQLite's calls on
// whichever thread is free, so a fleet opening files faulted in fresh
// pages for their page caches in one arena while another held the pages
// that closed files had freed. With one arena, waking and closing an idle
// file took half the page faults and about a sixth less CPU. The relay's
// SQLite calls mostly come one at a time, so the arena's lock is seldom
// contended. MALLOC_ARENA_MAX or GLIBC_TUNABLES in the environment leave
// the arenas as glibc makes them.
__attribute__((constructor)) static void tune_malloc(void) {
#ifdef M_TRIM_THRESHOLD
	mallopt(M_TRIM_THRESHOLD, 32 << 20);
#endif
#ifdef M_ARENA_MAX
	if (getenv("MALLOC_ARENA_MAX") == NULL && getenv("GLIBC_TUNABLES") == NULL) {
		mallopt(M_ARENA_MAX, 1);
	}
#endif
}

// malloc_arenas returns how many arenas the allocator has (-1: unknown).
static int malloc_arenas(void) {
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	if (f == NULL) {
		return -1;
	}
	malloc_info(0, f);
	fclose(f);
	int n = 0;
	for (char *p = buf; (p = strstr(p, "<heap nr=")) != NULL; p++) {
		n++;
	}
	free(buf);
	return n;
}
*/
import "C"

// mallocArenas returns how many arenas the C allocator has (-1: unknown).
func mallocArenas() int { return int(C.malloc_arenas()) }
