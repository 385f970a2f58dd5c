//go:build fault

package fault

import (
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// relayPassword is the relay user's password in natsUsers.
const relayPassword = "relay-secret"

// natsUsers is a broker configuration with two users: the relay's, which
// may publish on every subject but denied, and an unrestricted one that
// connections sending no credentials (the suite's own) are taken for.
func natsUsers(denied ...string) string {
	perms := ""
	if len(denied) > 0 {
		perms = fmt.Sprintf(", permissions: {publish: {deny: [%q]}}", strings.Join(denied, `", "`))
	}
	return fmt.Sprintf(`authorization {
  users = [
    {user: admin, password: "admin-secret"}
    {user: relay, password: %q%s}
  ]
}
no_auth_user: admin
`, relayPassword, perms)
}

// TestPermissionGrant: the server denies the relay's user one subject,
// events.Restricted, which a tenth of the rows are on (some of them with
// ordering keys, which then hold their keys' later rows). The relay
// spends attempts on those rows (relay.max_attempts 100, so none runs
// out), publishes the rest, and /readyz names the subject. The operator
// grants the subject by rewriting the server's configuration and
// reloading it while everything runs: the refused rows are published on
// their next try, and no row written after the grant spends an attempt.
func TestPermissionGrant(t *testing.T) {
	e := newEnv(t, withNATSConfig(natsUsers("events.Restricted")))
	db := e.open()
	relayStarted := time.Now()
	e.startRelay("relay", "OUTBOX_RELAY_NATS_USER=relay", "OUTBOX_RELAY_NATS_PASSWORD="+relayPassword,
		"OUTBOX_RELAY_RELAY_MAX_ATTEMPTS=100", "OUTBOX_RELAY_RELAY_ACK_TIMEOUT=5s")
	w := e.writer("-rows", "15000", "-rate", "500", "-keys", "20", "-restricted-percent", "10")
	// Denied long enough that rows were refused, retried and refused again.
	testenv.Eventually(t, 60*time.Second, "a restricted row refused twice", func() bool {
		var n int
		db.QueryRow(`SELECT count(*) FROM event_queue WHERE event_type = 'Restricted' AND attempts >= 2`).Scan(&n)
		return n > 0
	})
	e.waitReadyz("relay", 503, "permission denied on subject events.Restricted")
	denied := time.Since(relayStarted)
	e.reloadNATS(natsUsers())
	granted := time.Now()
	// Every row after this one was written after the grant took effect,
	// so the relay first sent it after the grant too.
	var lastBefore int64
	db.QueryRow(`SELECT coalesce(max(id), 0) FROM event_queue`).Scan(&lastBefore)
	refused := rowIDs(t, db, `SELECT id FROM event_queue WHERE event_type = 'Restricted' AND attempts > 0 AND id <= ?`, lastBefore)
	if len(refused) == 0 {
		t.Fatal("no restricted row spent an attempt before the grant: nothing was tested")
	}
	recovery := waitRowsSettled(t, db, refused, granted, 90*time.Second, "rows refused before the grant")
	s := e.waitWriter(w)
	e.waitSettled(db, 120*time.Second)
	e.waitReadyz("relay", 200, "")
	e.stopRelay("relay")
	// Logged once for the subject, and again only after a minute.
	if n := e.logCount("relay", "nats permission denied: rows on this subject are rejected until the permission is granted"); n < 1 || n > 1+int(denied/time.Minute) {
		t.Errorf("the denial was logged %d times in %v, want once for its subject", n, denied)
	}
	lost, dups, dead := e.verify(db, 0)
	spent := e.checkGrantAttempts(db, lastBefore)
	t.Logf("denied for %v: %d restricted rows of %d spent %d attempts; all published %v after the grant; row %d was the last before it",
		denied.Round(time.Second), len(refused), s.Restricted, spent, recovery.Round(time.Millisecond), lastBefore)
	summaries = append(summaries, summary{name: "publish permission denied on one subject, then granted by a reload", rows: s.Written, outage: denied,
		lost: lost, duplicates: dups, deadLettered: dead, maxRecovery: recovery, elapsed: time.Since(e.started),
		notes: fmt.Sprintf("%d restricted rows, %d keyed; %d refused before the grant spent %d attempts", s.Restricted, s.Keyed, len(refused), spent)})
}

// checkGrantAttempts checks who spent attempts: only rows on the denied
// subject, written before the grant (up to row lastBefore), each for the
// permission. It returns the attempts they spent.
func (e *env) checkGrantAttempts(db *sql.DB, lastBefore int64) (spent int) {
	e.t.Helper()
	db.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM event_queue WHERE event_type = 'Restricted' AND id <= ?`, lastBefore).Scan(&spent)
	if spent == 0 {
		e.t.Error("no restricted row written before the grant spent an attempt")
	}
	for _, c := range []struct {
		what, where string
		args        []any
	}{
		{"rows written after the grant", `id > ?`, []any{lastBefore}},
		{"rows on a subject never denied", `event_type <> 'Restricted'`, nil},
		{"rows refused for another reason than the permission", `coalesce(last_error, '') NOT LIKE '%permission denied%'`, nil},
	} {
		bad := testenv.Strings(e.t, db, `SELECT id || ' ' || event_type || ', attempts ' || attempts || ': ' || coalesce(last_error, '')
			FROM event_queue WHERE attempts > 0 AND `+c.where+` ORDER BY id LIMIT 5`, c.args...)
		if len(bad) > 0 {
			e.t.Errorf("%s spent attempts, e.g. %s", c.what, strings.Join(bad, "; "))
		}
	}
	return spent
}
