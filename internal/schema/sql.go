package schema

import (
	"fmt"
	"regexp"
)

// MsSQL reads a time column as Unix milliseconds, or NULL: integers as
// they are, REALs truncated, text of digits as its number, and text that
// begins with a date as SQLite's date functions read it (no zone means UTC,
// as CURRENT_TIMESTAMP writes it). Other text, BLOBs and NULL are NULL.
func MsSQL(col string) string {
	return fmt.Sprintf(`(CASE typeof(%[1]s)
	WHEN 'integer' THEN %[1]s
	WHEN 'real' THEN CAST(%[1]s AS INTEGER)
	WHEN 'text' THEN CASE
		WHEN trim(%[1]s) <> '' AND trim(%[1]s) NOT GLOB '*[^0-9]*' THEN CAST(trim(%[1]s) AS INTEGER)
		WHEN trim(%[1]s) GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*' THEN CAST(round((julianday(trim(%[1]s)) - 2440587.5) * 86400000) AS INTEGER)
	END
END)`, col)
}

// uuidSQL generates a random version 4 UUID per row in SQL, so a backfill
// assigns event ids without a round trip per row.
const uuidSQL = `lower(hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' || substr(hex(randomblob(2)), 2) || '-' || substr('89ab', 1 + (abs(random()) % 4), 1) || substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6)))`

// NowSQL is the current time in Unix milliseconds, valid on SQLite 3.31
// (no unixepoch('subsec')), for column defaults the application evaluates.
const NowSQL = `CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)`

// DueSQL is true for a pending row whose time has come (param is now in
// Unix milliseconds). A NULL available_at (a legacy row, or an explicit
// NULL) means now, and so does a value that is no time: such a row is taken
// so that it is dealt with (published, or dead-lettered with the reason)
// instead of waiting unseen forever. SQLite's own date-time text counts as
// the time it names. An integer available_at, the relay's own, is decided
// by the first comparison.
func DueSQL(param string) string {
	return fmt.Sprintf(`(available_at <= %[1]s OR (typeof(available_at) NOT IN ('integer', 'real') AND coalesce(%[2]s, 0) <= %[1]s))`,
		param, MsSQL("available_at"))
}

// DueRow is the claim's own test of a row it would take now (?1, Unix
// milliseconds).
var DueRow = `status = 'pending' AND ` + DueSQL("?1")

// ParkedKeysSQL is a query for the ordering keys a dead letter parks
// (ordering.on_dead_letter: hold), one row per key: the key (parked_key)
// and its earliest dead-lettered row (parked_id) that the key's rows wait
// behind. A claim takes a keyed row when the row before it of its key is
// done, so a dead letter parks its key when the next row of the key is
// not done, or when it is the key's last row (the next one written will
// wait); one that later rows already passed (under skip) parks nothing.
// An empty or NULL key orders nothing and parks nothing, and neither does
// a BLOB key (the relay dead-letters such a row on its own, holding up no
// key). It reads the dead
// letters' index and, for each, seeks the ordering index once: its cost
// follows the dead letters, not the rows with a key (the unary + keeps
// SQLite off the ordering index for the outer scan, which would look at
// every keyed row's status).
func ParkedKeysSQL(table string) string {
	return fmt.Sprintf(`SELECT d.ordering_key AS parked_key, min(d.id) AS parked_id FROM %[1]s AS d
	WHERE d.status = 'dead_lettered' AND +d.ordering_key <> '' AND typeof(d.ordering_key) <> 'blob'
		AND coalesce((SELECT n.status FROM %[1]s AS n WHERE n.ordering_key = d.ordering_key AND n.id > d.id ORDER BY n.id LIMIT 1), '') <> 'done'
	GROUP BY +d.ordering_key`, table)
}

// identRe is a plain SQL identifier: the outbox table's name is built into
// statements, so nothing else is accepted.
var identRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// PlainIdentifier reports whether name can be an outbox table's name: a
// plain SQL identifier (letters, digits and underscores, not starting with
// a digit).
func PlainIdentifier(name string) bool { return identRe.MatchString(name) }
