package daemon

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
)

// checkSchemaOff is schema.mode off's check at startup. The application
// owns the schema, and may index the table its own way: what verify finds
// missing beyond what the relay cannot work without (schema.Usable) is
// logged and the relay starts. A missing table or column, or a time column
// that cannot hold milliseconds, is refused: the relay's claims and
// settles would fail on every row (or never find one due), and /readyz
// would blame whatever it probed first.
func checkSchemaOff(ctx context.Context, s *sqlitedb.DB, log *zap.Logger) error {
	if err := schema.Usable(ctx, s); err != nil {
		if !errors.Is(err, schema.ErrSchema) {
			return err
		}
		return fmt.Errorf("schema.mode is off, but the relay cannot run on this schema (run `outbox-relay migrate`, or set schema.mode: auto): %w", err)
	}
	err := schema.Verify(ctx, s)
	if err == nil || !errors.Is(err, schema.ErrSchema) {
		return err
	}
	log.Warn("schema.mode is off: starting without the relay's indexes; claims read more of the table than they would with them "+
		"(run `outbox-relay migrate`, or set schema.mode: auto, to create them)", zap.String("table", s.Table()), zap.Error(err))
	return nil
}
