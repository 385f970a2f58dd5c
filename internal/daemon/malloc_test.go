package daemon_test

import (
	"database/sql"
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/daemon"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestSQLiteThreadsShareOneArena: SQLite's memory on every thread comes
// from the C allocator's one arena, so what one thread frees another
// reuses. Several threads each open a database and fill its page cache,
// at once; by default glibc gives each of them an arena of its own.
func TestSQLiteThreadsShareOneArena(t *testing.T) {
	if os.Getenv("MALLOC_ARENA_MAX") != "" || os.Getenv("GLIBC_TUNABLES") != "" {
		t.Skip("the environment sets the C allocator's arenas")
	}
	var wg sync.WaitGroup
	for i := range 4 {
		path := testenv.NewDB(t)
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // the goroutine's calls stay on one thread, not the main one
			defer runtime.UnlockOSThread()
			db, err := sql.Open("sqlite3", "file:"+path+"?_journal_mode=WAL")
			if err != nil {
				t.Error(err)
				return
			}
			defer db.Close()
			db.SetMaxOpenConns(1)
			for _, q := range []string{`CREATE TABLE t (x BLOB)`,
				`WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000) INSERT INTO t SELECT randomblob(500) FROM n`,
				`SELECT count(*) FROM t`} {
				if _, err := db.Exec(q); err != nil {
					t.Error(fmt.Errorf("thread %d: %s: %w", i, q, err))
					return
				}
			}
		}()
	}
	wg.Wait()
	if n := daemon.MallocArenas(); n != 1 {
		t.Fatalf("the C allocator has %d arenas, want 1", n)
	}
}
