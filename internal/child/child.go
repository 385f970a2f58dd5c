// Package child runs a child process and follows its log: the lines it
// writes on stderr, as the relay's logger writes them (JSON, or console
// for people) or in any other form. It owns a child's life from start to
// exit: waiting for a log line, signalling it, stopping it with a signal
// and a time limit (then killing it), and saying how it ended with its
// last log lines. The bench supervises its relay children with it; the
// tests drive the built binaries with it.
package child

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"time"
)

// Line is one line a child wrote on stderr.
type Line struct {
	At   time.Time // when it was read
	Text string    // the line as written, without its newline
	// Msg is the line's message: the "msg" field of a JSON line, or the
	// message of a console line (time, level, logger name and message,
	// then the fields as JSON, separated by tabs). It is empty for lines
	// in neither form.
	Msg string
	// Fields are a JSON line's fields (numbers as float64); nil for
	// other lines.
	Fields map[string]any
}

// Process is a child started by Start. Its methods may be called from
// any goroutine.
type Process struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed once it has exited and its stderr is read
	err    error         // cmd.Wait's, set before exited is closed

	mu      sync.Mutex
	lines   []Line
	partial []byte        // the line being written
	more    chan struct{} // closed, and replaced, at each new line
}

// maxLine is the longest line kept; the rest of a longer line is dropped
// (and still read, so that the child never blocks writing it).
const maxLine = 1 << 20

// tailLines is how many of a child's last log lines an error carries.
const tailLines = 5

// Start starts cmd and follows its stderr, which must not be set: it is
// the child's log, read into lines as it comes and kept for the
// Process's life (each line cut to its first MiB).
func Start(cmd *exec.Cmd) (*Process, error) {
	if cmd.Stderr != nil {
		return nil, errors.New("child: cmd.Stderr is set; the child's stderr is its log, which Process reads")
	}
	p := &Process{cmd: cmd, exited: make(chan struct{}), more: make(chan struct{})}
	cmd.Stderr = logWriter{p}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		err := cmd.Wait() // returns once stderr is read to its end
		p.mu.Lock()
		if len(p.partial) > 0 { // a last line without its newline
			p.addLine(time.Now())
		}
		p.mu.Unlock()
		p.err = err
		close(p.exited)
	}()
	return p, nil
}

// Pid is the child's process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Signal sends sig to the child; os.ErrProcessDone once it has exited.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Lines returns the lines the child has written so far.
func (p *Process) Lines() []Line {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.lines)
}

// Find returns the lines so far whose message is msg.
func (p *Process) Find(msg string) []Line {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Line
	for _, l := range p.lines {
		if l.Msg == msg {
			out = append(out, l)
		}
	}
	return out
}

// WaitFor returns the first line whose message is msg, written already or
// within timeout. A child that exits without writing it, or does not
// write it in time, is an error carrying its last log lines; the child is
// left as it is.
func (p *Process) WaitFor(msg string, timeout time.Duration) (Line, error) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	seen := 0
	for {
		line, ok, more := p.next(msg, &seen)
		if ok {
			return line, nil
		}
		select {
		case <-more:
		case <-p.exited:
			if line, ok, _ := p.next(msg, &seen); ok { // written just before it exited
				return line, nil
			}
			return Line{}, p.ExitedEarly(fmt.Sprintf("logging %q", msg))
		case <-timer.C:
			return Line{}, p.failed(fmt.Errorf("did not log %q within %v", msg, timeout))
		}
	}
}

// next looks for msg among the lines from *seen on, and moves *seen past
// them. Without a match it returns a channel closed at the next line.
func (p *Process) next(msg string, seen *int) (Line, bool, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for ; *seen < len(p.lines); *seen++ {
		if p.lines[*seen].Msg == msg {
			return p.lines[*seen], true, nil
		}
	}
	return Line{}, false, p.more
}

// Exited is closed once the child has exited and all it wrote is read.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Wait waits for the child to exit. It returns nil for exit status 0, and
// otherwise how the child ended (an *exec.ExitError inside) with its last
// log lines.
func (p *Process) Wait() error {
	<-p.exited
	if p.err != nil {
		return p.failed(p.err)
	}
	return nil
}

// ExitedEarly waits for the child to exit and returns the error for a
// child that did so before what its caller waited for, named by before:
// "exited before <before>", how it ended, and its last log lines.
func (p *Process) ExitedEarly(before string) error {
	<-p.exited
	how := p.err
	if how == nil {
		how = errors.New(p.cmd.ProcessState.String()) // exit status 0
	}
	return p.failed(fmt.Errorf("exited before %s: %w", before, how))
}

// State is how the child ended (exit code, resource usage); nil while it
// runs.
func (p *Process) State() *os.ProcessState {
	select {
	case <-p.exited:
		return p.cmd.ProcessState
	default:
		return nil
	}
}

// Stop sends sig to the child and waits up to timeout for it to exit; a
// child still running then is killed, and that is the error. Otherwise it
// returns what Wait does: nil for exit status 0. A child that had already
// exited is not signalled.
func (p *Process) Stop(sig os.Signal, timeout time.Duration) error {
	if err := p.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-p.exited:
		return p.Wait()
	case <-timer.C:
		p.Kill()
		return p.failed(fmt.Errorf("did not exit within %v of signal %q; killed", timeout, sig))
	}
}

// Kill kills the child (SIGKILL) unless it has exited, and waits for it.
func (p *Process) Kill() {
	p.cmd.Process.Kill()
	<-p.exited
}

// failed adds the child's last log lines to err.
func (p *Process) failed(err error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.lines) == 0 {
		return err
	}
	var tail []string
	for _, l := range p.lines[max(0, len(p.lines)-tailLines):] {
		tail = append(tail, l.Text)
	}
	return fmt.Errorf("%w; last log lines:\n%s", err, strings.Join(tail, "\n"))
}

// addLine ends the line being written. Called with mu held.
func (p *Process) addLine(at time.Time) {
	p.lines = append(p.lines, parse(string(p.partial), at))
	p.partial = p.partial[:0]
	close(p.more)
	p.more = make(chan struct{})
}

// logWriter is the child's stderr: it cuts what comes into lines.
type logWriter struct{ p *Process }

func (w logWriter) Write(b []byte) (int, error) {
	now := time.Now()
	p := w.p
	p.mu.Lock()
	defer p.mu.Unlock()
	for rest := b; len(rest) > 0; {
		chunk, after, found := bytes.Cut(rest, []byte{'\n'})
		p.partial = append(p.partial, chunk[:min(len(chunk), maxLine-len(p.partial))]...)
		if !found {
			break
		}
		p.addLine(now)
		rest = after
	}
	return len(b), nil
}

// consoleLevels are the levels as the console format writes them.
var consoleLevels = map[string]bool{"DEBUG": true, "INFO": true, "WARN": true, "ERROR": true, "DPANIC": true, "PANIC": true, "FATAL": true}

// parse reads a line's message, and its fields when it is JSON.
func parse(text string, at time.Time) Line {
	l := Line{At: at, Text: text}
	if strings.HasPrefix(text, "{") {
		var fields map[string]any
		if json.Unmarshal([]byte(text), &fields) == nil {
			l.Fields = fields
			l.Msg, _ = fields["msg"].(string)
			return l
		}
	}
	// Console: time, level, [logger name,] message[, fields as JSON].
	parts := strings.Split(text, "\t")
	if len(parts) < 3 || !consoleLevels[parts[1]] {
		return l
	}
	l.Msg = parts[len(parts)-1]
	if len(parts) > 3 && strings.HasPrefix(l.Msg, "{") {
		l.Msg = parts[len(parts)-2]
	}
	return l
}
