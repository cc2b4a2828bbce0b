package metrics_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"
	"gopkg.in/yaml.v3"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
)

// The alerting rules and the dashboard ship beside the code and name its
// metrics by string. These tests fail when a metric is renamed or removed and
// the files are not, and when a runbook link points at a heading that is gone.

const (
	alertsFile    = "../../deploy/prometheus/alerts.yml"
	dashboardFile = "../../deploy/grafana/outbox-relay.json"
	docsDir       = "../../docs/"
)

var metricName = regexp.MustCompile(`\boutbox_relay_[a-zA-Z0-9_:]+`)

// registered returns every outbox_relay_* family metrics.New registers, with
// its type. Vectors appear in a Gather only once a child exists, so each
// vector field gets one child (label values "x"); Describe then confirms the
// gathered set is the whole registry.
func registered(t *testing.T) map[string]string {
	t.Helper()
	m := metrics.New()
	v := reflect.ValueOf(m).Elem()
	for i := range v.NumField() {
		f := v.Field(i)
		with := f.MethodByName("WithLabelValues")
		if !with.IsValid() {
			continue
		}
		c, ok := f.Interface().(prometheus.Collector)
		if !ok {
			t.Fatalf("field %s has WithLabelValues but is no Collector", v.Type().Field(i).Name)
		}
		n := len(descLabels(t, c))
		args := make([]reflect.Value, n)
		for j := range args {
			args[j] = reflect.ValueOf("x")
		}
		with.Call(args)
	}

	described := map[string]bool{}
	ch := make(chan *prometheus.Desc)
	go func() { m.Registry.Describe(ch); close(ch) }()
	for d := range ch {
		described[descName(t, d)] = true
	}

	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	types := map[string]string{}
	for _, f := range fams {
		types[f.GetName()] = f.GetType().String() // COUNTER, GAUGE, HISTOGRAM, ...
	}
	for name := range described {
		if _, ok := types[name]; !ok && strings.HasPrefix(name, "outbox_relay_") {
			t.Fatalf("%s is described by the registry but not gathered after touching every vector", name)
		}
	}
	out := map[string]string{}
	for name, typ := range types {
		if strings.HasPrefix(name, "outbox_relay_") {
			out[name] = typ
		}
	}
	if len(out) == 0 {
		t.Fatal("the registry has no outbox_relay_ metrics")
	}
	return out
}

var (
	descFQName = regexp.MustCompile(`fqName: "([^"]+)"`)
	descVars   = regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
)

// descName and descLabels read a Desc through its String form: the client
// library exposes neither field otherwise.
func descName(t *testing.T, d *prometheus.Desc) string {
	t.Helper()
	mm := descFQName.FindStringSubmatch(d.String())
	if mm == nil {
		t.Fatalf("cannot read the name of %s", d)
	}
	return mm[1]
}

func descLabels(t *testing.T, c prometheus.Collector) []string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 1)
	go func() { c.Describe(ch); close(ch) }()
	var labels []string
	for d := range ch {
		mm := descVars.FindStringSubmatch(d.String())
		if mm == nil {
			t.Fatalf("cannot read the labels of %s", d)
		}
		if mm[1] != "" {
			labels = strings.Split(mm[1], ",")
		}
	}
	return labels
}

// checkNames fails for every outbox_relay_* name in exprs that the registry
// does not have. _bucket, _sum and _count are accepted on a histogram
// (_sum and _count also on a summary).
func checkNames(t *testing.T, file string, exprs []string, reg map[string]string) map[string]bool {
	t.Helper()
	used := map[string]bool{}
	for _, e := range exprs {
		for _, name := range metricName.FindAllString(e, -1) {
			used[name] = true
		}
	}
	for name := range used {
		if _, ok := reg[name]; ok {
			continue
		}
		ok := false
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if base, found := strings.CutSuffix(name, suf); found {
				typ := reg[base]
				ok = typ == "HISTOGRAM" || (typ == "SUMMARY" && suf != "_bucket")
			}
		}
		if !ok {
			t.Errorf("%s uses %s, which metrics.New does not register (registered: %s)", file, name, strings.Join(sortedKeys(reg), ", "))
		}
	}
	if len(used) == 0 {
		t.Errorf("%s uses no outbox_relay_ metric at all", file)
	}
	return used
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func TestAlertRulesUseRegisteredMetrics(t *testing.T) {
	raw, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	var rf ruleFile
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	dec.KnownFields(true)
	if err := dec.Decode(&rf); err != nil {
		t.Fatalf("%s: %v", alertsFile, err)
	}
	if len(rf.Groups) == 0 {
		t.Fatalf("%s has no groups", alertsFile)
	}
	anchors := map[string]map[string]bool{} // docs page -> its anchors
	seen := map[string]bool{}
	var exprs []string
	for _, g := range rf.Groups {
		if g.Name == "" || len(g.Rules) == 0 {
			t.Errorf("group %q: want a name and rules", g.Name)
		}
		for _, r := range g.Rules {
			id := g.Name + "/" + r.Alert
			switch {
			case r.Alert == "":
				t.Errorf("group %s: a rule without alert (recording rules are not expected here)", g.Name)
				continue
			case seen[r.Alert]:
				t.Errorf("%s: alert name used twice", id)
			}
			seen[r.Alert] = true
			if strings.TrimSpace(r.Expr) == "" || strings.Count(r.Expr, "(") != strings.Count(r.Expr, ")") {
				t.Errorf("%s: empty or unbalanced expr %q", id, r.Expr)
			}
			exprs = append(exprs, r.Expr)
			if sev := r.Labels["severity"]; !slices.Contains([]string{"info", "warning", "critical"}, sev) {
				t.Errorf("%s: severity %q, want info, warning or critical", id, sev)
			}
			for _, a := range []string{"summary", "description", "runbook_url"} {
				if strings.TrimSpace(r.Annotations[a]) == "" {
					t.Errorf("%s: annotation %s is missing", id, a)
				}
			}
			url := r.Annotations["runbook_url"]
			doc, anchor, ok := strings.Cut(url, "#")
			page := path.Base(doc)
			if !ok || !strings.HasSuffix(doc, "docs/"+page) || !strings.HasSuffix(page, ".md") {
				t.Errorf("%s: runbook_url %q does not point into a page of docs/ (docs/<page>.md#<heading>)", id, url)
				continue
			}
			if anchors[page] == nil {
				anchors[page] = headingAnchors(t, docsDir+page)
			}
			if !anchors[page][anchor] {
				t.Errorf("%s: runbook_url anchor #%s matches no heading of docs/%s", id, anchor, page)
			}
		}
	}
	used := checkNames(t, alertsFile, exprs, registered(t))
	for _, must := range []string{
		"outbox_relay_slot_lag_bytes", "outbox_relay_slot_lag_seconds", "outbox_relay_oldest_eligible_age_seconds",
		"outbox_relay_rows", "outbox_relay_slot_owner", "outbox_relay_replication_sessions_total",
		"outbox_relay_poller_stale_claims_total", "outbox_relay_failures_total",
		"outbox_relay_slot_invalidations_total", "outbox_relay_backfilled_rows_total",
	} {
		if !used[must] {
			t.Errorf("%s: no alert uses %s", alertsFile, must)
		}
	}
}

// headingAnchors returns the GitHub anchors of a docs page's headings:
// lower case, punctuation other than '-' and '_' dropped, spaces to '-'.
func headingAnchors(t *testing.T, file string) map[string]bool {
	t.Helper()
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	inFence := false
	for _, line := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
			continue
		}
		if inFence || !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(title) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		anchors[b.String()] = true
	}
	return anchors
}

type dashboard struct {
	Title       string          `json:"title"`
	UID         string          `json:"uid"`
	Panels      []panel         `json:"panels"`
	Templating  json.RawMessage `json:"templating"`
	Annotations struct {
		List []struct {
			Name       string          `json:"name"`
			Expr       string          `json:"expr"`
			Datasource json.RawMessage `json:"datasource"`
		} `json:"list"`
	} `json:"annotations"`
}

type panel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	Panels     []panel         `json:"panels"`
	Targets    []struct {
		Expr       string          `json:"expr"`
		RefID      string          `json:"refId"`
		Datasource json.RawMessage `json:"datasource"`
	} `json:"targets"`
}

func TestDashboardUsesRegisteredMetrics(t *testing.T) {
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if d.Title == "" || d.UID == "" {
		t.Errorf("%s: want a title and a uid", dashboardFile)
	}
	var templ struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	}
	if err := json.Unmarshal(d.Templating, &templ); err != nil {
		t.Fatalf("%s: templating: %v", dashboardFile, err)
	}
	hasDS := false
	var exprs []string
	for _, v := range templ.List {
		if v.Name == "DS_PROMETHEUS" && v.Type == "datasource" {
			hasDS = true
		}
		exprs = append(exprs, string(v.Query))
	}
	if !hasDS {
		t.Errorf("%s: want a datasource variable DS_PROMETHEUS", dashboardFile)
	}
	usesDS := func(where string, ds json.RawMessage) {
		if !strings.Contains(string(ds), "${DS_PROMETHEUS}") {
			t.Errorf("%s: %s: datasource %s, want ${DS_PROMETHEUS}", dashboardFile, where, ds)
		}
	}
	for _, a := range d.Annotations.List {
		if a.Expr != "" {
			usesDS("annotation "+a.Name, a.Datasource)
			exprs = append(exprs, a.Expr)
		}
	}
	ids := map[int]bool{}
	var walk func(ps []panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
			if ids[p.ID] {
				t.Errorf("%s: %s: id used twice", dashboardFile, where)
			}
			ids[p.ID] = true
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			usesDS(where, p.Datasource)
			if len(p.Targets) == 0 {
				t.Errorf("%s: %s has no queries", dashboardFile, where)
			}
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" || strings.Count(tg.Expr, "(") != strings.Count(tg.Expr, ")") {
					t.Errorf("%s: %s: empty or unbalanced expr %q", dashboardFile, where, tg.Expr)
				}
				usesDS(where+" target "+tg.RefID, tg.Datasource)
				exprs = append(exprs, tg.Expr)
			}
		}
	}
	walk(d.Panels)
	reg := registered(t)
	used := checkNames(t, dashboardFile, exprs, reg)
	// The dashboard is the one place that shows every metric: a new metric
	// without a panel fails here.
	for name, typ := range reg {
		if typ == "HISTOGRAM" {
			if !used[name+"_bucket"] {
				t.Errorf("%s: no panel shows the histogram %s (%s_bucket)", dashboardFile, name, name)
			}
			continue
		}
		if !used[name] {
			t.Errorf("%s: no panel shows %s", dashboardFile, name)
		}
	}
}
