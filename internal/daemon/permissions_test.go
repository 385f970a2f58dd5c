package daemon_test

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zapcore"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// allowedOnly lets the relay's user ("relay", "pw") publish on
// events.allowed.> and the JetStream API only.
func allowedOnly(o *server.Options) {
	o.Users = []*server.User{{
		Username: "relay", Password: "pw",
		Permissions: &server.Permissions{Publish: &server.SubjectPermission{
			Allow: []string{"events.allowed.>", "$JS.API.>", "_INBOX.>"},
		}},
	}}
}

// TestPermissionDeniedDeadLetters: the server lets the relay's user publish
// on events.allowed.> only. Rows of other types are rejected with the
// permission reason (not taken for an outage) and dead-lettered after their
// attempts; allowed rows flow; the denial is logged once per subject.
func TestPermissionDeniedDeadLetters(t *testing.T) {
	n := testenv.StartNATS(t, allowedOnly)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	for i := 0; i < 5; i++ {
		testenv.InsertN(t, app, 1, "allowed.thing")
		testenv.InsertN(t, app, 2, "denied.thing")
	}
	h := startRelay(t, path, n.URL(), harnessOptions{maxTries: 2, ackTimeout: 500 * time.Millisecond,
		natsCfg: config.NATS{User: "relay", Password: "pw"}})
	counts := waitAllSettled(t, app, 15, 40*time.Second)
	if counts["done"] != 5 || counts["dead_lettered"] != 10 {
		t.Fatalf("counts %v", counts)
	}
	rows, err := app.Query(`SELECT attempts, last_error FROM event_queue WHERE status = 'dead_lettered'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var attempts int
		var reason string
		rows.Scan(&attempts, &reason)
		if attempts != 2 || !strings.Contains(reason, "permission denied on subject events.denied.thing") {
			t.Errorf("dead letter: attempts %d, last_error %q", attempts, reason)
		}
	}
	denials := h.logs.FilterMessageSnippet("nats permission denied").All()
	if len(denials) != 1 || denials[0].Level != zapcore.ErrorLevel || denials[0].ContextMap()["subject"] != "events.denied.thing" {
		t.Fatalf("permission log lines: %v", denials)
	}
	if got := logCount(h, "broker unavailable; pausing without spending attempts"); got != 0 {
		t.Fatalf("a permission problem was taken for an outage %d times", got)
	}
}

// TestPermissionGrantedTakesEffectAtOnce: rows on a subject the server
// denies spend attempts on the server's refusals; once the operator grants
// the subject (a configuration reload), every row on it is sent and
// stored: those written after the grant spend nothing, and a row put back
// by hand (what dead-letters retry does) goes out on its next try.
func TestPermissionGrantedTakesEffectAtOnce(t *testing.T) {
	n := testenv.StartNATS(t, allowedOnly)
	path := testenv.NewDB(t)
	app := testenv.AppDB(t, path)
	testenv.InsertN(t, app, 3, "denied.thing")
	h := startRelay(t, path, n.URL(), harnessOptions{maxTries: 10, ackTimeout: 500 * time.Millisecond,
		natsCfg: config.NATS{User: "relay", Password: "pw"}})
	testenv.Eventually(t, 20*time.Second, "the denied rows refused once", func() bool {
		var refused int
		app.QueryRow(`SELECT count(*) FROM event_queue WHERE attempts = 1 AND last_error LIKE '%permission denied%'`).Scan(&refused)
		return refused == 3
	})
	n.Reload(func(o *server.Options) {
		o.Users[0].Permissions.Publish.Allow = append(o.Users[0].Permissions.Publish.Allow, "events.denied.>")
	})
	testenv.InsertN(t, app, 5, "denied.thing")
	// The refused rows put back for now, as dead-letters retry does.
	testenv.MustExec(t, app, `UPDATE event_queue SET available_at = 0 WHERE attempts = 1`)
	waitAllSettled(t, app, 8, 20*time.Second)
	var attempts []string
	for _, s := range testenv.Strings(t, app, `SELECT status || ':' || attempts FROM event_queue ORDER BY id`) {
		attempts = append(attempts, s)
	}
	if got, want := strings.Join(attempts, ","), "done:1,done:1,done:1,done:0,done:0,done:0,done:0,done:0"; got != want {
		t.Errorf("rows after the grant: %s, want %s", got, want)
	}
	nc, err := nats.Connect(n.URL(), nats.UserInfo("relay", "pw"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if got := len(testenv.StreamMessages(t, js, "EVENTS")); got != 8 {
		t.Errorf("stream holds %d messages, want 8", got)
	}
	if got := logCount(h, "nats permission granted: rows on this subject are published again"); got != 1 {
		t.Errorf("the grant was logged %d times, want once", got)
	}
}
