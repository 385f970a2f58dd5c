package main

import (
	"encoding/json"
	"io"
	"os"
)

// printJSON writes v as indented JSON, the --json output of every command.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// terminal reports whether w is a terminal (for progress lines).
func terminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// output writes v as JSON for --json (asJSON), else for people with text.
func (c *cli) output(asJSON bool, v any, text func(io.Writer)) error {
	if asJSON {
		return printJSON(c.stdout, v)
	}
	text(c.stdout)
	return nil
}
