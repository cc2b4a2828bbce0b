package helmcheck

import (
	"reflect"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

// The migrate hook runs as the table's owner (issue 30): by default it read
// the relay's database-url, whose least-privilege role cannot migrate (and
// migrate now refuses every role but the owner). It reads
// migrate-database-url, and the chart refuses to render without it, unless
// the relay's URL is named on purpose.
func TestMigrateHookUsesTheOwnersURL(t *testing.T) {
	relayOnly := map[string]any{"secret": map[string]any{"databaseURL": databaseURL}}
	if _, err := renderErr(t, relayOnly); err == nil || !strings.Contains(err.Error(), "secret.migrateDatabaseURL") {
		t.Errorf("migrate hook without the owner's URL: err %v, want a refusal naming secret.migrateDatabaseURL", err)
	}

	var j job
	render(t, map[string]any{"secret": map[string]any{"existingSecret": "shop-outbox"}}).one(t, "Job").decode(t, &j)
	wantSecretEnv(t, "migrate with existingSecret", j.Spec.Template.Spec.Containers[0], "OUTBOX_RELAY_DATABASE_URL", "shop-outbox", "migrate-database-url")

	// A relay role that owns the table, said so.
	r := render(t, merge(relayOnly, "migrate.databaseURLKey", "database-url"))
	r.one(t, "Job").decode(t, &j)
	wantSecretEnv(t, "migrate with databaseURLKey database-url", j.Spec.Template.Spec.Containers[0], "OUTBOX_RELAY_DATABASE_URL", r.one(t, "Secret").Metadata.Name, "database-url")
	if n := len(render(t, merge(map[string]any{"secret": map[string]any{"databaseURL": databaseURL}}, "migrate.enabled", false)).kinds()); n == 0 {
		t.Error("migrate.enabled=false without an owner's URL rendered nothing")
	}
}

// A console token of 16 spaces passed the chart's length check, and the
// relay, which trims it, refused it at every start: a crash loop. The chart
// trims it as the relay does.
func TestConsoleTokenTrimmed(t *testing.T) {
	for name, token := range map[string]string{
		"16 spaces":       strings.Repeat(" ", 16),
		"tabs and spaces": " \t\n" + strings.Repeat(" ", 14),
		"padded short":    strings.Repeat(" ", 10) + "short" + strings.Repeat(" ", 10),
	} {
		_, err := renderErr(t, merge(base(), "console.enabled", true, "secret.consoleToken", token))
		if err == nil || !strings.Contains(err.Error(), "whitespace is trimmed") {
			t.Errorf("%s: err %v, want a refusal saying the token is measured trimmed", name, err)
		}
	}
	render(t, merge(base(), "console.enabled", true, "secret.consoleToken", "  "+strings.Repeat("k", 16)+"  "))
}

// relay.extraEnv (and env) could set a variable the chart sets from the
// Secret, in plain text in the Deployment, shadowing it (and, for the ones
// set from values, contradicting them). Refused, naming the value to set.
func TestExtraEnvCannotShadow(t *testing.T) {
	for name, tc := range map[string]struct {
		values map[string]any
		want   string
	}{
		"extraEnv DATABASE_URL": {merge(base(), "relay.extraEnv", map[string]any{"DATABASE_URL": ownerURL}), "secret.databaseURL"},
		"extraEnv database-url": {merge(base(), "relay.extraEnv", map[string]any{"database-url": ownerURL}), "secret.databaseURL"},
		"extraEnv full name":    {merge(base(), "relay.extraEnv", map[string]any{"OUTBOX_RELAY_DATABASE_URL": ownerURL}), "secret.databaseURL"},
		"extraEnv NATS_URL":     {merge(base(), "relay.extraEnv", map[string]any{"NATS_URL": "nats://u:p@nats:4222"}), "relay.natsURL"},
		"extraEnv NATS_PASSWORD": {merge(base(), "relay.extraEnv", map[string]any{"NATS_PASSWORD": "p"}),
			"secret.natsPassword"},
		"extraEnv CONSOLE_TOKEN": {merge(base(), "console.enabled", true, "secret.consoleToken", strings.Repeat("k", 16),
			"relay.extraEnv", map[string]any{"console_token": strings.Repeat("x", 16)}), "secret.consoleToken"},
		"env OUTBOX_RELAY_DATABASE_URL": {merge(base(), "env", []any{map[string]any{"name": "OUTBOX_RELAY_DATABASE_URL", "value": ownerURL}}),
			"secret.databaseURL"},
	} {
		out, err := renderErr(t, tc.values)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want a refusal naming %s", name, err, tc.want)
		}
		for _, o := range out {
			if b, _ := yaml.Marshal(&o.node); o.Kind != "Secret" && strings.Contains(string(b), "owner-secret") {
				t.Errorf("%s: the owner's password is in plain text in %s %s", name, o.Kind, o.Metadata.Name)
			}
		}
	}
	// Other variables are still passed.
	_, c := relayContainer(t, render(t, merge(base(), "env", []any{map[string]any{"name": "GOMEMLIMIT", "value": "200MiB"}})))
	if e, _ := c.env("GOMEMLIMIT"); e.Value != "200MiB" {
		t.Errorf("env GOMEMLIMIT %q, want 200MiB", e.Value)
	}
}

type networkPolicy struct {
	Spec struct {
		PodSelector struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"podSelector"`
		PolicyTypes []string `yaml:"policyTypes"`
		Ingress     []struct {
			From  []map[string]any `yaml:"from"`
			Ports []struct {
				Port     any    `yaml:"port"`
				Protocol string `yaml:"protocol"`
			} `yaml:"ports"`
		} `yaml:"ingress"`
	} `yaml:"spec"`
}

// An enabled console had no NetworkPolicy: every pod of the cluster could
// reach the page that reads every payload. With the console on, a policy
// admits to the relay's pods only console.networkPolicy.from (none by
// default: the node only), on the http port.
func TestConsoleNetworkPolicy(t *testing.T) {
	on := func(kv ...any) map[string]any {
		return merge(base(), append([]any{"console.enabled", true, "secret.consoleToken", strings.Repeat("k", 32)}, kv...)...)
	}
	r := render(t, on())
	d, _ := relayContainer(t, r)
	var np networkPolicy
	r.one(t, "NetworkPolicy").decode(t, &np)
	if !reflect.DeepEqual(np.Spec.PodSelector.MatchLabels, d.Spec.Selector.MatchLabels) {
		t.Errorf("NetworkPolicy selects %v, the Deployment's pods are %v", np.Spec.PodSelector.MatchLabels, d.Spec.Selector.MatchLabels)
	}
	if !reflect.DeepEqual(np.Spec.PolicyTypes, []string{"Ingress"}) || len(np.Spec.Ingress) != 0 {
		t.Errorf("default NetworkPolicy: types %v, ingress %+v; want Ingress with no rule (nothing but the node)", np.Spec.PolicyTypes, np.Spec.Ingress)
	}

	peers := []any{map[string]any{"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": "ingress-nginx"}}}}
	render(t, on("console.networkPolicy.from", peers)).one(t, "NetworkPolicy").decode(t, &np)
	if len(np.Spec.Ingress) != 1 || len(np.Spec.Ingress[0].From) != 1 || np.Spec.Ingress[0].From[0]["namespaceSelector"] == nil ||
		len(np.Spec.Ingress[0].Ports) != 1 || np.Spec.Ingress[0].Ports[0].Port != "http" {
		t.Errorf("NetworkPolicy with from: ingress %+v, want one rule from the ingress-nginx namespace to port http", np.Spec.Ingress)
	}

	for name, values := range map[string]map[string]any{
		"console off":       base(),
		"policy turned off": on("console.networkPolicy.enabled", false),
	} {
		if n := render(t, values).kinds()["NetworkPolicy"]; n != 0 {
			t.Errorf("%s: %d NetworkPolicies", name, n)
		}
	}
}
