package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/event"
	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/natsname"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// Fleet timings.
const (
	// fleetScan is how often the pattern is matched again: a new file is
	// served, and a removed one let go, within about this long.
	fleetScan = 250 * time.Millisecond
	// fleetRetry is how long a file that could not be served waits
	// before it is tried again.
	fleetRetry = 5 * time.Second
)

// Fleet is a relay serving every database file that database.path's
// pattern matches: a tenant's file each. Every file has its own App (its
// lead, lanes, outage handling, retention, checkpoints and
// reconciliation) on one broker connection and one metrics registry; a
// file that cannot be served affects that file alone, and is tried again.
type Fleet struct {
	cfg      config.Config
	log      *zap.Logger
	oo       Options
	metrics  *metrics.Metrics
	embedded *publish.Embedded
	conn     *publish.Conn
	natsURL  string

	mu    sync.Mutex
	files map[string]*member // by path: the files served, or being opened
	// trouble holds why a file is not served, by path, until it is.
	trouble map[string]*fileTrouble
	wg      sync.WaitGroup // the members' goroutines
}

// member is one file served: its App, once opened, and its goroutine.
type member struct {
	tenant string
	file   os.FileInfo // as first seen: another file at the path is a replacement
	stop   context.CancelFunc
	done   chan struct{}
	app    *App // nil while it opens
}

// fileTrouble is why a file is not served, and when it is tried again.
type fileTrouble struct {
	err   error
	retry time.Time
}

// OpenFleet connects to the broker (or starts the embedded server) for a
// fleet; Run serves its files.
func OpenFleet(ctx context.Context, cfg config.Config, log *zap.Logger, oo Options) (_ *Fleet, err error) {
	if _, err := fleet.Files(cfg.Database.Path); err != nil {
		return nil, &config.Error{Err: err}
	}
	f := &Fleet{cfg: cfg, log: log, oo: oo, metrics: oo.Metrics, natsURL: cfg.NATS.URL,
		files: map[string]*member{}, trouble: map[string]*fileTrouble{}}
	if f.metrics == nil {
		f.metrics = metrics.New(oo.Version, oo.Commit)
	}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if cfg.NATS.URL == config.EmbeddedURL {
		dir := cfg.NATS.Embedded.StoreDir
		if dir == "" {
			dir = filepath.Join(filepath.Dir(cfg.Database.Path), "outbox-relay.nats")
		}
		if f.embedded, err = publish.StartEmbedded(cfg.NATS.Embedded.Listen, dir); err != nil {
			return nil, err
		}
		f.natsURL = f.embedded.URL()
		log.Info("started embedded jetstream server", zap.String("url", f.natsURL), zap.String("store_dir", dir))
	}
	natsOpts := ConnectOptions(cfg.NATS, "outbox-relay")
	natsOpts.URLs = f.natsURL
	if f.conn, err = publish.Connect(ctx, natsOpts, log.Named("nats")); err != nil {
		return nil, err
	}
	return f, nil
}

// Run serves /metrics, /healthz and /readyz, and the files the pattern
// matches, taking up new ones and letting go of removed ones, until ctx
// ends; then every file's relay drains and stops.
func (f *Fleet) Run(ctx context.Context) error {
	stop, err := f.serveHTTP()
	if err != nil {
		return err
	}
	defer stop()
	f.log.Info("relay starting for a fleet of database files", zap.String("database", f.cfg.Database.Path),
		zap.String("table", f.cfg.Database.Table), zap.String("nats", natsname.RedactURLs(f.natsURL)),
		zap.String("stream", f.cfg.Stream.Name), zap.String("subjects", f.cfg.Stream.SubjectPrefix+"."+f.cfg.Stream.SubjectTemplate))
	defer f.stopAll()
	t := time.NewTicker(fleetScan)
	defer t.Stop()
	for {
		f.scan(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// scan serves the files the pattern matches now and lets go of the others.
func (f *Fleet) scan(ctx context.Context) {
	paths, err := fleet.Files(f.cfg.Database.Path)
	if err != nil {
		return // the pattern was checked at Open; the directory may be away for a moment
	}
	now := time.Now()
	matched := make(map[string]bool, len(paths))
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, path := range paths {
		matched[path] = true
		if m := f.files[path]; m != nil {
			if fi, err := os.Stat(path); err == nil && !os.SameFile(fi, m.file) {
				f.log.Info("database file replaced; serving the new one", zap.String("tenant", m.tenant), zap.String("database", path))
				m.stop() // its goroutine removes it; the new file is taken up after
			}
			continue
		}
		if t := f.trouble[path]; t != nil && now.Before(t.retry) {
			continue
		}
		f.start(ctx, path)
	}
	for path, m := range f.files {
		if !matched[path] {
			f.log.Info("database file gone; no longer serving it", zap.String("tenant", m.tenant), zap.String("database", path))
			m.stop()
		}
	}
	for path := range f.trouble {
		if !matched[path] {
			delete(f.trouble, path)
		}
	}
}

// start serves the file at path in a goroutine of its own: opening it may
// wait for the application's lock. Called with f.mu held.
func (f *Fleet) start(ctx context.Context, path string) {
	fi, err := os.Stat(path)
	if err != nil {
		return // gone since the match
	}
	mctx, cancel := context.WithCancel(ctx)
	m := &member{tenant: fleet.Tenant(path), file: fi, stop: cancel, done: make(chan struct{})}
	f.files[path] = m
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		defer close(m.done)
		err := f.serve(mctx, path, m)
		cancel()
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.files, path)
		if errors.Is(err, event.ErrDatabaseReplaced) {
			// Found by the relay before the scan: served anew at once.
			f.log.Info("database file replaced; serving the new one", zap.String("tenant", m.tenant), zap.String("database", path))
			err = nil
		}
		if err == nil || ctx.Err() != nil {
			delete(f.trouble, path)
			return
		}
		prev := f.trouble[path]
		f.trouble[path] = &fileTrouble{err: err, retry: time.Now().Add(fleetRetry)}
		if prev == nil || prev.err.Error() != err.Error() {
			f.log.Error("cannot serve this database file; the others are served, and it is tried again every "+fleetRetry.String(),
				zap.String("tenant", m.tenant), zap.String("database", path), zap.Error(err))
		}
	}()
}

// serve opens the file's App and runs it until ctx ends (nil) or it fails.
func (f *Fleet) serve(ctx context.Context, path string, m *member) error {
	cfg := f.cfg
	cfg.Database.Path = path
	cfg.Metrics.Listen = "" // the fleet serves HTTP
	app, err := Open(ctx, cfg, f.log.With(zap.String("tenant", m.tenant)), Options{
		Version: f.oo.Version, Commit: f.oo.Commit, Metrics: f.metrics, Conn: f.conn, Tenant: m.tenant, Test: f.oo.Test,
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer app.Close()
	f.mu.Lock()
	m.app = app
	f.mu.Unlock()
	err = app.Run(ctx)
	switch {
	case ctx.Err() != nil: // let go of
		return nil
	case err == nil:
		return errors.New("its relay stopped")
	}
	return err
}

// stopAll stops every file's relay and waits for them.
func (f *Fleet) stopAll() {
	f.mu.Lock()
	for _, m := range f.files {
		m.stop()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// Ready is the fleet's /readyz: the broker answers. The files in trouble
// are said by role, not made a reason: the healthy files are served.
func (f *Fleet) Ready(context.Context) error {
	if err := f.conn.Ready(); err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	return nil
}

// Live is the fleet's /healthz.
func (f *Fleet) Live(context.Context) error { return nil }

// role says how many files are served and led, and which are in trouble.
func (f *Fleet) role() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	leading := 0
	var troubled []string
	for path, m := range f.files {
		if m.app == nil {
			continue
		}
		if m.app.relay.Leads() {
			leading++
		}
		if err := m.app.relay.DatabaseError(); err != nil { // a lock held long by its application too
			troubled = append(troubled, fmt.Sprintf("%s (%s): %v", m.tenant, path, err))
		}
	}
	for path, t := range f.trouble {
		troubled = append(troubled, fmt.Sprintf("%s (%s): %v", fleet.Tenant(path), path, t.err))
	}
	sort.Strings(troubled)
	s := fmt.Sprintf("serving %d database files of %s, leading %d", len(f.files), f.cfg.Database.Path, leading)
	if len(troubled) > 0 {
		s += fmt.Sprintf("; %d in trouble: %s", len(troubled), strings.Join(troubled, "; "))
	}
	return s
}

// serveHTTP is App.serveHTTP for the fleet.
func (f *Fleet) serveHTTP() (stop func(), err error) {
	ln := f.oo.Listener
	if ln == nil {
		if f.cfg.Metrics.Listen == "" {
			return func() {}, nil
		}
		if ln, err = net.Listen("tcp", f.cfg.Metrics.Listen); err != nil {
			return nil, fmt.Errorf("metrics.listen %s: %w", f.cfg.Metrics.Listen, err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	wait := metrics.Serve(ctx, ln, f.metrics.Handler(f.Live, f.Ready, f.role))
	f.log.Info("serving metrics", zap.Stringer("listen", ln.Addr()))
	return func() { cancel(); wait() }, nil
}

// Close closes the broker connection and the embedded server.
func (f *Fleet) Close() {
	if f.oo.Listener != nil {
		f.oo.Listener.Close()
	}
	if f.conn != nil {
		f.conn.Close()
	}
	if f.embedded != nil {
		f.embedded.Shutdown()
	}
}
