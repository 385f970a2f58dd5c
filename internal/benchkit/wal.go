package benchkit

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
)

// WALPin is a read transaction held open on a database file, on a
// connection of its own, begun right after a checkpoint emptied the WAL.
// While it holds its snapshot no checkpoint (the relay's, the
// application's, or SQLite's automatic one) can copy a frame into the
// database, and no writer can restart the WAL from its beginning: the WAL
// only grows, by one frame (page size + 24 bytes) for every page any
// connection writes in a transaction, so its growth is what the writes
// cost in WAL. Without the pin, checkpoints and restarts would make the
// file's size say little.
type WALPin struct {
	db       *sql.DB
	tx       *sql.Tx
	wal      string
	before   int64
	pageSize int
}

// PinWAL empties the WAL of the database at path (PRAGMA
// wal_checkpoint(TRUNCATE), which fails while another connection reads or
// writes) and begins a read transaction on table (BEGIN; SELECT count(*)),
// held until Close.
func PinWAL(ctx context.Context, path, table string) (p *WALPin, err error) {
	db, err := sql.Open("sqlite3", "file:"+path+"?_busy_timeout=5000")
	if err != nil {
		return nil, fmt.Errorf("pin the WAL: %w", err)
	}
	db.SetMaxOpenConns(1)
	defer func() {
		if err != nil {
			db.Close()
			err = fmt.Errorf("pin the WAL: %w", err)
		}
	}()
	p = &WALPin{db: db, wal: path + "-wal"}
	var busy, frames, copied int
	if err := db.QueryRowContext(ctx, `PRAGMA wal_checkpoint(TRUNCATE)`).Scan(&busy, &frames, &copied); err != nil {
		return nil, err
	}
	if busy != 0 || frames != 0 {
		return nil, fmt.Errorf("the WAL was not emptied (busy %d, %d frames left): is it in WAL mode, and idle?", busy, frames)
	}
	if err := db.QueryRowContext(ctx, `PRAGMA page_size`).Scan(&p.pageSize); err != nil {
		return nil, err
	}
	if p.tx, err = db.BeginTx(ctx, nil); err != nil {
		return nil, err
	}
	// The snapshot is taken by the first read, not by BEGIN.
	var n int64
	if err := p.tx.QueryRowContext(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil {
		p.tx.Rollback()
		return nil, err
	}
	if p.before, err = p.walSize(); err != nil {
		p.tx.Rollback()
		return nil, err
	}
	return p, nil
}

// Grown returns how many bytes the WAL grew by since PinWAL.
func (p *WALPin) Grown() (int64, error) {
	size, err := p.walSize()
	if err != nil {
		return 0, fmt.Errorf("measure the WAL: %w", err)
	}
	return size - p.before, nil
}

// PageSize is the database's page size: a WAL frame is that and 24 bytes.
func (p *WALPin) PageSize() int { return p.pageSize }

// Close ends the read transaction and closes its connection.
func (p *WALPin) Close() error {
	return errors.Join(p.tx.Rollback(), p.db.Close())
}

// walSize is the -wal file's size, 0 while there is none.
func (p *WALPin) walSize() (int64, error) {
	fi, err := os.Stat(p.wal)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}
