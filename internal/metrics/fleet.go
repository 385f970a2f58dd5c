package metrics

import "github.com/prometheus/client_golang/prometheus"

// FleetMetrics are the metrics of a relay serving a fleet of database
// files (a database.path pattern): the files by state, and, when the
// operator opts in (metrics.tenant_label), each tenant's backlog.
type FleetMetrics struct {
	Files *prometheus.GaugeVec // by state: open, idle, trouble
	// Starts is how long files took to start, from the fleet's finding a
	// row of a closed or new file due to the file's relay having started.
	Starts prometheus.Histogram
	// The tenant-labelled gauges; nil without the opt-in.
	tenantBacklog *prometheus.GaugeVec
	tenantAge     *prometheus.GaugeVec
}

// ServeFleet registers the fleet's metrics; perTenant adds the gauges
// with a tenant label (a series per tenant: for fleets whose size the
// metrics store can carry).
func (m *Metrics) ServeFleet(perTenant bool) *FleetMetrics {
	fm := &FleetMetrics{Files: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "fleet_files",
		Help: "Database files the pattern matches, by state: open (served), waiting (for their turn among the files open at once), idle (closed until a commit or a due row), trouble (cannot be served; tried again)."}, []string{"state"})}
	fm.Starts = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: Namespace, Name: "fleet_file_start_seconds",
		Help:    "Seconds from a row of a closed or new file found due to the file's relay having started (its first claim, or standing by, or finding the broker out): the wait for a slot and a turn among the files starting, and the opening.",
		Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}})
	m.Registry.MustRegister(fm.Files, fm.Starts)
	for _, s := range []string{"open", "waiting", "idle", "trouble"} {
		fm.Files.WithLabelValues(s)
	}
	if perTenant {
		fm.tenantBacklog = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "tenant_backlog_rows",
			Help: "A tenant's unfinished outbox rows by status (pending, dead_lettered); only with metrics.tenant_label."}, []string{"tenant", "status"})
		fm.tenantAge = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "tenant_oldest_pending_age_seconds",
			Help: "Seconds a tenant's longest-waiting due pending row has waited; only with metrics.tenant_label."}, []string{"tenant"})
		m.Registry.MustRegister(fm.tenantBacklog, fm.tenantAge)
	}
	m.fleet = fm
	return fm
}

// ForFiles returns the metrics a fleet's files' relays set: m's own but
// broker_connected, which the fleet sets from its connection and every
// open file's outage (a file's relay knows only its own, and with every
// file closed none would set it).
func (m *Metrics) ForFiles() *Metrics {
	c := *m
	c.BrokerConnected = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "broker_connected"}) // not registered
	return &c
}

// TenantGauges are one tenant's gauges.
type TenantGauges struct {
	fm     *FleetMetrics
	tenant string
}

// Tenant returns tenant's gauges, or nil when the metrics carry no tenant
// label.
func (m *Metrics) Tenant(tenant string) *TenantGauges {
	if m.fleet == nil || m.fleet.tenantBacklog == nil || tenant == "" {
		return nil
	}
	return &TenantGauges{fm: m.fleet, tenant: tenant}
}

// Set records the tenant's backlog.
func (g *TenantGauges) Set(pending, deadLettered, oldestPendingAge float64) {
	g.fm.tenantBacklog.WithLabelValues(g.tenant, "pending").Set(pending)
	g.fm.tenantBacklog.WithLabelValues(g.tenant, "dead_lettered").Set(deadLettered)
	g.fm.tenantAge.WithLabelValues(g.tenant).Set(oldestPendingAge)
}

// Delete removes the tenant's series: its file is no longer served.
func (g *TenantGauges) Delete() {
	g.fm.tenantBacklog.DeleteLabelValues(g.tenant, "pending")
	g.fm.tenantBacklog.DeleteLabelValues(g.tenant, "dead_lettered")
	g.fm.tenantAge.DeleteLabelValues(g.tenant)
}
