package admin

import (
	"encoding/hex"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"
)

// PrintDeadLetters writes dead letters as a table for people, the values
// the application wrote escaped (Shown) and the last error on one line.
func PrintDeadLetters(w io.Writer, dls []DeadLetter) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tEVENT_ID\tEVENT_TYPE\tATTEMPTS\tPROCESSED_AT\tLAST_ERROR")
	for _, d := range dls {
		fmt.Fprintf(tw, "%d\t%s\t%q\t%d\t%s\t%s\n", d.ID, Shown(d.EventID), d.EventType, d.Attempts, d.ProcessedAt.UTC().Format(time.RFC3339), oneLine(d.LastError))
	}
	tw.Flush()
}

// PrintExhausted writes the messages JetStream consumers gave up on as a
// table for people.
func PrintExhausted(w io.Writer, ex []Exhausted) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "EVENT_ID\tSTREAM\tCONSUMER\tSTREAM_SEQ\tSUBJECT\tDELIVERIES\tOBSERVED_AT")
	for _, e := range ex {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\n", Shown(e.EventID), Shown(e.Stream), Shown(e.Consumer), e.StreamSeq, Shown(e.Subject), e.Deliveries, e.ObservedAt.UTC().Format(time.RFC3339))
	}
	return tw.Flush()
}

// ShownRow is a row as dead-letters show prints it: its columns, and its
// payload as text when it is printable UTF-8 (see printable), else as
// hex, cut at MaxBytes.
type ShownRow struct {
	Row
	Payload          string `json:"payload"`
	PayloadEncoding  string `json:"payload_encoding"`
	PayloadBytes     int    `json:"payload_bytes"`
	PayloadTruncated bool   `json:"payload_truncated"`
	// MaxBytes is the cut (-1: none), which the text names when it cut.
	MaxBytes int `json:"-"`
}

// ShowRow returns r as dead-letters show prints it, its payload cut at
// maxBytes (-1: all of it).
func ShowRow(r Row, maxBytes int) ShownRow {
	payload, encoding, cut := showPayload(r.Payload, maxBytes)
	return ShownRow{Row: r, Payload: payload, PayloadEncoding: encoding, PayloadBytes: len(r.Payload), PayloadTruncated: cut, MaxBytes: maxBytes}
}

// Print writes the row for people: a column a line, the values the
// application wrote escaped (Shown), then the payload.
func (s ShownRow) Print(w io.Writer) {
	r := s.Row
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, kv := range [][2]string{
		{"id", strconv.FormatInt(r.ID, 10)}, {"status", Shown(r.Status)}, {"event_id", Shown(r.EventID)}, {"event_type", strconv.Quote(r.EventType)},
		{"ordering_key", strconv.Quote(r.OrderingKey)}, {"attempts", strconv.Itoa(r.Attempts)},
		{"created_at", r.CreatedAt.UTC().Format(time.RFC3339Nano)}, {"available_at", r.AvailableAt.UTC().Format(time.RFC3339Nano)},
		{"processed_at", r.ProcessedAt.UTC().Format(time.RFC3339Nano)}, {"last_error", Shown(r.LastError)}, {"headers", Shown(r.Headers)},
		{"atomic_group", Shown(r.AtomicGroup)}, {"stream_seq", r.StreamSeq}, {"claimed_by", Shown(r.ClaimedBy)}, {"claimed_at", r.ClaimedAt},
	} {
		fmt.Fprintf(tw, "%s\t%s\n", kv[0], kv[1])
	}
	tw.Flush()
	more := ""
	if s.PayloadTruncated {
		more = fmt.Sprintf(", the first %d shown (--max-bytes)", s.MaxBytes)
	}
	fmt.Fprintf(w, "payload (%d bytes, %s%s):\n%s\n", s.PayloadBytes, s.PayloadEncoding, more, s.Payload)
}

// showPayload is how a payload is shown: as text when it is printable
// UTF-8 (see printable), else hex; cut at max bytes.
func showPayload(p []byte, maxBytes int) (text, encoding string, truncated bool) {
	if maxBytes >= 0 && len(p) > maxBytes {
		cut := maxBytes
		if utf8.Valid(p) {
			for cut > 0 && !utf8.RuneStart(p[cut]) {
				cut-- // text is cut between characters
			}
		}
		p, truncated = p[:cut], true
	}
	if printable(p) {
		return string(p), "text", truncated
	}
	return hex.EncodeToString(p), "hex", truncated
}

// printable reports whether a payload may be printed as text: UTF-8 whose
// characters are printable (as Shown judges them), tabs, and line breaks
// (a carriage return only before a line feed: alone it would let the text
// after it hide the text before).
func printable(p []byte) bool {
	if !utf8.Valid(p) {
		return false
	}
	text := string(p)
	for i, r := range text {
		switch {
		case r == '\n', r == '\t', strconv.IsPrint(r):
		case r == '\r' && strings.HasPrefix(text[i+1:], "\n"):
		default:
			return false
		}
	}
	return true
}

// Print writes what a bulk operation (op: retry or discard; did: what the
// text says it did, requeued or discarded) did to sel, and how many of
// the ids given it left alone.
func (b Bulk) Print(w io.Writer, op, did string, sel Selection, dryRun bool) {
	if dryRun {
		fmt.Fprintf(w, "would %s %d dead-lettered row(s) (dry run: nothing changed)\n", op, b.Matched)
	} else {
		fmt.Fprintf(w, "%s %d dead-lettered row(s) in %d transaction(s), the longest holding the write lock %.1f ms\n", did, b.Changed, b.Transactions, b.LongestLockMs)
	}
	if !sel.All && int(b.Matched) < len(sel.IDs) {
		why := "were not dead-lettered"
		if sel.Filter != (Filter{}) {
			why = "were not dead-lettered, or not taken by the filters,"
		}
		fmt.Fprintf(w, "%d of the ids given %s and were left alone\n", len(sel.IDs)-int(b.Matched), why)
	}
}
