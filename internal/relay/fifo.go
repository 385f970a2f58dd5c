package relay

import "sync"

// fifo is a queue from one goroutine to another whose sender never waits
// and which holds memory for what it holds only: the relay's pipeline, where
// a batch may be one row, would otherwise need channels of MaxInFlight
// slots in every relay, in a fleet every open file's (about 160 KiB each
// at the default relay.max_in_flight, all of it for the garbage
// collector to scan).
type fifo[T any] struct {
	mu     sync.Mutex
	items  []T
	head   int
	closed bool
	ready  chan struct{} // one slot: an item came, or the queue closed
}

func newFIFO[T any]() *fifo[T] { return &fifo[T]{ready: make(chan struct{}, 1)} }

// push adds v at the end.
func (q *fifo[T]) push(v T) {
	q.mu.Lock()
	q.items = append(q.items, v)
	q.mu.Unlock()
	signal(q.ready)
}

// close says no more items come; those queued are still taken.
func (q *fifo[T]) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	signal(q.ready)
}

// take returns the first item (got), or, with none queued, whether more
// may come (open): then wait on q.ready.
func (q *fifo[T]) take() (v T, got, open bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.head == len(q.items) {
		return v, false, !q.closed
	}
	v = q.items[q.head]
	var zero T
	q.items[q.head] = zero
	q.head++
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
	}
	return v, true, true
}

// next waits for the first item; false once the queue is closed and empty.
func (q *fifo[T]) next() (T, bool) {
	for {
		v, got, open := q.take()
		if got || !open {
			return v, got
		}
		<-q.ready
	}
}
