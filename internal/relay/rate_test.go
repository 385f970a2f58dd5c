package relay_test

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestRateProfile(t *testing.T) {
	n := testenv.StartNATS(t)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	app.SetMaxOpenConns(1)
	startRelay(t, path, n.URL(), harnessOptions{mutateOpt: func(o *relay.Options) { o.StatsInterval = 5 * time.Second }})
	start := time.Now()
	for i := 0; time.Since(start) < 10*time.Second; {
		due := int(time.Since(start).Seconds() * 1000)
		for ; i < due; i++ {
			app.Exec(`INSERT INTO event_queue (event_id, event_type, payload) VALUES (?, 'R', x'00')`, event.NewID())
		}
		time.Sleep(200 * time.Microsecond)
	}
}
