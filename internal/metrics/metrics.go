// Package metrics defines every metric outbox-relay exports, on a private
// registry, and serves /metrics, /healthz and /readyz.
package metrics

import (
	"context"
	"errors"
	"net"
	"net/http"
	"runtime"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/internal/event"
)

// Namespace prefixes every metric name.
const Namespace = "outbox_relay"

// Deferral reasons, the values of deferred_total's reason label.
const (
	DeferOutage   = "outage"   // broker unreachable: released without spending an attempt
	DeferShutdown = "shutdown" // released at shutdown
	DeferOrdering = "ordering" // behind a row of the same ordering key that was not stored
	// An atomic group's rows, held while the stream takes no atomic batches.
	DeferGroupsHeld = "atomic_groups_held"
	// A subject's rows, held while it is at the stream's max_msgs_per_subject.
	DeferSubjectFull = "subject_full"
)

// Why an atomic batch was published again one row at a time, the values
// of atomic_batch_fallbacks_total's reason label.
const (
	FallbackDisabled   = "disabled"   // the stream does not allow atomic publish (10174)
	FallbackIncomplete = "incomplete" // a message never reached the stream: denied, or too many batches in flight (10176)
	FallbackDuplicate  = "duplicate"  // an event id in the stream already: a crash between the PubAck and the settle (10201)
	FallbackRefused    = "refused"    // the server or the client refused a message (its size, its subject)
	FallbackTooLarge   = "too_large"  // a message over the server's or the stream's size limit, found before sending
)

// Metrics holds every metric of the relay.
type Metrics struct {
	Registry *prometheus.Registry

	Published            prometheus.Counter
	Duplicates           prometheus.Counter
	AtomicBatches        prometheus.Counter
	AtomicBatchLimit     prometheus.Gauge
	AtomicBatchFallbacks *prometheus.CounterVec
	Deferred             *prometheus.CounterVec
	Retries              prometheus.Counter
	DeadLettered         *prometheus.CounterVec
	LeasesReclaimed      prometheus.Counter
	Backlog              *prometheus.GaugeVec
	OldestPendingAge     prometheus.Gauge
	// OldestPending shows the highest of the files' oldest pending ages.
	OldestPending         *Highest
	ParkedKeys            prometheus.Gauge
	BrokerConnected       prometheus.Gauge
	Leader                prometheus.Gauge
	InFlight              prometheus.Gauge
	PublishDuration       prometheus.Histogram
	DeliveryLag           prometheus.Histogram
	StreamConfigPatched   *prometheus.CounterVec
	StreamDuplicateWindow prometheus.Gauge
	ConsumerExhausted     prometheus.Counter
	ReconcileRemaining    prometheus.Gauge
	Reconciled            prometheus.Counter
	ReconcileOrphans      prometheus.Counter
	ReusedEventIDs        prometheus.Counter
	PrunedRows            *prometheus.CounterVec
	BuildInfo             *prometheus.GaugeVec
	fleet                 *FleetMetrics // ServeFleet's; nil for one file
}

// New creates the metrics on a new private registry, with the Go and
// process collectors.
func New(version, commit string) *Metrics {
	r := prometheus.NewRegistry()
	f := func(c prometheus.Collector) { r.MustRegister(c) }
	counter := func(name, help string) prometheus.Counter {
		c := prometheus.NewCounter(prometheus.CounterOpts{Namespace: Namespace, Name: name, Help: help})
		f(c)
		return c
	}
	m := &Metrics{Registry: r}
	m.Published = counter("published_total", "Rows acknowledged by the broker and marked done (duplicates included).")
	m.Duplicates = counter("duplicates_total", "Publishes the stream acknowledged as duplicates of an earlier Nats-Msg-Id.")
	m.AtomicBatches = counter("atomic_batches_total", "Runs of an ordering key's rows, and atomic groups, sent as atomic batches, stored all or none and in order (those published again one row at a time count in atomic_batch_fallbacks_total too).")
	m.AtomicBatchLimit = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "atomic_batch_limit",
		Help: "Rows of one ordering key the relay sends as one atomic batch at most; 0 while the stream takes no atomic batches (rows go one at a time)."})
	m.AtomicBatchFallbacks = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "atomic_batch_fallbacks_total",
		Help: "Atomic batches published again one row at a time, by reason (disabled, incomplete, duplicate, refused, too_large)."}, []string{"reason"})
	m.Retries = counter("retries_total", "Broker rejections that spent an attempt and scheduled a retry.")
	m.DeadLettered = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "dead_lettered_total",
		Help: "Rows marked dead_lettered, by reason (max_attempts, invalid, too_large, reused_event_id)."}, []string{"reason"})
	m.LeasesReclaimed = counter("leases_reclaimed_total", "Claimed rows made claimable again because their lease expired or their relay died.")
	m.ConsumerExhausted = counter("consumer_exhausted_total", "Messages the durable consumer gave up on after max_deliver deliveries.")
	m.Reconciled = counter("reconciled_rows_total", "Pending rows found published already when the relay began to lead (a restore from backup, a crash between the PubAck and the settle) and settled done with their message's sequence, without publishing them again.")
	m.ReconcileOrphans = counter("reconcile_orphans_total", "Messages of this outbox table found in the stream when the relay began to lead whose row is gone from the file (written after a restored backup's point in time); counted and reported, not re-created.")
	m.ReusedEventIDs = counter("reused_event_ids_total", "Rows dead-lettered because the stream holds their event id for another row (an id reused, or written by another application): their own event is not in the stream.")
	m.ReconcileRemaining = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "reconcile_remaining_messages",
		Help: "Stream messages the running reconciliation has still to read before the relay publishes; 0 when none runs."})
	m.Deferred = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "deferred_total",
		Help: "Rows put back to pending without spending an attempt, by reason."}, []string{"reason"})
	m.Backlog = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "backlog_rows",
		Help: "Unfinished outbox rows by status (pending, processing, dead_lettered)."}, []string{"status"})
	m.OldestPendingAge = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "oldest_pending_age_seconds",
		Help: "Seconds the longest-waiting due pending row has waited since it became due; 0 when none is due."})
	m.OldestPending = NewHighest(m.OldestPendingAge)
	m.ParkedKeys = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "parked_keys",
		Help: "Ordering keys parked by a dead-lettered row: their later rows wait until it is retried or deleted (ordering.on_dead_letter: hold); 0 with skip."})
	m.Leader = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "leader",
		Help: "1 while this relay leads (claims and publishes), 0 while it stands by."})
	m.InFlight = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "in_flight_rows",
		Help: "Rows this relay has taken from the outbox and not yet settled (published and awaiting the acknowledgement, or the settle write)."})
	m.BrokerConnected = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "broker_connected",
		Help: "1 while the broker takes publishes, 0 during an outage."})
	m.PublishDuration = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: Namespace, Name: "publish_duration_seconds",
		Help:    "Time from publishing a message to its acknowledgement.",
		Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}})
	m.DeliveryLag = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: Namespace, Name: "delivery_lag_seconds",
		Help:    "Time from a row's created_at to its acknowledgement by the broker.",
		Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600}})
	m.StreamConfigPatched = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "stream_config_patched_total",
		Help: "Stream and consumer fields changed at startup reconciliation, by field (duplicate_window, max_deliver, ack_wait)."}, []string{"field"})
	m.StreamDuplicateWindow = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "stream_duplicate_window_seconds",
		Help: "The stream's duplicate window as the relay last read it: JetStream drops a repeated Nats-Msg-Id only within it. 0 until the stream is read, and in core mode."})
	m.PrunedRows = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "pruned_rows_total",
		Help: "Rows deleted by retention, by table."}, []string{"table"})
	m.BuildInfo = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "build_info",
		Help: "Always 1; labels carry the build."}, []string{"version", "commit", "goversion"})
	for _, c := range []prometheus.Collector{m.Deferred, m.DeadLettered, m.Backlog, m.OldestPendingAge, m.ParkedKeys, m.AtomicBatchLimit, m.AtomicBatchFallbacks, m.BrokerConnected, m.Leader, m.InFlight,
		m.PublishDuration, m.DeliveryLag, m.StreamConfigPatched, m.StreamDuplicateWindow, m.ReconcileRemaining, m.PrunedRows, m.BuildInfo} {
		f(c)
	}
	f(collectors.NewGoCollector())
	f(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.BuildInfo.WithLabelValues(version, commit, runtime.Version()).Set(1)
	// Known label values start at 0, so rate() and alerts see them at once.
	for _, reason := range []string{DeferOutage, DeferShutdown, DeferOrdering, DeferGroupsHeld, DeferSubjectFull} {
		m.Deferred.WithLabelValues(reason)
	}
	for _, reason := range []string{FallbackDisabled, FallbackIncomplete, FallbackDuplicate, FallbackRefused, FallbackTooLarge} {
		m.AtomicBatchFallbacks.WithLabelValues(reason)
	}
	for _, reason := range []string{event.DeadLetterMaxAttempts, event.DeadLetterInvalid, event.DeadLetterTooLarge, event.DeadLetterReusedID} {
		m.DeadLettered.WithLabelValues(reason)
	}
	for _, table := range []string{event.PruneOutbox, event.PruneDoneRecords, event.PruneProcessedEvents} {
		m.PrunedRows.WithLabelValues(table)
	}
	for _, status := range []event.Status{event.StatusPending, event.StatusProcessing, event.StatusDeadLettered} {
		m.Backlog.WithLabelValues(string(status))
	}
	return m
}

// Value reads the current value of a counter or gauge (for progress lines
// and tests).
func Value(c prometheus.Metric) float64 {
	var d dto.Metric
	if err := c.Write(&d); err != nil {
		return 0
	}
	switch {
	case d.Counter != nil:
		return d.Counter.GetValue()
	case d.Gauge != nil:
		return d.Gauge.GetValue()
	}
	return 0
}

// HistogramSumCount reads a histogram's sum and count.
func HistogramSumCount(h prometheus.Histogram) (sum, count float64) {
	var d dto.Metric
	if err := h.Write(&d); err != nil || d.Histogram == nil {
		return 0, 0
	}
	return d.Histogram.GetSampleSum(), float64(d.Histogram.GetSampleCount())
}

// Check is a health probe: nil when healthy, else the reason.
type Check func(ctx context.Context) error

// Handler serves /metrics, /healthz (live) and /readyz (ready); a failing
// check answers 503 with its reason on one line. A passing /readyz answers
// "ok", followed by what role says when it is set (which relay leads, and
// how many rows are in flight).
func (m *Metrics) Handler(live, ready Check, role func() string) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{Registry: m.Registry}))
	probe := func(c Check, say func() string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
			defer cancel()
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			if c != nil {
				if err := c(ctx); err != nil {
					w.WriteHeader(http.StatusServiceUnavailable)
					w.Write([]byte(strings.ReplaceAll(err.Error(), "\n", "; ") + "\n"))
					return
				}
			}
			if say != nil {
				w.Write([]byte("ok: " + say() + "\n"))
				return
			}
			w.Write([]byte("ok\n"))
		}
	}
	mux.HandleFunc("/healthz", probe(live, nil))
	mux.HandleFunc("/readyz", probe(ready, role))
	return mux
}

// Serve serves h on ln until ctx ends, then closes it; wait returns when
// the server has stopped.
func Serve(ctx context.Context, ln net.Listener, h http.Handler) (wait func() error) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan error, 1)
	go func() {
		err := srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		done <- err
	}()
	go func() {
		<-ctx.Done()
		shutCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(shutCtx)
	}()
	return func() error { return <-done }
}
