// Command writer is the fault-injection suite's application: it inserts
// outbox rows the way an application does (its own data and the event in
// one transaction) at a steady rate, and on request holds the write lock
// for seconds at random moments, mixes in poison rows or rows on a
// subject the relay may not publish to, or writes each transaction's rows
// as one atomic group. SIGTERM stops it after the transaction it is in,
// as if it had written every row asked for.
package main

import (
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"syscall"
	"time"

	_ "github.com/mattn/go-sqlite3"
	"github.com/outbox-relay/outbox-relay/internal/event"
)

// options are the command's flags.
type options struct {
	db                 string
	rows, rate         int
	holdEvery, holdFor time.Duration
	poisonBig, bigSize int
	poisonType         int
	keys               int
	groupMax           int
	restrictedPercent  int
	seed               uint64
}

func main() {
	var o options
	flag.StringVar(&o.db, "db", "", "SQLite file (already migrated)")
	flag.IntVar(&o.rows, "rows", 20000, "rows to write")
	flag.IntVar(&o.rate, "rate", 2000, "rows per second")
	flag.DurationVar(&o.holdEvery, "hold-every", 0, "hold BEGIN IMMEDIATE about this often (0: never)")
	flag.DurationVar(&o.holdFor, "hold-for", 3*time.Second, "how long each hold lasts")
	flag.IntVar(&o.poisonBig, "poison-big", 0, "rows with a payload of -big-size bytes")
	flag.IntVar(&o.bigSize, "big-size", 64<<10, "size of a big poison payload")
	flag.IntVar(&o.poisonType, "poison-type", 0, "rows with an invalid event type")
	flag.IntVar(&o.keys, "keys", 0, "give 70% of the rows one of this many ordering keys (0: none)")
	flag.IntVar(&o.groupMax, "group-max", 0, "write each transaction's rows, 2 to this many, as one atomic group; with -keys, 70% of a group's rows get one of 2 or 3 keys drawn for the group (0: no groups)")
	flag.IntVar(&o.restrictedPercent, "restricted-percent", 0, "give this percentage of the rows the event type "+restrictedType)
	flag.Uint64Var(&o.seed, "seed", 1, "random seed")
	flag.Parse()
	if o.restrictedPercent < 0 || o.restrictedPercent > 100 {
		fmt.Fprintf(os.Stderr, "writer: -restricted-percent %d: must be between 0 and 100\n", o.restrictedPercent)
		os.Exit(2)
	}
	if o.groupMax == 1 || o.groupMax < 0 {
		fmt.Fprintf(os.Stderr, "writer: -group-max %d: a group holds 2 rows or more\n", o.groupMax)
		os.Exit(2)
	}
	if err := run(o); err != nil {
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
	Restricted int     `json:"restricted"`
	Groups     int     `json:"groups"` // atomic groups written (-group-max)
}

var types = []string{"ReviewLogged", "ReviewEdited", "WatchlistItemAdded", "MovieDiscovered", "movie.deleted"}
var badTypes = []string{"has space", "wild.*", "trailing.", "", "a..b"}

// restrictedType is the event type of the rows -restricted-percent asks
// for: the suite's server may deny the relay its subject.
const restrictedType = "Restricted"

// row is one outbox row to insert.
type row struct {
	typ     string
	payload []byte
	key     any // NULL: not ordered
}

// rowMaker chooses each row's type, payload and key, counting what it
// chose in the summary.
type rowMaker struct {
	o      options
	rng    *rand.Rand
	poison map[int]string // row number -> "big" or "type"
	s      *summary
	// groupKeys are the keys the rows of the atomic group being written
	// draw from (nil: any of the -keys).
	groupKeys []string
}

func (m *rowMaker) make(n int) row {
	r := row{typ: types[m.rng.IntN(len(types))]}
	r.payload, _ = json.Marshal(map[string]any{"n": n, "note": "fault suite"})
	switch {
	case m.poison[n] == "big":
		r.payload = make([]byte, m.o.bigSize)
		m.s.PoisonBig++
	case m.poison[n] == "type":
		r.typ = badTypes[m.rng.IntN(len(badTypes))]
		m.s.PoisonType++
	// Drawn only when asked for, so that other runs see the rows they
	// always saw for a seed.
	case m.o.restrictedPercent > 0 && m.rng.IntN(100) < m.o.restrictedPercent:
		r.typ = restrictedType
		m.s.Restricted++
	}
	if m.o.keys > 0 && m.rng.IntN(10) < 7 {
		if m.groupKeys != nil {
			r.key = m.groupKeys[m.rng.IntN(len(m.groupKeys))]
		} else {
			r.key = fmt.Sprintf("key-%d", m.rng.IntN(m.o.keys))
		}
		m.s.Keyed++
	}
	return r
}

// startGroup draws the keys of the next atomic group's rows: 2 or 3 of
// the -keys (all of them when there are fewer).
func (m *rowMaker) startGroup() {
	m.groupKeys = nil
	if m.o.keys == 0 {
		return
	}
	for _, k := range m.rng.Perm(m.o.keys)[:min(m.o.keys, 2+m.rng.IntN(2))] {
		m.groupKeys = append(m.groupKeys, fmt.Sprintf("key-%d", k))
	}
}

func run(o options) error {
	db, err := sql.Open("sqlite3", "file:"+o.db+"?_busy_timeout=30000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS app_data (id INTEGER PRIMARY KEY, note TEXT)`); err != nil {
		return err
	}
	var s summary
	rng := rand.New(rand.NewPCG(o.seed, o.seed^0x9e3779b97f4a7c15))
	m := &rowMaker{o: o, rng: rng, poison: map[int]string{}, s: &s}
	// Poison rows go at random positions among the good ones.
	for i := 0; i < o.poisonBig; i++ {
		m.poison[rng.IntN(o.rows)] = "big"
	}
	for i := 0; i < o.poisonType; i++ {
		m.poison[rng.IntN(o.rows)] = "type"
	}
	// A test that stops the application when it has seen enough
	// sends SIGTERM: no transaction is cut short.
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM)
	start := time.Now()
	nextHold := time.Now().Add(jitter(rng, o.holdEvery))
	for s.Written < o.rows && len(stop) == 0 {
		if o.holdEvery > 0 && time.Now().After(nextHold) {
			if err := hold(db, o.holdFor); err != nil {
				return err
			}
			s.Holds++
			nextHold = time.Now().Add(jitter(rng, o.holdEvery))
		}
		due := int(time.Since(start).Seconds()*float64(o.rate)) - s.Written
		if due <= 0 {
			time.Sleep(time.Millisecond)
			continue
		}
		n := min(due, 1+rng.IntN(10), o.rows-s.Written)
		group := ""
		if o.groupMax > 0 {
			// A group of 2 to -group-max rows (the last one may have
			// fewer), written once due, a little ahead of the rate.
			n = min(2+rng.IntN(o.groupMax-1), o.rows-s.Written)
			group = event.NewID()
			m.startGroup()
			s.Groups++
		}
		t0 := time.Now()
		if err := insert(db, m, s.Written, n, group); err != nil {
			return err
		}
		s.MaxWaitMs = max(s.MaxWaitMs, float64(time.Since(t0).Microseconds())/1000)
		s.Written += n
	}
	return json.NewEncoder(os.Stdout).Encode(s)
}

// insert writes rows first..first+n-1 in one transaction, each beside a
// row of the application's own data, all in the atomic group group ("":
// none).
func insert(db *sql.DB, m *rowMaker, first, n int, group string) error {
	var g any // NULL: no group
	if group != "" {
		g = group
	}
	tx, err := db.Begin()
	if err != nil {
		return err
	}
	for i := first; i < first+n; i++ {
		r := m.make(i)
		if _, err := tx.Exec(`INSERT INTO app_data (note) VALUES (?)`, r.typ); err != nil {
			tx.Rollback()
			return err
		}
		if _, err := tx.Exec(`INSERT INTO event_queue (event_id, event_type, payload, ordering_key, atomic_group) VALUES (?, ?, ?, ?, ?)`, event.NewID(), r.typ, r.payload, r.key, g); err != nil {
			tx.Rollback()
			return err
		}
	}
	return tx.Commit()
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
