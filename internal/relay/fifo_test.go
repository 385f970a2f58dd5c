package relay

import "testing"

// TestFIFO: items come out in order, the queue reuses its memory once
// emptied, and a closed queue gives what it holds, then says it is done.
func TestFIFO(t *testing.T) {
	q := newFIFO[int]()
	if _, got, open := q.take(); got || !open {
		t.Fatalf("empty queue: got %v open %v", got, open)
	}
	for i := range 3 {
		q.push(i)
	}
	for want := range 3 {
		if v, ok := q.next(); !ok || v != want {
			t.Fatalf("next: %d %v, want %d", v, ok, want)
		}
	}
	if q.head != 0 || len(q.items) != 0 {
		t.Fatalf("emptied queue holds head %d, %d items", q.head, len(q.items))
	}
	waiting := make(chan int)
	go func() {
		v, _ := q.next()
		waiting <- v
	}()
	q.push(7)
	if v := <-waiting; v != 7 {
		t.Fatalf("a waiting next got %d, want 7", v)
	}
	q.push(8)
	q.close()
	if v, ok := q.next(); !ok || v != 8 {
		t.Fatalf("closed queue: %d %v, want its last item 8", v, ok)
	}
	if _, ok := q.next(); ok {
		t.Fatal("closed, empty queue: next says more may come")
	}
}
