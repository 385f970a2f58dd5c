package streamsync

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// AdvisorySubject is where JetStream announces that a consumer stopped
// delivering a message after max_deliver attempts. Advisories are core
// NATS messages, sent only while someone listens.
func AdvisorySubject(stream, consumer string) string {
	return fmt.Sprintf("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.%s.%s", stream, consumer)
}

// Exhausted is a message a consumer gave up on, as the advisory and the
// stream tell it.
type Exhausted struct {
	Stream, Consumer string
	StreamSeq        uint64
	Deliveries       int64
	EventID          string // the message's Nats-Msg-Id; empty if the message is gone
	Subject          string
	Header           nats.Header // the message's headers; nil if it is gone
	Err              error       // why the message could not be read, if it could not
}

// WatchExhausted listens for max-deliveries advisories of stream/consumer
// until ctx ends, reads each message by its stream sequence, and hands it
// to fn. It returns once subscribed state is torn down.
func WatchExhausted(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, stream, consumer string, fn func(Exhausted)) error {
	// Room for a burst: a full channel makes the client drop advisories.
	ch := make(chan *nats.Msg, 8192)
	sub, err := nc.ChanSubscribe(AdvisorySubject(stream, consumer), ch)
	if err != nil {
		return fmt.Errorf("subscribe to max-deliveries advisories: %w", err)
	}
	defer sub.Unsubscribe()
	for {
		select {
		case <-ctx.Done():
			return nil
		case m := <-ch:
			var adv struct {
				Stream     string `json:"stream"`
				Consumer   string `json:"consumer"`
				StreamSeq  uint64 `json:"stream_seq"`
				Deliveries int64  `json:"deliveries"`
			}
			if err := json.Unmarshal(m.Data, &adv); err != nil || adv.StreamSeq == 0 {
				continue
			}
			e := Exhausted{Stream: adv.Stream, Consumer: adv.Consumer, StreamSeq: adv.StreamSeq, Deliveries: adv.Deliveries}
			gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			s, err := js.Stream(gctx, adv.Stream)
			var raw *jetstream.RawStreamMsg
			if err == nil {
				raw, err = s.GetMsg(gctx, adv.StreamSeq)
			}
			cancel()
			if err != nil {
				e.Err = fmt.Errorf("read message %d of stream %s: %w", adv.StreamSeq, adv.Stream, err)
			} else {
				e.EventID, e.Subject, e.Header = raw.Header.Get(jetstream.MsgIDHeader), raw.Subject, raw.Header
			}
			fn(e)
		}
	}
}
