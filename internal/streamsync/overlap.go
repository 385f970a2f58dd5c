package streamsync

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/natsname"
)

// ErrSubjectOverlap: the stream cannot be created because another stream
// takes some of its subjects. It is a configuration error: no retry
// heals it until an operator changes one of the two streams.
var ErrSubjectOverlap = errors.New("subjects overlap another stream")

// ErrCreateRefused: the server refuses the stream the relay would create
// (err_code 10052, its configuration invalid there: a duplicate window
// above the server's limit, say). Like ErrSubjectOverlap, a configuration
// error that waiting does not fix.
var ErrCreateRefused = errors.New("the server refuses the stream's configuration")

// errCodeInvalidConfig is the server's err_code for a stream
// configuration it refuses (JSStreamInvalidConfigF).
const errCodeInvalidConfig jetstream.ErrorCode = 10052

// createRefused says why the server refused to create want's stream (its
// err_code 10052), and what to change.
func createRefused(want Want, apiErr *jetstream.APIError) error {
	fix := "change the stream.* setting it names, or the server's JetStream limits"
	if strings.Contains(apiErr.Description, "duplicates window") {
		fix = fmt.Sprintf("set stream.duplicate_window (%v now) to at most the server's limit, or raise the server's limit (jetstream { limits { duplicate_window } })", want.DuplicateWindow)
	}
	return fmt.Errorf("%w: stream %s cannot be created: %s; %s", ErrCreateRefused, want.Stream, apiErr.Description, fix)
}

// errCodeSubjectOverlap is the server's err_code for a stream whose
// subjects overlap an existing stream's (nats.go names no constant).
const errCodeSubjectOverlap jetstream.ErrorCode = 10065

// overlap is a stream that takes some of the subjects the relay's stream
// needs.
type overlap struct {
	stream   string
	subjects []string // all of the stream's subjects
	taken    []string // those that collide with the relay's
}

// overlapping lists the streams other than want.Stream whose subjects
// collide with want.Subjects.
func overlapping(ctx context.Context, js jetstream.JetStream, want Want) ([]overlap, error) {
	var out []overlap
	list := js.ListStreams(ctx)
	for info := range list.Info() {
		if info.Config.Name == want.Stream {
			continue
		}
		o := overlap{stream: info.Config.Name, subjects: info.Config.Subjects}
		for _, theirs := range info.Config.Subjects {
			for _, ours := range want.Subjects {
				if server.SubjectsCollide(theirs, ours) {
					o.taken = append(o.taken, theirs)
					break
				}
			}
		}
		if len(o.taken) > 0 {
			out = append(out, o)
		}
	}
	if err := list.Err(); err != nil {
		return out, fmt.Errorf("list streams: %w", err)
	}
	return out, nil
}

// overlapError explains a refused creation: which streams take which of
// the subjects (found, or listErr when they could not be listed), and what
// to change. cause is the server's refusal, if there was one (a dry run
// finds the overlap before asking).
func overlapError(want Want, found []overlap, listErr, cause error) error {
	why := ""
	if cause != nil {
		why = " (" + cause.Error() + ")"
	}
	head := fmt.Sprintf("stream %s cannot be created with subjects %s%s: a subject belongs to one stream only",
		want.Stream, strings.Join(want.Subjects, ","), why)
	if len(found) == 0 {
		if listErr == nil {
			listErr = errors.New("no stream found that overlaps")
		}
		var ls []string
		for _, subj := range want.Subjects {
			ls = append(ls, "nats stream ls --subject "+shellQuote(subj))
		}
		return fmt.Errorf("%w: %s; find the stream that takes them (%v) with %s, then change its subjects or stream.subjects",
			ErrSubjectOverlap, head, listErr, strings.Join(ls, "; "))
	}
	var parts []string
	for _, o := range found {
		parts = append(parts, fmt.Sprintf("stream %s takes %s", o.stream, strings.Join(o.taken, ",")))
	}
	fixes := []string{"give the relay subjects no other stream takes (stream.subject_prefix and stream.subjects)"}
	for _, o := range found {
		if natsname.Covers(o.subjects, want.SubjectPrefix) {
			fixes = append(fixes, fmt.Sprintf("publish to %s, which captures %s.>: set stream.name: %s", o.stream, want.SubjectPrefix, o.stream))
		}
		if rest := without(o.subjects, o.taken); len(rest) > 0 {
			fixes = append(fixes, fmt.Sprintf("take %s out of %s: nats stream edit %s --subjects %s -f",
				strings.Join(o.taken, ","), o.stream, shellQuote(o.stream), shellQuote(strings.Join(rest, ","))))
		}
	}
	return fmt.Errorf("%w: %s; %s. Change one of them: %s", ErrSubjectOverlap, head, strings.Join(parts, "; "), strings.Join(fixes, "; or "))
}

// without returns the subjects of all that are not in drop.
func without(all, drop []string) []string {
	return slices.DeleteFunc(slices.Clone(all), func(s string) bool { return slices.Contains(drop, s) })
}
