// Package testenv provides the real parts tests run against: an in-process
// nats-server that can be stopped and restarted on the same port and store,
// SQLite outbox files, and an application-side writer.
package testenv

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// NATS is an in-process JetStream server.
type NATS struct {
	t    testing.TB
	opts server.Options
	Srv  *server.Server
}

// StartNATS starts a JetStream server on a free loopback port with its own
// store directory; it is shut down when the test ends. Options may adjust
// the server options (users, permissions, TLS) before it starts.
func StartNATS(t testing.TB, options ...func(*server.Options)) *NATS {
	t.Helper()
	n := &NATS{t: t, opts: server.Options{
		Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
	}}
	for _, o := range options {
		o(&n.opts)
	}
	n.start()
	// Later starts reuse the port the first one got.
	n.opts.Port = n.Srv.Addr().(*net.TCPAddr).Port
	t.Cleanup(n.Stop)
	return n
}

func (n *NATS) start() {
	n.t.Helper()
	opts := n.opts
	s, err := server.NewServer(&opts)
	if err != nil {
		n.t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		n.t.Fatal("nats-server not ready")
	}
	n.Srv = s
}

// URL is the server's client URL (stable across restarts).
func (n *NATS) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.opts.Port) }

// Stop shuts the server down (an outage); it is safe to call twice.
func (n *NATS) Stop() {
	if n.Srv != nil {
		n.Srv.Shutdown()
		n.Srv.WaitForShutdown()
		n.Srv = nil
	}
}

// StoreDir is the server's JetStream store: removed while the server is
// stopped, the server restarts without its streams.
func (n *NATS) StoreDir() string { return n.opts.StoreDir }

// Restart starts the server again on the same port and store.
func (n *NATS) Restart() {
	n.t.Helper()
	n.Stop()
	n.start()
}

// Reload changes the server's options in place (users and permissions,
// say) and keeps them for later restarts.
func (n *NATS) Reload(change func(*server.Options)) {
	n.t.Helper()
	change(&n.opts)
	opts := n.opts
	if err := n.Srv.ReloadOptions(&opts); err != nil {
		n.t.Fatal(err)
	}
}

// Conn opens a plain client connection, closed when the test ends.
func (n *NATS) Conn(t testing.TB) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(n.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// JetStream returns a JetStream handle on a new connection.
func (n *NATS) JetStream(t testing.TB) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(n.Conn(t))
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// EventsStream creates the relay's default stream, EVENTS on events.>
// with a 1 h duplicate window, refusing messages over maxMsgSize bytes; or
// sets that limit on it.
func EventsStream(t testing.TB, js jetstream.JetStream, maxMsgSize int32) {
	t.Helper()
	cfg := jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour, MaxMsgSize: maxMsgSize}
	if _, err := js.CreateOrUpdateStream(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
}

// BystanderStream creates a stream no test publishes to (BYSTANDER, on
// bystander.>), for a test that deletes a stream and creates one: when an
// account's last stream is deleted, nats-server removes the account's
// streams directory after it answers, and a stream created meanwhile
// fails (err_code 10049, "error creating store for stream"; the server
// logs that mkdir found no such directory).
func BystanderStream(t testing.TB, js jetstream.JetStream) {
	t.Helper()
	cfg := jetstream.StreamConfig{Name: "BYSTANDER", Subjects: []string{"bystander.>"}}
	if _, err := js.CreateStream(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
}

// EditStream changes the stream's configuration as an operator does: it
// reads the configuration the server holds, applies edit to it and
// updates the stream, failing the test if the server refuses.
func EditStream(t testing.TB, js jetstream.JetStream, name string, edit func(*jetstream.StreamConfig)) {
	t.Helper()
	ctx := context.Background()
	s, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	edit(&cfg)
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatalf("update stream %s: %v", name, err)
	}
}

// ConsumeOne takes the first message on subject filter (empty: any) of
// the stream from a new durable pull consumer, as an application's
// consumer would, acknowledges it and returns it; it fails the test unless
// one comes within 10 s.
func ConsumeOne(t testing.TB, js jetstream.JetStream, stream, filter string) jetstream.Msg {
	t.Helper()
	cons, err := js.CreateConsumer(context.Background(), stream, jetstream.ConsumerConfig{Durable: "consume-one", FilterSubject: filter, AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var got []jetstream.Msg
	for m := range msgs.Messages() {
		m.Ack()
		got = append(got, m)
	}
	if len(got) != 1 {
		t.Fatalf("a consumer of %s on %q got %d messages, want 1", stream, filter, len(got))
	}
	return got[0]
}

// StreamMessages reads every message of a stream in sequence order.
func StreamMessages(t testing.TB, js jetstream.JetStream, stream string) []*jetstream.RawStreamMsg {
	t.Helper()
	msgs, err := ReadStream(context.Background(), js, stream)
	if err != nil {
		t.Fatal(err)
	}
	return msgs
}

// ReadStream reads every message of a stream in sequence order, up to the
// last one stored when the read ends, or returns why it could not: for
// goroutines other than the test's, which may not end the test, and reads
// during an outage. It reads on past the last sequence the stream's info
// gave until a sequence holds no message: the server may answer an info
// request while it stores an atomic batch, whose last sequence is then
// that of a part of the batch, but answers a message request only before
// or after storing a whole batch.
func ReadStream(ctx context.Context, js jetstream.JetStream, stream string) ([]*jetstream.RawStreamMsg, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []*jetstream.RawStreamMsg
	for seq := max(info.State.FirstSeq, 1); ; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) && seq > info.State.LastSeq {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("get message %d: %w", seq, err)
		}
		out = append(out, m)
	}
}

// NewDB creates a migrated outbox database and returns its path.
func NewDB(t testing.TB) string {
	t.Helper()
	return NewDBIn(t, t.TempDir())
}

// NewDBIn creates a migrated outbox database, app.db, in dir and returns
// its path.
func NewDBIn(t testing.TB, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "app.db")
	s, err := sqlitedb.Open(context.Background(), sqlitedb.Options{Path: path, Table: "event_queue", BusyTimeout: 5 * time.Second, Create: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := schema.Migrate(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	return path
}

// OpenDB opens the outbox database at path, closed when the test ends.
func OpenDB(t testing.TB, path string) *sqlitedb.DB {
	t.Helper()
	return openDB(t, sqlitedb.Options{Path: path})
}

// CreateDB opens the database at path like OpenDB, creating the file if it
// is missing; it migrates nothing.
func CreateDB(t testing.TB, path string) *sqlitedb.DB {
	t.Helper()
	return openDB(t, sqlitedb.Options{Path: path, Create: true})
}

// MigratedDB opens a new migrated outbox database (NewDB, then OpenDB).
func MigratedDB(t testing.TB) *sqlitedb.DB {
	t.Helper()
	return OpenDB(t, NewDB(t))
}

func openDB(t testing.TB, o sqlitedb.Options) *sqlitedb.DB {
	t.Helper()
	o.Table, o.BusyTimeout = "event_queue", 5*time.Second
	s, err := sqlitedb.Open(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// MustExec runs one statement on db, failing the test on an error.
func MustExec(t testing.TB, db *sql.DB, q string, args ...any) {
	t.Helper()
	if _, err := db.Exec(q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// Strings runs a query of one text column and returns its values.
func Strings(t testing.TB, db *sql.DB, q string, args ...any) []string {
	t.Helper()
	rows, err := db.Query(q, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// QueryPlan returns EXPLAIN QUERY PLAN's details for q on db's reader,
// joined by "; ".
func QueryPlan(t testing.TB, db *sqlitedb.DB, q string, args ...any) string {
	t.Helper()
	rows, err := db.Reader().Query(`EXPLAIN QUERY PLAN `+q, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, unused int
		var detail string
		if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, detail)
	}
	return strings.Join(plan, "; ")
}

// InsertRows inserts n rows with the given status (and a fresh event id
// each) in one transaction.
func InsertRows(t testing.TB, db *sql.DB, n int, status string) {
	t.Helper()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	st, err := tx.Prepare(`INSERT INTO event_queue (event_id, event_type, payload, status) VALUES (?, 'Thing', x'00ff', ?)`)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for range n {
		if _, err := st.Exec(event.NewID(), status); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// InsertParkedKeys writes rows (ids 1 to 12) of ordering keys that dead
// letters park, and rows that park nothing. Key a's earliest dead letter
// is row 2, event_type T2, dead-lettered at 2000 (Unix ms) with
// "nats: permission denied", and rows 3 and 5 are pending after it (row 4
// is a later dead letter, row 6 processing). Key b's is row 8, T8, at 1000
// with "message size exceeds maximum allowed", with row 12 pending after
// it and row 7 before it. Key c has no dead letter, and dead letters
// without a key (NULL or empty) order nothing. Row n's event_id is "en".
func InsertParkedKeys(t testing.TB, db *sql.DB) {
	t.Helper()
	for _, r := range []struct {
		id        int
		key       any
		status    string
		processed any
		lastError any
	}{
		{1, "a", "done", 500, nil},
		{2, "a", "dead_lettered", 2000, "nats: permission denied"},
		{3, "a", "pending", nil, nil},
		{4, "a", "dead_lettered", 4000, "a later one"},
		{5, "a", "pending", nil, nil},
		{6, "a", "processing", nil, nil},
		{7, "b", "pending", nil, nil},
		{8, "b", "dead_lettered", 1000, "message size exceeds maximum allowed"},
		{9, "c", "pending", nil, nil},
		{10, nil, "dead_lettered", 100, "unordered"},
		{11, "", "dead_lettered", 100, "unordered too"},
		{12, "b", "pending", nil, nil},
	} {
		MustExec(t, db, `INSERT INTO event_queue (id, event_id, event_type, payload, status, processed_at, last_error, ordering_key)
			VALUES (?1, 'e' || ?1, 'T' || ?1, 'x', ?2, ?3, ?4, ?5)`, r.id, r.status, r.processed, r.lastError, r.key)
	}
}

// AppDB is the application's own connection pool to the file.
func AppDB(t testing.TB, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=10000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// Event is a row as the application inserts it; a nil EventID leaves the
// column NULL.
type Event struct {
	EventID     *string
	EventType   string
	Payload     []byte
	OrderingKey string // empty: NULL
	Headers     string // the headers column; empty: NULL
	AtomicGroup string // empty: NULL
}

// NewEvent returns an event with a fresh id.
func NewEvent(eventType string, payload []byte) Event {
	id := event.NewID()
	return Event{EventID: &id, EventType: eventType, Payload: payload}
}

// Insert writes events in one transaction, the way an application does.
func Insert(db *sql.DB, evs ...Event) error {
	_, err := insert(db, evs)
	return err
}

// InsertIDs inserts events in one transaction and returns their row ids.
func InsertIDs(t testing.TB, db *sql.DB, evs ...Event) []int64 {
	t.Helper()
	ids, err := insert(db, evs)
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func insert(db *sql.DB, evs []Event) ([]int64, error) {
	tx, err := db.Begin()
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	ids := make([]int64, 0, len(evs))
	for _, e := range evs {
		var id any
		if e.EventID != nil {
			id = *e.EventID
		}
		// Optional columns only when set: a table from before them has none.
		cols, args := "event_id, event_type, payload", []any{id, e.EventType, e.Payload}
		if e.OrderingKey != "" {
			cols, args = cols+", ordering_key", append(args, e.OrderingKey)
		}
		if e.Headers != "" {
			cols, args = cols+", headers", append(args, e.Headers)
		}
		if e.AtomicGroup != "" {
			cols, args = cols+", atomic_group", append(args, e.AtomicGroup)
		}
		q := `INSERT INTO event_queue (` + cols + `) VALUES (?` + strings.Repeat(", ?", len(args)-1) + `)`
		res, err := tx.Exec(q, args...)
		if err != nil {
			return nil, err
		}
		rowID, err := res.LastInsertId()
		if err != nil {
			return nil, err
		}
		ids = append(ids, rowID)
	}
	return ids, tx.Commit()
}

// Counts returns the number of rows per status.
func Counts(t testing.TB, db *sql.DB) map[string]int {
	t.Helper()
	rows, err := db.Query(`SELECT status, count(*) FROM event_queue GROUP BY status`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			t.Fatal(err)
		}
		out[s] = n
	}
	return out
}

// Eventually polls cond every 20 ms until it holds or timeout passes.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Cluster is a JetStream cluster of in-process servers on loopback, each
// with its own store directory.
type Cluster struct {
	t       testing.TB
	opts    []server.Options
	Servers []*server.Server // nil where stopped
}

// StartCluster starts n clustered JetStream servers and waits until the
// cluster has elected its meta leader. They are shut down when the test ends.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	c := &Cluster{t: t, Servers: make([]*server.Server, n)}
	clusterPorts := make([]int, n)
	for i := range clusterPorts {
		clusterPorts[i] = FreePort(t)
	}
	var routes []string
	for _, p := range clusterPorts {
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", p))
	}
	for i := 0; i < n; i++ {
		c.opts = append(c.opts, server.Options{
			ServerName: fmt.Sprintf("n%d", i+1), Host: "127.0.0.1", Port: FreePort(t),
			JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
			Cluster: server.ClusterOpts{Name: "outbox-test", Host: "127.0.0.1", Port: clusterPorts[i]},
			Routes:  server.RoutesFromStr(strings.Join(routes, ",")),
		})
	}
	for i := range c.opts {
		opts := c.opts[i]
		s, err := server.NewServer(&opts)
		if err != nil {
			t.Fatal(err)
		}
		go s.Start()
		c.Servers[i] = s
	}
	t.Cleanup(func() {
		for i := range c.Servers {
			c.Stop(i)
		}
	})
	for _, s := range c.Servers {
		if !s.ReadyForConnections(20 * time.Second) {
			t.Fatal("cluster server not ready")
		}
	}
	nc, err := nats.Connect(c.URLs())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	Eventually(t, 60*time.Second, "a JetStream meta leader", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := js.AccountInfo(ctx)
		return err == nil
	})
	return c
}

// URLs are the client URLs of every server, comma-separated.
func (c *Cluster) URLs() string {
	var urls []string
	for _, o := range c.opts {
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", o.Port))
	}
	return strings.Join(urls, ",")
}

// Index returns the index of the server named name.
func (c *Cluster) Index(name string) int {
	for i, o := range c.opts {
		if o.ServerName == name {
			return i
		}
	}
	c.t.Fatalf("no server %s", name)
	return -1
}

// URL is one server's client URL.
func (c *Cluster) URL(i int) string { return fmt.Sprintf("nats://127.0.0.1:%d", c.opts[i].Port) }

// Stop shuts server i down (a crash of that node); safe to call twice.
func (c *Cluster) Stop(i int) {
	if s := c.Servers[i]; s != nil {
		s.Shutdown()
		s.WaitForShutdown()
		c.Servers[i] = nil
	}
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// LegacyClaim marks up to n pending rows processing for owner, as a
// claimer that writes its claims does (an older relay, or another
// implementation of the same design), and returns how many it took.
func LegacyClaim(t testing.TB, db *sql.DB, owner string, n int) int64 {
	t.Helper()
	res, err := db.Exec(`UPDATE event_queue SET status = 'processing', claimed_at = ?, claimed_by = ?
WHERE id IN (SELECT id FROM event_queue WHERE status = 'pending' ORDER BY id LIMIT ?)`, time.Now().UnixMilli(), owner, n)
	if err != nil {
		t.Fatal(err)
	}
	k, _ := res.RowsAffected()
	return k
}

// LegacyNullable is an outbox table from before the relay's migrations,
// whose available_at may be NULL.
const LegacyNullable = `CREATE TABLE event_queue (
	id INTEGER PRIMARY KEY,
	event_type TEXT NOT NULL,
	payload BLOB NOT NULL,
	status TEXT NOT NULL DEFAULT 'pending',
	attempts INTEGER NOT NULL DEFAULT 0,
	available_at INTEGER,
	created_at INTEGER NOT NULL DEFAULT 0,
	processed_at INTEGER,
	last_error TEXT)`

// NullableCreatedAtDB is a migrated database whose outbox is the
// application's own table with a created_at that may be NULL (the
// migration leaves column definitions as they are): the relay's
// connection, and the application's.
func NullableCreatedAtDB(t testing.TB) (*sqlitedb.DB, *sql.DB) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "app.db")
	app := AppDB(t, path)
	MustExec(t, app, `CREATE TABLE event_queue (id INTEGER PRIMARY KEY AUTOINCREMENT, event_type TEXT NOT NULL, payload BLOB NOT NULL,
		status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0, available_at INTEGER, created_at INTEGER, processed_at INTEGER, last_error TEXT)`)
	s := OpenDB(t, path)
	if _, err := schema.Migrate(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	return s, app
}

// LegacyRows fills a LegacyNullable table with n pending rows created at
// consecutive milliseconds from 1700000000000, available_at NULL.
func LegacyRows(t testing.TB, db *sql.DB, n int) {
	t.Helper()
	MustExec(t, db, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
		INSERT INTO event_queue (id, event_type, payload, created_at) SELECT i, 'Legacy', 'legacy ' || i, 1700000000000 + i FROM n`, n)
}

// LegacyDB is a WAL database holding a legacy outbox of n rows.
func LegacyDB(t testing.TB, n int) (string, *sql.DB) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "app.db")
	db := AppDB(t, path)
	MustExec(t, db, `PRAGMA journal_mode = WAL`)
	MustExec(t, db, LegacyNullable)
	LegacyRows(t, db, n)
	return path, db
}

// ReplaceEnv makes env ("NAME=value") the only variables of the process
// environment whose name starts with prefix or is one of names, until the
// test ends: the others are unset first, whoever set them (the shell that
// runs the tests, an earlier step of the same test). t.Setenv puts
// everything back afterwards, and refuses parallel tests, which would
// share the environment.
func ReplaceEnv(t testing.TB, prefix string, names []string, env []string) {
	t.Helper()
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, prefix) || slices.Contains(names, name) {
			t.Setenv(name, "")
			if err := os.Unsetenv(name); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, kv := range env {
		if name, val, ok := strings.Cut(kv, "="); ok {
			t.Setenv(name, val)
		}
	}
}

// ProcIO returns the field (rchar, syscr, ...) of /proc/self/io: what this
// process has read or written so far. Where there is no /proc/self/io
// (not Linux) the test is skipped.
func ProcIO(t testing.TB, field string) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		t.Skip("no /proc/self/io:", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+": "); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/self/io: %q", field, b)
	return 0
}

// HoldExclusive holds db's file as an application in exclusive locking
// mode does, on one of db's connections (db must be the file's only
// handle): in WAL mode the lock is taken at the first write, a row of
// event_queue, and held until that connection closes, with db at the
// test's end.
func HoldExclusive(t testing.TB, db *sql.DB) {
	t.Helper()
	conn, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	for _, q := range []string{`PRAGMA locking_mode = EXCLUSIVE`, `INSERT INTO event_queue (event_id, event_type, payload) VALUES ('held', 'T', x'00')`} {
		if _, err := conn.ExecContext(context.Background(), q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
}
