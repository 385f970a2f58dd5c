package daemon

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/admin"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/publish"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/streamsync"
)

// watchExhausted follows the consumer's max-deliveries advisories until
// ctx ends, handing each to on; a watch that cannot begin is logged.
func watchExhausted(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, cfg config.Config, on func(streamsync.Exhausted), log *zap.Logger) {
	if err := streamsync.WatchExhausted(ctx, nc, js, cfg.Stream.Name, cfg.Consumer.Durable, on); err != nil {
		log.Warn("cannot watch max-deliveries advisories", zap.Error(err))
	}
}

// recordExhausted records a message the consumer gave up on in db:
// JetStream has no dead-letter queue, so the relay makes it as visible as
// its own dead letters (log, metric, and a row that dead-letters list
// --consumer shows). Each relay on the file hears the advisory; the one
// that records it first counts and logs it.
func recordExhausted(db *sqlitedb.DB, m *metrics.Metrics, log *zap.Logger, e streamsync.Exhausted) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	isNew, err := admin.RecordExhausted(ctx, db, admin.Exhausted{
		EventID: e.EventID, Stream: e.Stream, Consumer: e.Consumer, StreamSeq: e.StreamSeq,
		Subject: e.Subject, Deliveries: e.Deliveries, ObservedAt: time.Now(),
	})
	if err != nil {
		log.Warn("record exhausted message", zap.Uint64("stream_seq", e.StreamSeq), zap.Error(err))
	}
	if !isNew && err == nil {
		return // another relay recorded it
	}
	m.ConsumerExhausted.Inc()
	fields := []zap.Field{zap.String("event_id", e.EventID), zap.String("stream", e.Stream), zap.String("consumer", e.Consumer),
		zap.Uint64("stream_seq", e.StreamSeq), zap.String("subject", e.Subject), zap.Int64("deliveries", e.Deliveries)}
	if e.Err != nil {
		fields = append(fields, zap.NamedError("read_error", e.Err))
	}
	log.Error("event exhausted max deliveries", fields...)
}

// onExhausted records a message the consumer gave up on in the file of
// its tenant (its Outbox-Tenant), opened for the moment: the file may be
// closed while idle.
func (f *Fleet) onExhausted(e streamsync.Exhausted) {
	tenant := e.Header.Get(publish.HeaderTenant)
	path, err := "", fmt.Errorf("the message has no %s header", publish.HeaderTenant)
	if tenant != "" {
		path, err = fleet.Find(f.cfg.Database.Path, tenant)
	}
	if err != nil {
		f.metrics.ConsumerExhausted.Inc()
		f.log.Error("event exhausted max deliveries; not recorded in a database file", zap.String("event_id", e.EventID),
			zap.String("consumer", e.Consumer), zap.Uint64("stream_seq", e.StreamSeq), zap.String("subject", e.Subject), zap.Error(err))
		return
	}
	log := f.log.With(zap.String("tenant", tenant))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	db, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: f.cfg.Database.Table, BusyTimeout: f.cfg.Database.BusyTimeout})
	if err != nil {
		log.Warn("record exhausted message", zap.Uint64("stream_seq", e.StreamSeq), zap.Error(err))
		return
	}
	defer db.Close()
	recordExhausted(db, f.metrics, log, e)
}
