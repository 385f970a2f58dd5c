package ledger_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"

	_ "github.com/mattn/go-sqlite3"

	"github.com/outbox-relay/outbox-relay/ledger"
)

// An order's confirmation is recorded in the same transaction as its
// ledger mark: a second delivery of the same event skips the handler.
func ExampleHandlers() {
	dir, err := os.MkdirTemp("", "ledger-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite3", "file:"+filepath.Join(dir, "app.db")+"?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	// outbox-relay's migrations create processed_events; the application
	// owns confirmations.
	for _, q := range []string{
		`CREATE TABLE processed_events (event_id TEXT NOT NULL, handler TEXT NOT NULL, status TEXT NOT NULL,
			started_at INTEGER, processed_at INTEGER, PRIMARY KEY (event_id, handler))`,
		`CREATE TABLE confirmations (order_id TEXT NOT NULL)`,
	} {
		if _, err := db.Exec(q); err != nil {
			log.Fatal(err)
		}
	}

	handlers, err := ledger.NewHandlers(ledger.New(db, ledger.Options{}), nil)
	if err != nil {
		log.Fatal(err)
	}
	handlers.HandleTx("OrderPlaced", "confirm-order", func(ctx context.Context, tx *sql.Tx, ev ledger.Event) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO confirmations (order_id) VALUES (?)`, string(ev.Data))
		return err
	})

	ev := ledger.Event{ID: "0b8f5c1e-8d2a-4c53-9f7e-3f1d2a6b7c80", Type: "OrderPlaced", Data: []byte("order-42"), Delivery: 1}
	for delivery := 1; delivery <= 2; delivery++ {
		ev.Delivery = delivery
		v, err := handlers.Dispatch(context.Background(), ev)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: done %v\n", delivery, v.Done())
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM confirmations`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("confirmations:", n)
	// Output:
	// delivery 1: done true
	// delivery 2: done true
	// confirmations: 1
}
