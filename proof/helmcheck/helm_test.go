package helmcheck

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"gopkg.in/yaml.v3"
)

// root is the product's module root, relative to this package's directory.
const root = "../.."

var chartDir = filepath.Join(root, "deploy", "helm", "outbox-relay")

const (
	release     = "orders"
	fullname    = "orders-outbox-relay" // release-chart, as the chart's helper names it
	databaseURL = "postgres://outbox_relay:relay-secret@db:5432/shop?sslmode=require"
	ownerURL    = "postgres://shop_owner:owner-secret@db:5432/shop?sslmode=require"
)

// helmBin builds the pinned Helm once per test binary: the first build takes
// a minute or two, later ones come from the build cache.
var helmBin = sync.OnceValues(func() (string, error) {
	cmd := exec.Command("go", "tool", "-n", "helm")
	cmd.Dir = filepath.Join(root, "proof")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("go tool -n helm: %w: %s", err, strings.TrimSpace(string(ee.Stderr)))
		}
		return "", fmt.Errorf("go tool -n helm: %w", err)
	}
	p := strings.TrimSpace(string(out))
	if p == "" {
		return "", errors.New("go tool -n helm printed no path")
	}
	return p, nil
})

// helm runs the pinned Helm. Without a Go toolchain or the module proxy the
// tests skip, except in CI, where the chart must be checked.
func helm(t *testing.T, args ...string) (stdout string, err error) {
	t.Helper()
	bin, err := helmBin()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("cannot build helm (CI is set, so this fails rather than skips): %v", err)
		}
		t.Skipf("cannot build helm: %v", err)
	}
	var out, errb bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	// Helm's own settings directories, away from the user's.
	home := t.TempDir()
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+home, "HELM_CONFIG_HOME="+home, "HELM_DATA_HOME="+home)
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("helm %s: %w: %s", strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}

// valuesFile writes values as a file for -f: URLs with '=' and ',' survive
// it, which --set would split.
func valuesFile(t *testing.T, values map[string]any) string {
	t.Helper()
	b, err := yaml.Marshal(values)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// base is the least a user must give: the relay's database URL and, for
// the migrate hook, the table owner's.
func base() map[string]any {
	return map[string]any{"secret": map[string]any{"databaseURL": databaseURL, "migrateDatabaseURL": ownerURL}}
}

// merge sets dotted keys ("console.enabled") in v.
func merge(v map[string]any, kv ...any) map[string]any {
	for i := 0; i < len(kv); i += 2 {
		parts := strings.Split(kv[i].(string), ".")
		m := v
		for _, p := range parts[:len(parts)-1] {
			next, ok := m[p].(map[string]any)
			if !ok {
				next = map[string]any{}
				m[p] = next
			}
			m = next
		}
		m[parts[len(parts)-1]] = kv[i+1]
	}
	return v
}

type meta struct {
	Name        string            `yaml:"name"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

type object struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   meta   `yaml:"metadata"`
	node       yaml.Node
}

func (o object) decode(t *testing.T, v any) {
	t.Helper()
	if err := o.node.Decode(v); err != nil {
		t.Fatalf("decode %s %s: %v", o.Kind, o.Metadata.Name, err)
	}
}

type rendered []object

func (r rendered) kinds() map[string]int {
	m := map[string]int{}
	for _, o := range r {
		m[o.Kind]++
	}
	return m
}

func (r rendered) one(t *testing.T, kind string) object {
	t.Helper()
	var found []object
	for _, o := range r {
		if o.Kind == kind {
			found = append(found, o)
		}
	}
	if len(found) != 1 {
		t.Fatalf("rendered %d objects of kind %s, want 1 (all: %v)", len(found), kind, r.kinds())
	}
	return found[0]
}

// render runs helm template with values and parses every document.
func render(t *testing.T, values map[string]any) rendered {
	t.Helper()
	out, err := renderErr(t, values)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func renderErr(t *testing.T, values map[string]any) (rendered, error) {
	t.Helper()
	out, err := helm(t, "template", release, chartDir, "--namespace", "shop", "-f", valuesFile(t, values))
	if err != nil {
		return nil, err
	}
	var objs rendered
	dec := yaml.NewDecoder(strings.NewReader(out))
	for {
		var n yaml.Node
		if err := dec.Decode(&n); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("parse helm template output: %v\n%s", err, out)
		}
		if n.Kind == 0 || (n.Kind == yaml.DocumentNode && len(n.Content) == 0) {
			continue
		}
		var o object
		if err := n.Decode(&o); err != nil {
			t.Fatalf("parse a rendered object: %v", err)
		}
		if o.Kind == "" {
			continue
		}
		o.node = n
		objs = append(objs, o)
	}
	return objs, nil
}

type secretKeyRef struct {
	Name     string `yaml:"name"`
	Key      string `yaml:"key"`
	Optional bool   `yaml:"optional"`
}

type envVar struct {
	Name      string `yaml:"name"`
	Value     string `yaml:"value"`
	ValueFrom *struct {
		SecretKeyRef *secretKeyRef `yaml:"secretKeyRef"`
	} `yaml:"valueFrom"`
}

type probe struct {
	HTTPGet *struct {
		Path string `yaml:"path"`
		Port any    `yaml:"port"`
	} `yaml:"httpGet"`
	TimeoutSeconds int `yaml:"timeoutSeconds"`
}

type container struct {
	Name           string   `yaml:"name"`
	Image          string   `yaml:"image"`
	Args           []string `yaml:"args"`
	Env            []envVar `yaml:"env"`
	LivenessProbe  *probe   `yaml:"livenessProbe"`
	ReadinessProbe *probe   `yaml:"readinessProbe"`
	StartupProbe   *probe   `yaml:"startupProbe"`
	Ports          []struct {
		Name          string `yaml:"name"`
		ContainerPort int    `yaml:"containerPort"`
	} `yaml:"ports"`
	Resources struct {
		Requests map[string]string `yaml:"requests"`
		Limits   map[string]string `yaml:"limits"`
	} `yaml:"resources"`
	SecurityContext struct {
		AllowPrivilegeEscalation *bool `yaml:"allowPrivilegeEscalation"`
		ReadOnlyRootFilesystem   *bool `yaml:"readOnlyRootFilesystem"`
		Capabilities             struct {
			Drop []string `yaml:"drop"`
		} `yaml:"capabilities"`
	} `yaml:"securityContext"`
}

func (c container) env(name string) (envVar, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e, true
		}
	}
	return envVar{}, false
}

type podSpec struct {
	Containers      []container `yaml:"containers"`
	SecurityContext struct {
		RunAsNonRoot *bool `yaml:"runAsNonRoot"`
		RunAsUser    int   `yaml:"runAsUser"`
	} `yaml:"securityContext"`
	AutomountServiceAccountToken *bool `yaml:"automountServiceAccountToken"`
}

type podTemplate struct {
	Metadata meta    `yaml:"metadata"`
	Spec     podSpec `yaml:"spec"`
}

type deployment struct {
	Spec struct {
		Replicas int `yaml:"replicas"`
		Selector struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"selector"`
		Template podTemplate `yaml:"template"`
	} `yaml:"spec"`
}

type job struct {
	Spec struct {
		Template podTemplate `yaml:"template"`
	} `yaml:"spec"`
}

type pdb struct {
	Spec struct {
		MinAvailable               any    `yaml:"minAvailable"`
		MaxUnavailable             any    `yaml:"maxUnavailable"`
		UnhealthyPodEvictionPolicy string `yaml:"unhealthyPodEvictionPolicy"`
		Selector                   struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"selector"`
	} `yaml:"spec"`
}

type secret struct {
	Data map[string]string `yaml:"data"`
}

func relayContainer(t *testing.T, r rendered) (deployment, container) {
	t.Helper()
	var d deployment
	r.one(t, "Deployment").decode(t, &d)
	if n := len(d.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("Deployment has %d containers, want 1", n)
	}
	return d, d.Spec.Template.Spec.Containers[0]
}

func secretData(t *testing.T, r rendered) map[string]string {
	t.Helper()
	var s secret
	r.one(t, "Secret").decode(t, &s)
	out := map[string]string{}
	for k, v := range s.Data {
		b, err := base64.StdEncoding.DecodeString(v)
		if err != nil {
			t.Fatalf("Secret key %s: %v", k, err)
		}
		out[k] = string(b)
	}
	return out
}

// wantSecretEnv checks that name is read from key of the Secret named sec.
func wantSecretEnv(t *testing.T, what string, c container, name, sec, key string) {
	t.Helper()
	e, ok := c.env(name)
	if !ok {
		t.Errorf("%s: no %s", what, name)
		return
	}
	if e.Value != "" || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
		t.Errorf("%s: %s is not read from a Secret: %+v", what, name, e)
		return
	}
	if r := e.ValueFrom.SecretKeyRef; r.Name != sec || r.Key != key || r.Optional {
		t.Errorf("%s: %s from secret %s key %s (optional %v), want secret %s key %s, required", what, name, r.Name, r.Key, r.Optional, sec, key)
	}
}

func TestChartLints(t *testing.T) {
	for name, values := range map[string]map[string]any{
		"defaults": base(),
		"everything on": merge(base(), "console.enabled", true, "secret.consoleToken", strings.Repeat("k", 32),
			"serviceMonitor.enabled", true, "prometheusRule.enabled", true, "secret.natsCredsFile", true,
			"secret.natsCreds", "-----BEGIN NATS USER JWT-----", "secret.migrateDatabaseURL", ownerURL),
	} {
		out, err := helm(t, "lint", "--strict", chartDir, "-f", valuesFile(t, values))
		if err != nil {
			t.Errorf("%s: %v\n%s", name, err, out)
		} else if !strings.Contains(out, "0 chart(s) failed") {
			t.Errorf("%s: helm lint said:\n%s", name, out)
		}
	}
}

func TestDefaultRelease(t *testing.T) {
	r := render(t, base())
	kinds := r.kinds()
	for _, k := range []string{"ServiceMonitor", "PrometheusRule"} {
		if kinds[k] != 0 {
			t.Errorf("rendered a %s by default; it needs the Prometheus operator's CRDs and must be asked for", k)
		}
	}
	d, c := relayContainer(t, r)

	// One streams the slot, one waits to take over.
	if d.Spec.Replicas != 2 {
		t.Errorf("replicas %d, want 2", d.Spec.Replicas)
	}
	if !reflect.DeepEqual(d.Spec.Selector.MatchLabels, subset(d.Spec.Template.Metadata.Labels, d.Spec.Selector.MatchLabels)) {
		t.Errorf("Deployment selector %v does not match its pods' labels %v", d.Spec.Selector.MatchLabels, d.Spec.Template.Metadata.Labels)
	}
	if !slices.Equal(c.Args, []string{"run"}) {
		t.Errorf("relay args %v, want [run]", c.Args)
	}

	// /readyz answers 503 while a server is unreachable, which a restart
	// does not fix, and 200 "standby" for the waiting instance: only the
	// readiness probe may use it.
	if got := probePath(c.LivenessProbe); got != "/healthz" {
		t.Errorf("liveness probe GET %q, want /healthz", got)
	}
	if got := probePath(c.ReadinessProbe); got != "/readyz" {
		t.Errorf("readiness probe GET %q, want /readyz", got)
	} else if c.ReadinessProbe.TimeoutSeconds <= 2 {
		t.Errorf("readiness probe timeout %ds: /readyz waits up to 2s for PostgreSQL", c.ReadinessProbe.TimeoutSeconds)
	}
	if probePath(c.StartupProbe) == "/readyz" {
		t.Error("a startup probe on /readyz restarts an instance that cannot reach a server yet")
	}
	for _, p := range []*probe{c.LivenessProbe, c.ReadinessProbe} {
		if p != nil && p.HTTPGet != nil && p.HTTPGet.Port != "http" {
			t.Errorf("probe port %v, want the named port http", p.HTTPGet.Port)
		}
	}
	if len(c.Ports) != 1 || c.Ports[0].Name != "http" || c.Ports[0].ContainerPort != 8080 {
		t.Errorf("ports %+v, want http 8080", c.Ports)
	}
	if e, _ := c.env("OUTBOX_RELAY_HTTP_ADDR"); e.Value != ":8080" {
		t.Errorf("OUTBOX_RELAY_HTTP_ADDR %q, want :8080 (the probes' port)", e.Value)
	}

	var p pdb
	r.one(t, "PodDisruptionBudget").decode(t, &p)
	if p.Spec.MaxUnavailable != 1 || p.Spec.MinAvailable != nil {
		t.Errorf("PDB maxUnavailable %v minAvailable %v, want maxUnavailable 1 only", p.Spec.MaxUnavailable, p.Spec.MinAvailable)
	}
	if p.Spec.UnhealthyPodEvictionPolicy != "AlwaysAllow" {
		t.Errorf("PDB unhealthyPodEvictionPolicy %q, want AlwaysAllow (both instances are not ready while a server is down)", p.Spec.UnhealthyPodEvictionPolicy)
	}
	if !reflect.DeepEqual(p.Spec.Selector.MatchLabels, d.Spec.Selector.MatchLabels) {
		t.Errorf("PDB selects %v, the Deployment %v", p.Spec.Selector.MatchLabels, d.Spec.Selector.MatchLabels)
	}

	// Credentials only through the Secret.
	data := secretData(t, r)
	if data["database-url"] != databaseURL {
		t.Errorf("Secret database-url %q, want %q", data["database-url"], databaseURL)
	}
	sec := r.one(t, "Secret").Metadata.Name
	wantSecretEnv(t, "relay", c, "OUTBOX_RELAY_DATABASE_URL", sec, "database-url")
	for _, name := range []string{"OUTBOX_RELAY_NATS_USER", "OUTBOX_RELAY_NATS_PASSWORD", "OUTBOX_RELAY_NATS_TOKEN"} {
		e, ok := c.env(name)
		if !ok || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil || e.ValueFrom.SecretKeyRef.Name != sec || !e.ValueFrom.SecretKeyRef.Optional {
			t.Errorf("%s: %+v, want an optional key of Secret %s", name, e, sec)
		}
	}
	for _, o := range r {
		if o.Kind == "Secret" {
			continue
		}
		b, _ := yaml.Marshal(&o.node)
		if bytes.Contains(b, []byte("relay-secret")) {
			t.Errorf("the database password appears in %s %s", o.Kind, o.Metadata.Name)
		}
	}

	// No console unless asked.
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "OUTBOX_RELAY_CONSOLE") {
			t.Errorf("console setting %s by default; the console must be off", e.Name)
		}
	}
	if _, ok := data["console-token"]; ok {
		t.Error("Secret has a console-token by default")
	}

	// Sized from docs/benchmarks-second-round.md.
	if c.Resources.Requests["cpu"] != "100m" || c.Resources.Requests["memory"] != "96Mi" || c.Resources.Limits["memory"] != "256Mi" {
		t.Errorf("resources %+v, want requests 100m/96Mi and a 256Mi memory limit", c.Resources)
	}

	sc := d.Spec.Template.Spec.SecurityContext
	if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser != 65532 {
		t.Errorf("pod securityContext %+v, want runAsNonRoot as 65532 (the image's nonroot)", sc)
	}
	csc := c.SecurityContext
	if csc.ReadOnlyRootFilesystem == nil || !*csc.ReadOnlyRootFilesystem || csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation || !slices.Equal(csc.Capabilities.Drop, []string{"ALL"}) {
		t.Errorf("container securityContext %+v, want a read-only root, no privilege escalation, all capabilities dropped", csc)
	}
	if c.Image != "outbox-relay:0.1.0" {
		t.Errorf("image %q, want outbox-relay:<appVersion> (the name make docker and docker-compose.yml use)", c.Image)
	}

	// migrate before install and upgrade, after its Secret exists.
	mj := r.one(t, "Job")
	if got := mj.Metadata.Annotations["helm.sh/hook"]; got != "pre-install,pre-upgrade" {
		t.Errorf("migrate Job hook %q, want pre-install,pre-upgrade", got)
	}
	sw, _ := strconv.Atoi(r.one(t, "Secret").Metadata.Annotations["helm.sh/hook-weight"])
	jw, _ := strconv.Atoi(mj.Metadata.Annotations["helm.sh/hook-weight"])
	if r.one(t, "Secret").Metadata.Annotations["helm.sh/hook"] == "" || sw >= jw {
		t.Errorf("Secret hook %q weight %d, Job weight %d: the Secret must be a hook created before the migrate Job",
			r.one(t, "Secret").Metadata.Annotations["helm.sh/hook"], sw, jw)
	}
	var j job
	mj.decode(t, &j)
	mc := j.Spec.Template.Spec.Containers[0]
	if !slices.Equal(mc.Args, []string{"migrate"}) {
		t.Errorf("migrate Job args %v, want [migrate]", mc.Args)
	}
	wantSecretEnv(t, "migrate", mc, "OUTBOX_RELAY_DATABASE_URL", sec, "migrate-database-url")
	if mc.SecurityContext.ReadOnlyRootFilesystem == nil || !*mc.SecurityContext.ReadOnlyRootFilesystem {
		t.Error("migrate Job: root filesystem not read-only")
	}
	// The table's settings must be the relay's.
	for _, name := range []string{"OUTBOX_RELAY_TABLE", "OUTBOX_RELAY_PUBLICATION", "OUTBOX_RELAY_ON_PUBLISH"} {
		a, _ := c.env(name)
		b, _ := mc.env(name)
		if a.Value == "" || a.Value != b.Value {
			t.Errorf("%s: relay %q, migrate %q", name, a.Value, b.Value)
		}
	}
}

func probePath(p *probe) string {
	if p == nil || p.HTTPGet == nil {
		return ""
	}
	return p.HTTPGet.Path
}

func subset(m, keys map[string]string) map[string]string {
	out := map[string]string{}
	for k := range keys {
		if v, ok := m[k]; ok {
			out[k] = v
		}
	}
	return out
}

func TestMigrateOwnerAndNoMigrate(t *testing.T) {
	r := render(t, merge(base(), "secret.migrateDatabaseURL", ownerURL))
	var j job
	r.one(t, "Job").decode(t, &j)
	sec := r.one(t, "Secret").Metadata.Name
	wantSecretEnv(t, "migrate", j.Spec.Template.Spec.Containers[0], "OUTBOX_RELAY_DATABASE_URL", sec, "migrate-database-url")
	if got := secretData(t, r)["migrate-database-url"]; got != ownerURL {
		t.Errorf("Secret migrate-database-url %q, want %q", got, ownerURL)
	}
	_, c := relayContainer(t, r)
	wantSecretEnv(t, "relay", c, "OUTBOX_RELAY_DATABASE_URL", sec, "database-url")

	r = render(t, merge(base(), "migrate.enabled", false))
	if n := r.kinds()["Job"]; n != 0 {
		t.Errorf("migrate.enabled=false rendered %d Jobs", n)
	}
	if a := r.one(t, "Secret").Metadata.Annotations["helm.sh/hook"]; a != "" {
		t.Errorf("without the migrate hook the Secret is still a hook (%q): helm uninstall would leave it", a)
	}
}

func TestExistingSecret(t *testing.T) {
	r := render(t, map[string]any{
		"secret":  map[string]any{"existingSecret": "shop-outbox"},
		"console": map[string]any{"enabled": true},
	})
	if n := r.kinds()["Secret"]; n != 0 {
		t.Errorf("existingSecret set, yet %d Secrets rendered", n)
	}
	_, c := relayContainer(t, r)
	wantSecretEnv(t, "relay", c, "OUTBOX_RELAY_DATABASE_URL", "shop-outbox", "database-url")
	wantSecretEnv(t, "relay", c, "OUTBOX_RELAY_CONSOLE_TOKEN", "shop-outbox", "console-token")
	var j job
	r.one(t, "Job").decode(t, &j)
	wantSecretEnv(t, "migrate", j.Spec.Template.Spec.Containers[0], "OUTBOX_RELAY_DATABASE_URL", "shop-outbox", "migrate-database-url")
}

func TestConsole(t *testing.T) {
	token := "0123456789abcdef-console"
	r := render(t, merge(base(), "console.enabled", true, "secret.consoleToken", token))
	_, c := relayContainer(t, r)
	if e, _ := c.env("OUTBOX_RELAY_CONSOLE"); e.Value != "true" {
		t.Errorf("console.enabled: OUTBOX_RELAY_CONSOLE %q, want true", e.Value)
	}
	sec := r.one(t, "Secret").Metadata.Name
	wantSecretEnv(t, "relay", c, "OUTBOX_RELAY_CONSOLE_TOKEN", sec, "console-token")
	if got := secretData(t, r)["console-token"]; got != token {
		t.Errorf("Secret console-token %q, want %q", got, token)
	}

	// Refused at render time rather than in a crash loop.
	for name, tc := range map[string]struct {
		values map[string]any
		want   string
	}{
		"short token": {merge(base(), "console.enabled", true, "secret.consoleToken", "short"), "at least 16 bytes"},
		"no token":    {merge(base(), "console.enabled", true), "at least 16 bytes"},
		"no database": {map[string]any{}, "secret.databaseURL"},
		"both PDB bounds": {merge(base(), "podDisruptionBudget.minAvailable", 1, "podDisruptionBudget.maxUnavailable", 1),
			"not both"},
		"bad ordering":               {merge(base(), "relay.ordering", "strict"), "none or aggregate"},
		"bad message format":         {merge(base(), "relay.messageFormat", "avro"), "outbox, cloudevents or cloudevents-structured"},
		"message format in extraEnv": {merge(base(), "relay.extraEnv", map[string]any{"MESSAGE_FORMAT": "cloudevents"}), "set relay.messageFormat instead"},
	} {
		if _, err := renderErr(t, tc.values); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want one saying %q", name, err, tc.want)
		}
	}
}

func TestPDBMinAvailable(t *testing.T) {
	r := render(t, merge(base(), "podDisruptionBudget.minAvailable", 1, "podDisruptionBudget.maxUnavailable", nil))
	var p pdb
	r.one(t, "PodDisruptionBudget").decode(t, &p)
	if p.Spec.MinAvailable != 1 || p.Spec.MaxUnavailable != nil {
		t.Errorf("PDB minAvailable %v maxUnavailable %v, want minAvailable 1 only", p.Spec.MinAvailable, p.Spec.MaxUnavailable)
	}
}

type ruleGroups struct {
	Groups []map[string]any `yaml:"groups"`
}

func TestMonitoring(t *testing.T) {
	src, err := os.ReadFile(filepath.Join(root, "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	// A chart reads only its own files.
	if cp, err := os.ReadFile(filepath.Join(chartDir, "files", "alerts.yml")); err != nil || !bytes.Equal(cp, src) {
		t.Fatalf("deploy/helm/outbox-relay/files/alerts.yml is not a copy of deploy/prometheus/alerts.yml (err %v): cp deploy/prometheus/alerts.yml deploy/helm/outbox-relay/files/", err)
	}
	var want ruleGroups
	if err := yaml.Unmarshal(src, &want); err != nil {
		t.Fatal(err)
	}

	r := render(t, merge(base(), "serviceMonitor.enabled", true, "prometheusRule.enabled", true,
		"prometheusRule.labels", map[string]any{"release": "kube-prometheus-stack"}))
	var pr struct {
		Spec ruleGroups `yaml:"spec"`
	}
	ro := r.one(t, "PrometheusRule")
	ro.decode(t, &pr)
	if !reflect.DeepEqual(pr.Spec.Groups, want.Groups) {
		t.Errorf("PrometheusRule groups differ from deploy/prometheus/alerts.yml:\n got %d groups\nwant %d groups", len(pr.Spec.Groups), len(want.Groups))
	}
	if n := countAlerts(pr.Spec.Groups); n < 20 {
		t.Errorf("PrometheusRule has %d alerts", n)
	}
	if ro.Metadata.Labels["release"] != "kube-prometheus-stack" {
		t.Errorf("PrometheusRule labels %v: prometheusRule.labels not applied (the operator selects rules by them)", ro.Metadata.Labels)
	}

	var sm struct {
		Spec struct {
			Selector struct {
				MatchLabels map[string]string `yaml:"matchLabels"`
			} `yaml:"selector"`
			Endpoints []struct {
				Port string `yaml:"port"`
				Path string `yaml:"path"`
			} `yaml:"endpoints"`
		} `yaml:"spec"`
	}
	r.one(t, "ServiceMonitor").decode(t, &sm)
	svc := r.one(t, "Service")
	if got := subset(svc.Metadata.Labels, sm.Spec.Selector.MatchLabels); !reflect.DeepEqual(got, sm.Spec.Selector.MatchLabels) {
		t.Errorf("ServiceMonitor selects %v; the Service has %v", sm.Spec.Selector.MatchLabels, svc.Metadata.Labels)
	}
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "http" || sm.Spec.Endpoints[0].Path != "/metrics" {
		t.Errorf("ServiceMonitor endpoints %+v, want port http path /metrics", sm.Spec.Endpoints)
	}
	// The operator names the job after the Service; the `up` alerts select
	// jobs matching .*outbox-relay.*.
	if !strings.Contains(svc.Metadata.Name, "outbox-relay") {
		t.Errorf("Service %q: the `up` alerts would not see its job", svc.Metadata.Name)
	}

	r = render(t, merge(base(), "prometheusRule.enabled", true, "prometheusRule.postgresGroup", false))
	r.one(t, "PrometheusRule").decode(t, &pr)
	var names []string
	for _, g := range pr.Spec.Groups {
		names = append(names, fmt.Sprint(g["name"]))
	}
	if !slices.Equal(names, []string{"outbox-relay"}) {
		t.Errorf("postgresGroup=false: groups %v, want [outbox-relay]", names)
	}
}

func countAlerts(groups []map[string]any) int {
	n := 0
	for _, g := range groups {
		rules, _ := g["rules"].([]any)
		n += len(rules)
	}
	return n
}

// TestEnvironmentNamesFlags checks that every OUTBOX_RELAY_* variable the
// chart sets is the variable of a flag the binary defines: a typo would be
// ignored silently by the relay.
func TestEnvironmentNamesFlags(t *testing.T) {
	r := render(t, merge(base(), "console.enabled", true, "secret.consoleToken", strings.Repeat("k", 16),
		"secret.natsCredsFile", true, "secret.natsCreds", "creds",
		"relay.extraEnv", map[string]any{"STANDBY_SLOT": "standby_1", "stream-replicas": "3"}))
	flags := flagNames(t, filepath.Join(root, "cmd"), filepath.Join(root, "internal"))
	_, c := relayContainer(t, r)
	var j job
	r.one(t, "Job").decode(t, &j)
	seen := 0
	for what, ctr := range map[string]container{"relay": c, "migrate": j.Spec.Template.Spec.Containers[0]} {
		for _, e := range ctr.Env {
			rest, ok := strings.CutPrefix(e.Name, "OUTBOX_RELAY_")
			if !ok {
				t.Errorf("%s: %s is not an OUTBOX_RELAY_ variable", what, e.Name)
				continue
			}
			seen++
			if f := strings.ToLower(strings.ReplaceAll(rest, "_", "-")); !flags[f] {
				t.Errorf("%s: %s names no flag (--%s)", what, e.Name, f)
			}
		}
	}
	if e, _ := c.env("OUTBOX_RELAY_STREAM_REPLICAS"); e.Value != "3" {
		t.Errorf("relay.extraEnv stream-replicas: OUTBOX_RELAY_STREAM_REPLICAS %q, want 3", e.Value)
	}
	if e, _ := c.env("OUTBOX_RELAY_NATS_CREDS"); e.Value == "" {
		t.Error("secret.natsCredsFile: no OUTBOX_RELAY_NATS_CREDS")
	}
	if e, _ := c.env("OUTBOX_RELAY_MESSAGE_FORMAT"); e.Value != "outbox" {
		t.Errorf("OUTBOX_RELAY_MESSAGE_FORMAT %q, want the default outbox", e.Value)
	}
	ce := render(t, merge(base(), "relay.messageFormat", "cloudevents-structured", "relay.cloudeventsSource", "/shop/orders"))
	_, cc := relayContainer(t, ce)
	if f, _ := cc.env("OUTBOX_RELAY_MESSAGE_FORMAT"); f.Value != "cloudevents-structured" {
		t.Errorf("relay.messageFormat: OUTBOX_RELAY_MESSAGE_FORMAT %q", f.Value)
	}
	if s, _ := cc.env("OUTBOX_RELAY_CLOUDEVENTS_SOURCE"); s.Value != "/shop/orders" {
		t.Errorf("relay.cloudeventsSource: OUTBOX_RELAY_CLOUDEVENTS_SOURCE %q", s.Value)
	}
	if seen < 20 {
		t.Errorf("checked only %d variables", seen)
	}
}

// flagNames collects the names of the flags registered in the non-test Go
// files under dirs (fs.StringVar(&v, "name", ...), or a constant holding
// the name), as proof/composecheck does for docker-compose.yml.
func flagNames(t *testing.T, dirs ...string) map[string]bool {
	t.Helper()
	nameArg := map[string]int{
		"StringVar": 1, "IntVar": 1, "Int64Var": 1, "UintVar": 1, "Uint64Var": 1, "BoolVar": 1,
		"DurationVar": 1, "Float64Var": 1, "TextVar": 1, "Var": 1,
		"String": 0, "Int": 0, "Int64": 0, "Uint": 0, "Uint64": 0, "Bool": 0,
		"Duration": 0, "Float64": 0, "Func": 0, "BoolFunc": 0,
	}
	fset := token.NewFileSet()
	var files []*ast.File
	consts := map[string]string{}
	for _, dir := range dirs {
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
			if err != nil {
				return err
			}
			files = append(files, f)
			return nil
		})
		if err != nil {
			t.Fatalf("scan %s: %v", dir, err)
		}
	}
	str := func(e ast.Expr) (string, bool) {
		lit, ok := e.(*ast.BasicLit)
		if !ok || lit.Kind != token.STRING {
			return "", false
		}
		s, err := strconv.Unquote(lit.Value)
		return s, err == nil
	}
	for _, f := range files {
		ast.Inspect(f, func(n ast.Node) bool {
			if vs, ok := n.(*ast.ValueSpec); ok {
				for k, name := range vs.Names {
					if k < len(vs.Values) {
						if s, ok := str(vs.Values[k]); ok {
							consts[name.Name] = s
						}
					}
				}
			}
			return true
		})
	}
	out := map[string]bool{}
	for _, f := range files {
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			i, ok := nameArg[sel.Sel.Name]
			if !ok || i >= len(call.Args) {
				return true
			}
			if s, ok := str(call.Args[i]); ok {
				out[s] = true
			} else if id, ok := call.Args[i].(*ast.Ident); ok && consts[id.Name] != "" {
				out[consts[id.Name]] = true
			}
			return true
		})
	}
	if len(out) == 0 {
		t.Fatal("found no flag definitions under cmd/ and internal/")
	}
	return out
}
