// Package benchkit is what benchmarks and the bench command need of an
// outbox and a JetStream server beyond what the relay itself does: seeding
// rows, reading back how they went, measuring the standard client's
// publish ceiling, and fresh streams per measurement. It works on a plain
// *sql.DB and the nats.go client, so that no production type carries
// methods only a benchmark uses, and the ceiling shares no code with the
// relay's publishing path.
package benchkit

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/schema"
)

// Seed inserts n synthetic rows of type BenchEvent into table with
// payloads of size random bytes and random event ids, in the given status
// (done rows get processed_at = now), in transactions of 50,000 rows. With
// the option Keys(k), row i of the n (0 the first, in id order) gets the
// ordering_key OrderingKey(i % k); without it, none. With GroupsOf(g), row
// i gets the atomic_group GroupName(i / g), and each group's rows are
// written by one INSERT (the transactions hold a whole number of groups);
// without it, none.
func Seed(ctx context.Context, db *sql.DB, table string, n, size int, status string, opts ...SeedOption) error {
	var so seedOptions
	for _, o := range opts {
		o(&so)
	}
	chunk := 50_000
	if so.group > 0 {
		chunk = max(so.group, chunk-chunk%so.group) // whole groups
	}
	processed := "NULL"
	if status == "done" {
		processed = `CAST(unixepoch('subsec') * 1000 AS INTEGER)`
	}
	// ?1 rows from row ?4 of the n on, ?5 keys (0: none), ?6 rows a group
	// (0: none).
	q := fmt.Sprintf(`WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?1)
INSERT INTO %s (event_id, event_type, payload, status, processed_at, ordering_key, atomic_group)
SELECT 'bench-' || lower(hex(randomblob(16))), 'BenchEvent', randomblob(?2), ?3, %s,
	CASE WHEN ?5 > 0 THEN '%s' || ((?4 + i) %% ?5) END,
	CASE WHEN ?6 > 0 THEN '%s' || ((?4 + i) / ?6) END FROM n ORDER BY i`, table, processed, keyPrefix, groupPrefix)
	for done := 0; done < n; done += chunk {
		if _, err := db.ExecContext(ctx, q, min(n-done, chunk), size, status, done, so.keys, so.group); err != nil {
			return fmt.Errorf("seed rows: %w", err)
		}
	}
	return nil
}

// SeedOption changes what Seed writes.
type SeedOption func(*seedOptions)

type seedOptions struct{ keys, group int }

// Keys gives the seeded rows k ordering keys round robin (0: none).
func Keys(k int) SeedOption { return func(o *seedOptions) { o.keys = k } }

// GroupsOf puts every g consecutive seeded rows in one atomic group (0:
// none); the last group holds the rows left over.
func GroupsOf(g int) SeedOption { return func(o *seedOptions) { o.group = g } }

// keyPrefix begins every ordering key Seed writes; groupPrefix every
// atomic group.
const (
	keyPrefix   = "bench-key-"
	groupPrefix = "bench-group-"
)

// OrderingKey is the ordering key Seed gives the rows of key number i.
func OrderingKey(i int) string { return keyPrefix + strconv.Itoa(i) }

// GroupName is the atomic_group Seed gives the rows of group number i.
func GroupName(i int) string { return groupPrefix + strconv.Itoa(i) }

// Drained reports whether no row of table is pending or processing.
func Drained(ctx context.Context, db *sql.DB, table string) (bool, error) {
	var busy bool
	err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %[1]s WHERE status = 'pending') OR EXISTS (SELECT 1 FROM %[1]s WHERE status = 'processing')`, table)).Scan(&busy)
	if err != nil {
		return false, fmt.Errorf("read backlog: %w", err)
	}
	return !busy, nil
}

// LastProcessed returns the latest processed_at of table, and of its done
// table's records when it has one (see schema.DoneTable).
func LastProcessed(ctx context.Context, db *sql.DB, table string) (time.Time, error) {
	q := `SELECT max(processed_at) FROM ` + table
	if ok, err := HasDoneTable(ctx, db, table); err != nil {
		return time.Time{}, fmt.Errorf("read last processed: %w", err)
	} else if ok {
		q = `SELECT max(m) FROM (SELECT max(processed_at) AS m FROM ` + table + ` UNION ALL SELECT max(processed_at) FROM ` + schema.DoneTable(table) + `)`
	}
	var v sql.NullInt64
	if err := db.QueryRowContext(ctx, q).Scan(&v); err != nil {
		return time.Time{}, fmt.Errorf("read last processed: %w", err)
	}
	return time.UnixMilli(v.Int64), nil
}

// Lags returns, for the done rows of table with an id above afterID (and
// the records of its done table, see schema.DoneTable), processed_at minus
// created_at in milliseconds, sorted: from the application's insert to the
// row being settled as done after its PubAck.
func Lags(ctx context.Context, db *sql.DB, table string, afterID int64) ([]int64, error) {
	q := `SELECT processed_at - created_at FROM ` + table + ` WHERE id > ?1 AND status = 'done'`
	if ok, err := HasDoneTable(ctx, db, table); err != nil {
		return nil, fmt.Errorf("read lags: %w", err)
	} else if ok {
		q += ` UNION ALL SELECT processed_at - created_at FROM ` + schema.DoneTable(table) + ` WHERE id > ?1`
	}
	rows, err := db.QueryContext(ctx, q+` ORDER BY 1`, afterID)
	if err != nil {
		return nil, fmt.Errorf("read lags: %w", err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var v int64
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// DoneKeys returns the ordering key ("" for none) of every done row of
// table by id (the records of its done table among them, see schema.DoneTable),
// and how many of its rows are not done.
func DoneKeys(ctx context.Context, db *sql.DB, table string) (keys map[int64]string, notDone int, err error) {
	q := `SELECT id, coalesce(ordering_key, ''), status = 'done' FROM ` + table
	if ok, err := HasDoneTable(ctx, db, table); err != nil {
		return nil, 0, fmt.Errorf("read ordering keys: %w", err)
	} else if ok {
		q += ` UNION ALL SELECT id, coalesce(ordering_key, ''), 1 FROM ` + schema.DoneTable(table)
	}
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		return nil, 0, fmt.Errorf("read ordering keys: %w", err)
	}
	defer rows.Close()
	keys = map[int64]string{}
	for rows.Next() {
		var id int64
		var key string
		var done bool
		if err := rows.Scan(&id, &key, &done); err != nil {
			return nil, 0, fmt.Errorf("read ordering keys: %w", err)
		}
		if !done {
			notDone++
			continue
		}
		keys[id] = key
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read ordering keys: %w", err)
	}
	return keys, notDone, nil
}

// AtomicGroups returns the atomic_group of every row of table that has
// one, by id. The records of its done table keep no group (see
// schema.DoneTable): read them before the relay settles the rows.
func AtomicGroups(ctx context.Context, db *sql.DB, table string) (map[int64]string, error) {
	rows, err := db.QueryContext(ctx, `SELECT id, atomic_group FROM `+table+` WHERE atomic_group IS NOT NULL`)
	if err != nil {
		return nil, fmt.Errorf("read atomic groups: %w", err)
	}
	defer rows.Close()
	groups := map[int64]string{}
	for rows.Next() {
		var id int64
		var g string
		if err := rows.Scan(&id, &g); err != nil {
			return nil, fmt.Errorf("read atomic groups: %w", err)
		}
		groups[id] = g
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read atomic groups: %w", err)
	}
	return groups, nil
}

// HasDoneTable reports whether table's done table (schema.DoneTable) exists. The
// read-backs above count its records as done rows when it does, so that
// they read a drain the same whichever retention.done_rows it ran with.
func HasDoneTable(ctx context.Context, db *sql.DB, table string) (bool, error) {
	var ok bool
	err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?)`, schema.DoneTable(table)).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("look for table %s: %w", schema.DoneTable(table), err)
	}
	return ok, nil
}

// MoveDone turns the done rows of table into records in its done table
// (schema.DoneTable), in one transaction, as a relay with retention.done_rows:
// delete would have left them: Seed's done rows for a relay in that mode.
func MoveDone(ctx context.Context, db *sql.DB, table string) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("move done rows: %w", err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+schema.DoneTable(table)+` (id, event_id, event_type, ordering_key, created_at, processed_at, stream_seq)
SELECT id, event_id, event_type, ordering_key, created_at, processed_at, stream_seq FROM `+table+` WHERE status = 'done' ORDER BY id`); err != nil {
		return fmt.Errorf("move done rows: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+table+` WHERE status = 'done'`); err != nil {
		return fmt.Errorf("move done rows: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("move done rows: %w", err)
	}
	return nil
}

// Ceiling publishes n messages of size bytes to subject with the standard
// client's asynchronous JetStream publish, as `nats bench js pub async
// --dedup` does, each with the headers the relay sets (a fresh
// Nats-Msg-Id, Outbox-Event-Type, Outbox-Row-Id, Outbox-Created-At),
// keeping at most maxPending acks outstanding, and returns how long it
// took until every PubAck arrived: the rate a relay is measured against.
func Ceiling(ctx context.Context, nc *nats.Conn, subject string, n, size, maxPending int) (time.Duration, error) {
	var failed atomic.Int64
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(maxPending),
		jetstream.WithPublishAsyncTimeout(30*time.Second),
		jetstream.WithPublishAsyncErrHandler(func(jetstream.JetStream, *nats.Msg, error) { failed.Add(1) }))
	if err != nil {
		return 0, err
	}
	payload := make([]byte, size)
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	start := time.Now()
	for i := 0; i < n; i++ {
		m := nats.NewMsg(subject)
		m.Data = payload
		m.Header.Set("Nats-Msg-Id", tag+"-"+strconv.Itoa(i))
		m.Header.Set("Outbox-Event-Type", "BenchEvent")
		m.Header.Set("Outbox-Row-Id", strconv.Itoa(i+1))
		m.Header.Set("Outbox-Created-At", time.Now().UTC().Format("2006-01-02T15:04:05.000Z07:00"))
		if _, err := js.PublishMsgAsync(m, jetstream.WithStallWait(30*time.Second)); err != nil {
			return 0, fmt.Errorf("publish: %w", err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	elapsed := time.Since(start)
	if k := failed.Load(); k > 0 {
		return elapsed, fmt.Errorf("%d of %d publishes failed", k, n)
	}
	return elapsed, nil
}

// errStreamCreate is JetStream's err_code for a stream it failed to create.
const errStreamCreate = 10049

// ReplaceStream deletes the stream old (none when empty; one already gone
// is fine) and creates the stream name empty, with file storage and the
// given dedup window: a fresh stream per measurement. A new name each
// time, and a few tries at creating it: a stream created just after
// another was deleted can fail while the server still removes the old
// one's files (see below).
func ReplaceStream(ctx context.Context, js jetstream.JetStream, old, name string, subjects []string, window time.Duration) error {
	if old != "" {
		if err := js.DeleteStream(ctx, old); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("delete stream %s: %w", old, err)
		}
	}
	cfg := jetstream.StreamConfig{Name: name, Subjects: subjects, Storage: jetstream.FileStorage, Duplicates: window}
	// A stream created just after the account's last stream was deleted
	// sometimes fails on nats-server 2.15 with "error creating store for
	// stream" (err_code 10049; the server logs that creating its
	// directory found "no such file or directory"): a few times in 400
	// delete-and-create rounds here. Try again.
	for try := 0; ; try++ {
		_, err := js.CreateStream(ctx, cfg)
		var api *jetstream.APIError
		if err == nil || try == 10 || !errors.As(err, &api) || api.ErrorCode != errStreamCreate {
			if err != nil {
				return fmt.Errorf("create stream %s: %w", name, err)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// EnvInt reads a benchmark's tuning knob from the environment variable
// name (BENCH_BATCH, say): def when it is unset or not an integer.
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// EnvDuration reads a benchmark's duration knob from the environment
// variable name (BENCH_SETTLE_WINDOW, say): 0 when it is unset or not a
// duration.
func EnvDuration(name string) time.Duration {
	d, _ := time.ParseDuration(os.Getenv(name))
	return d
}
