package streamsync

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Stored is what a stream holds at one sequence.
type Stored struct {
	Seq uint64
	// MsgID and RowID are the message's Nats-Msg-Id and Outbox-Row-Id.
	MsgID, RowID string
	// Gone: the stream no longer holds a message there (its limits
	// removed it, or it was purged or deleted).
	Gone bool
}

// StreamState is what ReadStored tells of the stream besides its
// messages.
type StreamState struct {
	FirstSeq uint64 // the stream's first sequence
	// LastSeq is the stream's last sequence, read after the messages: a
	// sequence above it was never stored in this stream.
	LastSeq uint64
	// Created is when the stream was created: a row done before it was
	// published to an earlier stream of that name, since deleted, whose
	// sequences the new stream counts again from 1.
	Created time.Time
}

// ReadStored reads the messages at seqs in the stream, up to concurrency
// requests at once (direct gets when the stream allows them), and
// returns them in the order of seqs, with the stream's state.
func ReadStored(ctx context.Context, js jetstream.JetStream, stream string, seqs []uint64, concurrency int) ([]Stored, StreamState, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, StreamState{}, fmt.Errorf("look up stream %s: %w", stream, err)
	}
	// The first error ends the reads: the rest would wait out the same
	// trouble one by one.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := make([]Stored, len(seqs))
	next := make(chan int)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for range max(1, concurrency) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				out[i] = Stored{Seq: seqs[i]}
				m, err := s.GetMsg(ctx, seqs[i])
				switch {
				case errors.Is(err, jetstream.ErrMsgNotFound):
					out[i].Gone = true
				case err != nil:
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("read message %d of stream %s: %w", seqs[i], stream, err)
						cancel()
					}
					mu.Unlock()
				default:
					out[i].MsgID, out[i].RowID = m.Header.Get(jetstream.MsgIDHeader), m.Header.Get("Outbox-Row-Id")
				}
			}
		}()
	}
feed:
	for i := range seqs {
		select {
		case next <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	if firstErr != nil {
		return nil, StreamState{}, firstErr
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, StreamState{}, fmt.Errorf("read stream %s: %w", stream, err)
	}
	return out, StreamState{FirstSeq: info.State.FirstSeq, LastSeq: info.State.LastSeq, Created: info.Created}, nil
}
