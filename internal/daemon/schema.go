package daemon

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// checkSchemaOff is schema.mode off's check at startup. The application
// owns the schema, and may index the table its own way: what verify finds
// missing only in indexes is logged and the relay starts. A missing table
// or column, or a time column that cannot hold milliseconds, is refused:
// the relay's claims and settles would fail on every row (or never find
// one due), and /readyz would blame whatever it probed first.
func checkSchemaOff(ctx context.Context, s *sqlitedb.DB, log *zap.Logger) error {
	err := schema.Verify(ctx, s)
	if err == nil || !errors.Is(err, schema.ErrSchema) {
		return err
	}
	if cannotRun(err, s.Path()) {
		return fmt.Errorf("schema.mode is off, but the relay cannot run on this schema (run `outbox-relay migrate`, or set schema.mode: auto): %w", err)
	}
	log.Warn("schema.mode is off: starting without the relay's indexes; claims read more of the table than they would with them "+
		"(run `outbox-relay migrate`, or set schema.mode: auto, to create them)", zap.String("table", s.Table()), zap.Error(err))
	return nil
}

// cannotRun reports whether what schema.Verify found names a table or a
// column (missing, or of a type the relay cannot use), not only indexes.
// Verify lists its findings as "missing a, b (...); problem; problem",
// each beginning with what it is about.
func cannotRun(verifyErr error, path string) bool {
	_, found, ok := strings.Cut(verifyErr.Error(), path+": ")
	if !ok {
		return true // not the shape Verify gives: refuse rather than guess
	}
	for _, part := range strings.Split(found, "; ") {
		for _, item := range strings.Split(strings.TrimPrefix(part, "missing "), ", ") {
			if strings.HasPrefix(item, "column ") || strings.HasPrefix(item, "table ") {
				return true
			}
		}
	}
	return false
}
