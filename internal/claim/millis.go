package claim

import "fmt"

// msSQL reads a time column as Unix milliseconds, or NULL: integers as
// they are, REALs truncated, text of digits as its number, and text that
// begins with a date as SQLite's date functions read it (no zone means UTC,
// as CURRENT_TIMESTAMP writes it). Other text, BLOBs and NULL are NULL.
func msSQL(col string) string {
	return fmt.Sprintf(`(CASE typeof(%[1]s)
	WHEN 'integer' THEN %[1]s
	WHEN 'real' THEN CAST(%[1]s AS INTEGER)
	WHEN 'text' THEN CASE
		WHEN trim(%[1]s) <> '' AND trim(%[1]s) NOT GLOB '*[^0-9]*' THEN CAST(trim(%[1]s) AS INTEGER)
		WHEN trim(%[1]s) GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*' THEN CAST(round((julianday(trim(%[1]s)) - 2440587.5) * 86400000) AS INTEGER)
	END
END)`, col)
}
