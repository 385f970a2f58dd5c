// Command writer is the fault-injection suite's application: it inserts
// outbox rows the way an application does (its own data and the event in
// one transaction) at a steady rate, and on request holds the write lock
// for seconds at random moments or mixes in poison rows.
package main

import (
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"time"

	_ "github.com/mattn/go-sqlite3"
	"github.com/outbox-relay/outbox-relay/internal/event"
)

func main() {
	var (
		db         = flag.String("db", "", "SQLite file (already migrated)")
		rows       = flag.Int("rows", 20000, "rows to write")
		rate       = flag.Int("rate", 2000, "rows per second")
		holdEvery  = flag.Duration("hold-every", 0, "hold BEGIN IMMEDIATE about this often (0: never)")
		holdFor    = flag.Duration("hold-for", 3*time.Second, "how long each hold lasts")
		poisonBig  = flag.Int("poison-big", 0, "rows with a payload of -big-size bytes")
		bigSize    = flag.Int("big-size", 64<<10, "size of a big poison payload")
		poisonType = flag.Int("poison-type", 0, "rows with an invalid event type")
		keys       = flag.Int("keys", 0, "give 70% of the rows one of this many ordering keys (0: none)")
		seed       = flag.Uint64("seed", 1, "random seed")
	)
	flag.Parse()
	if err := run(*db, *rows, *rate, *holdEvery, *holdFor, *poisonBig, *bigSize, *poisonType, *keys, *seed); err != nil {
		fmt.Fprintln(os.Stderr, "writer:", err)
		os.Exit(1)
	}
}

// summary is printed as JSON on stdout at the end.
type summary struct {
	Written    int     `json:"written"`
	PoisonBig  int     `json:"poison_big"`
	PoisonType int     `json:"poison_type"`
	Holds      int     `json:"holds"`
	MaxWaitMs  float64 `json:"max_commit_wait_ms"`
	Keyed      int     `json:"keyed"`
}

var types = []string{"ReviewLogged", "ReviewEdited", "WatchlistItemAdded", "MovieDiscovered", "movie.deleted"}
var badTypes = []string{"has space", "wild.*", "trailing.", "", "a..b"}

func run(path string, rows, rate int, holdEvery, holdFor time.Duration, poisonBig, bigSize, poisonType, keys int, seed uint64) error {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=30000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS app_data (id INTEGER PRIMARY KEY, note TEXT)`); err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	// Poison rows go at random positions among the good ones.
	poison := map[int]string{}
	for i := 0; i < poisonBig; i++ {
		poison[rng.IntN(rows)] = "big"
	}
	for i := 0; i < poisonType; i++ {
		poison[rng.IntN(rows)] = "type"
	}
	var s summary
	start := time.Now()
	nextHold := time.Now().Add(jitter(rng, holdEvery))
	for s.Written < rows {
		if holdEvery > 0 && time.Now().After(nextHold) {
			if err := hold(db, holdFor); err != nil {
				return err
			}
			s.Holds++
			nextHold = time.Now().Add(jitter(rng, holdEvery))
		}
		due := int(time.Since(start).Seconds()*float64(rate)) - s.Written
		if due <= 0 {
			time.Sleep(time.Millisecond)
			continue
		}
		n := min(due, 1+rng.IntN(10), rows-s.Written)
		t0 := time.Now()
		tx, err := db.Begin()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			typ := types[rng.IntN(len(types))]
			payload, _ := json.Marshal(map[string]any{"n": s.Written + i, "note": "fault suite"})
			switch poison[s.Written+i] {
			case "big":
				payload = make([]byte, bigSize)
				s.PoisonBig++
			case "type":
				typ = badTypes[rng.IntN(len(badTypes))]
				s.PoisonType++
			}
			if _, err := tx.Exec(`INSERT INTO app_data (note) VALUES (?)`, typ); err != nil {
				tx.Rollback()
				return err
			}
			var key any // NULL: not ordered
			if keys > 0 && rng.IntN(10) < 7 {
				key = fmt.Sprintf("key-%d", rng.IntN(keys))
				s.Keyed++
			}
			if _, err := tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload, ordering_key) VALUES (?, ?, ?, ?)`, event.NewID(), typ, payload, key); err != nil {
				tx.Rollback()
				return err
			}
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		s.MaxWaitMs = max(s.MaxWaitMs, float64(time.Since(t0).Microseconds())/1000)
		s.Written += n
	}
	return json.NewEncoder(os.Stdout).Encode(s)
}

// hold keeps the write lock, as an application's long transaction does.
func hold(db *sql.DB, d time.Duration) error {
	tx, err := db.Begin()
	if err != nil {
		return err
	}
	if _, err := tx.Exec(`INSERT INTO app_data (note) VALUES ('holding the lock')`); err != nil {
		tx.Rollback()
		return err
	}
	time.Sleep(d)
	return tx.Commit()
}

func jitter(rng *rand.Rand, d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d/2 + time.Duration(rng.Int64N(int64(d)))
}
