package streamsync

import (
	"context"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// updateAtomic turns on allow_atomic on the stream, whose configuration
// is cfg, and reads back whether the server kept it.
func updateAtomic(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig, want Want, changes []Change, o Options, log *zap.Logger, res *Result) error {
	s, updateErr := js.UpdateStream(ctx, patchStream(cfg, want, changes))
	if updateErr == nil && !s.CachedInfo().Config.AllowAtomicPublish {
		// Taken and dropped: nothing was patched, so nothing is counted.
		noteAtomic(s.CachedInfo().Config, want, log, res)
		return nil
	}
	done, err := report(updateErr, log, "stream", changes, StreamEditCommand(cfg.Name, changes), refusesAtomic(cfg), o.Patched, res)
	if !done {
		return err
	}
	res.Atomic = updateErr == nil
	return nil
}

// noteAtomic records whether the stream allows atomic publish as the
// server returned its configuration after creating or updating it. A
// server older than 2.12 does not know allow_atomic and takes the request
// without it; that is no refusal to report with a command, but the relay
// then publishes one row at a time, which an operator should know.
func noteAtomic(cfg jetstream.StreamConfig, want Want, log *zap.Logger, res *Result) {
	res.Atomic = cfg.AllowAtomicPublish
	if !atomicIgnored(want, cfg) {
		return
	}
	res.AtomicIgnored = true
	log.Warn("the server ignored allow_atomic (a nats-server older than 2.12 does not know it); the relay publishes one row at a time",
		zap.String("fix", "upgrade nats-server to 2.12 or later, or set stream.allow_atomic to false"))
}

// atomicIgnored reports whether the server, having taken a creation or
// update that set allow_atomic, returned a configuration without it.
func atomicIgnored(want Want, returned jetstream.StreamConfig) bool {
	return want.AllowAtomic && !returned.AllowAtomicPublish
}

// refusesAtomic says why nats-server (2.12 to at least 2.15) refuses
// allow_atomic on a stream of cfg, and what it leaves an operator, or ""
// when nothing in cfg stands in its way. The edit command cannot help
// then, so this is the hint beside it.
func refusesAtomic(cfg jetstream.StreamConfig) string {
	const rest = "the relay publishes one row at a time; set stream.allow_atomic to false to stop asking"
	switch {
	case cfg.PersistMode == jetstream.AsyncPersistMode:
		return "the server allows no atomic publish on a stream with persist_mode async, and a stream's persist mode cannot be changed: " +
			"unless the stream is recreated with the default persist mode, " + rest
	case cfg.Mirror != nil:
		return "the server allows no atomic publish on a mirror: " + rest
	}
	return ""
}
