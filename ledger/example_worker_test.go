package ledger_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/ledger"
)

// Mailer sends an email; the receiving end drops a second send with the
// same idempotency key.
type Mailer interface {
	Send(ctx context.Context, idempotencyKey string, body []byte) error
}

// work is docs/ledger.md's worker ("In Go"), kept here so that it compiles
// and runs: it handles the relay's events on the application's SQLite file
// at path until ctx ends.
func work(ctx context.Context, nc *nats.Conn, path string, mailer Mailer, reg prometheus.Registerer, log *zap.Logger) error {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close()
	h, err := ledger.NewHandlers(ledger.New(db, ledger.Options{}), reg) // Lease, StaleAfter: see "The lease and the heartbeat"
	if err != nil {
		return err
	}
	// Exactly once: the write commits with the done mark. Write through tx only.
	h.HandleTx("ReviewLogged", "movie-stats", func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		var r struct{ Movie string }
		if err := json.Unmarshal(ev.Data, &r); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `UPDATE movies SET reviews = reviews + 1 WHERE title = ?`, r.Movie)
		return err
	})
	// At least once: the mail server sees ev.ID as the idempotency key.
	h.Handle("WatchlistItemAdded", "watchlist-mailer", func(ctx context.Context, ev ledger.Event) error {
		return mailer.Send(ctx, ev.ID, ev.Data)
	})

	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	cons, err := js.Consumer(ctx, "EVENTS", "worker") // managed by the relay: consumer.durable
	if err != nil {
		return err
	}
	w, err := ledger.NewWorker(cons, h, ledger.WorkerOptions{SubjectPrefix: "events", Concurrency: 4, Log: log})
	if err != nil {
		return err
	}
	return w.Run(ctx) // until ctx ends; running handlers finish
}

// The worker of docs/ledger.md on an in-process JetStream server, with the
// stream and the consumer the relay would manage: a review is counted
// once, and the mailer gets its event.
func Example_worker() {
	dir, err := os.MkdirTemp("", "ledger-worker")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: filepath.Join(dir, "nats"), NoLog: true, NoSigs: true})
	if err != nil {
		log.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		log.Fatal("nats-server not ready")
	}
	defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	path := filepath.Join(dir, "app.db")
	exampleSetup(nc, path)

	ctx, stop := context.WithCancel(context.Background())
	mailer := &sentMail{}
	done := make(chan error, 1)
	go func() { done <- work(ctx, nc, path, mailer, prometheus.NewRegistry(), zap.NewNop()) }()
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	var reviews int
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if db.QueryRow(`SELECT reviews FROM movies WHERE title = 'Alien'`).Scan(&reviews); reviews > 0 && mailer.count() > 0 {
			break
		}
	}
	stop()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	fmt.Println("Alien reviews:", reviews)
	fmt.Println("mails sent:", mailer.count())
	// Output:
	// Alien reviews: 1
	// mails sent: 1
}

// exampleSetup creates what the relay and the application would have: the
// ledger's and the application's tables, the stream, the durable consumer,
// and two events on the stream.
func exampleSetup(nc *nats.Conn, path string) {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000&_journal_mode=WAL")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	for _, q := range []string{
		`CREATE TABLE processed_events (event_id TEXT NOT NULL, handler TEXT NOT NULL, status TEXT NOT NULL,
			started_at INTEGER, processed_at INTEGER, PRIMARY KEY (event_id, handler))`,
		`CREATE TABLE movies (title TEXT PRIMARY KEY, reviews INTEGER NOT NULL DEFAULT 0)`,
		`INSERT INTO movies (title) VALUES ('Alien')`,
	} {
		if _, err := db.Exec(q); err != nil {
			log.Fatal(err)
		}
	}
	ctx := context.Background()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Duplicates: time.Hour}); err != nil {
		log.Fatal(err)
	}
	if _, err := js.CreateConsumer(ctx, "EVENTS", jetstream.ConsumerConfig{Durable: "worker", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: 10, AckWait: 30 * time.Second}); err != nil {
		log.Fatal(err)
	}
	for id, ev := range map[string]struct{ typ, data string }{
		"5f0c7b2e-7c1a-4d2b-9a53-0c8e1f2d3a41": {"ReviewLogged", `{"movie": "Alien", "stars": 5}`},
		"a8d4c6e0-3b9f-4f1e-8c27-6d5e4b3a2f10": {"WatchlistItemAdded", `{"movie": "Heat"}`},
	} {
		msg := &nats.Msg{Subject: "events." + ev.typ, Header: nats.Header{}, Data: []byte(ev.data)}
		msg.Header.Set(jetstream.MsgIDHeader, id)
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			log.Fatal(err)
		}
	}
}

// sentMail is a Mailer that counts what it sends, each call: a mail
// sent twice counts twice.
type sentMail struct {
	mu    sync.Mutex
	sends int
}

func (m *sentMail) Send(context.Context, string, []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sends++
	return nil
}

func (m *sentMail) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sends
}
