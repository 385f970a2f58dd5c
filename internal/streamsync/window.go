package streamsync

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Window is the stream's duplicate window against the one the relay
// needs. JetStream drops a repeated Nats-Msg-Id only within the window, so
// a shorter one narrows exactly-once to that long after a row's first
// publish.
type Window struct {
	Stream string
	Have   time.Duration // the stream's window, server defaults applied
	Want   time.Duration // stream.duplicate_window
	MaxAge time.Duration // the stream's max_age; 0: none
	// Limit is the longest window the server allows (its JetStream
	// limits), when its refusal of an update said so; 0: not known.
	Limit time.Duration
}

// NewWindow reads the window of a stream's configuration.
func NewWindow(cfg jetstream.StreamConfig, want time.Duration) Window {
	return Window{Stream: cfg.Name, Have: effectiveDuplicateWindow(cfg), Want: want, MaxAge: cfg.MaxAge}
}

// Short reports whether the stream dedups for less long than the relay
// needs.
func (w Window) Short() bool { return w.Have < w.Want }

// capped reports whether max_age is what keeps the window short: the
// server refuses a window longer than max_age (err_code 10052).
func (w Window) capped() bool { return w.MaxAge > 0 && w.MaxAge < w.Want }

// limited reports whether the server's own limit keeps the window short.
func (w Window) limited() bool { return w.Limit > 0 && w.Limit < w.Want }

// serverLimit is the longest duplicate window the server allows, when its
// refusal err says so ("... larger then server limit of 30m0s"); else 0.
func serverLimit(err error) time.Duration {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return 0
	}
	_, after, ok := strings.Cut(apiErr.Description, "server limit of ")
	if !ok {
		return 0
	}
	d, err := time.ParseDuration(strings.TrimSpace(after))
	if err != nil {
		return 0
	}
	return d
}

// Command is the natscli (v0.5.0) command that gives the stream the
// window the relay needs; with a max_age below it, max_age is raised too,
// since the server refuses the window alone. Under the server's limit, it
// gives the stream the longest window the server allows.
func (w Window) Command() string {
	if w.limited() {
		return StreamEditCommand(w.Stream, []Change{{Field: FieldDuplicateWindow, New: fmtDuration(w.Limit)}})
	}
	if w.capped() {
		return fmt.Sprintf("nats stream edit %s --max-age %s --dupe-window %s -f", shellQuote(w.Stream), fmtDuration(w.Want), fmtDuration(w.Want))
	}
	return StreamEditCommand(w.Stream, []Change{{Field: FieldDuplicateWindow, New: fmtDuration(w.Want)}})
}

// Choice says what an operator can do about a short window: give the
// stream the window (raising max_age when it caps it), or accept a shorter
// one, and what that costs.
func (w Window) Choice() string {
	give, most := fmt.Sprintf("give the stream the window (%s)", w.Command()), w.Have
	switch {
	case w.limited():
		give = fmt.Sprintf("the server allows no window longer than %s (its JetStream limits, duplicate_window): raise that limit in the server's configuration, or give the stream the longest it allows (%s)",
			fmtDuration(w.Limit), w.Command())
		most = w.Limit
	case w.capped():
		give = fmt.Sprintf("the server allows no window longer than the stream's max_age (%s): raise max_age to at least %s (%s)",
			fmtDuration(w.MaxAge), fmtDuration(w.Want), w.Command())
		most = w.MaxAge
	}
	return fmt.Sprintf("%s, or accept a shorter window: set stream.duplicate_window to at most %s; JetStream then drops a re-published event only within that window "+
		"(the relay finds what a stopped relay or a restored backup left unsettled whatever the window, but a leader paused past its lead that publishes later than the window stores its rows twice)",
		give, fmtDuration(most))
}

// Warning is what /readyz and status say about a short window; empty when
// the window is long enough.
func (w Window) Warning() string {
	if !w.Short() {
		return ""
	}
	return fmt.Sprintf("stream %s dedups within %s, not the %s of stream.duplicate_window: %s",
		w.Stream, fmtDuration(w.Have), fmtDuration(w.Want), w.Choice())
}

// MarshalJSON writes the window as operators write durations.
func (w Window) MarshalJSON() ([]byte, error) {
	v := struct {
		Have    string `json:"have"`
		Want    string `json:"want"`
		MaxAge  string `json:"max_age,omitempty"`
		Short   bool   `json:"short"`
		Warning string `json:"warning,omitempty"`
	}{Have: fmtDuration(w.Have), Want: fmtDuration(w.Want), Short: w.Short(), Warning: w.Warning()}
	if w.MaxAge > 0 {
		v.MaxAge = fmtDuration(w.MaxAge)
	}
	return json.Marshal(v)
}
