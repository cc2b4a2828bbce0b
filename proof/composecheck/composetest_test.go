package composecheck

import (
	"net"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/outbox-relay/outbox-relay/proof/composetest"
)

// machineOverride is the override make compose-test runs docker-compose.yml
// with, parsed, and the raw services of docker-compose.yml.
func machineOverride(t *testing.T) (override, base map[string]map[string]any) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := composetest.Machine("127.0.0.1:15432", "127.0.0.1:14222", "127.0.0.1:18080")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Images["postgres"] = "stand-in/postgres:15"
	cfg.Images["nats"] = "stand-in/nats:2"
	cfg.BuildArgs = map[string]string{"GO_IMAGE": "stand-in/golang", "GOPROXY": "http://127.0.0.1:1"}
	o, err := composetest.Override(b, cfg)
	if err != nil {
		t.Fatalf("composetest.Override(docker-compose.yml): %v", err)
	}
	var doc struct {
		Services map[string]map[string]any `yaml:"services"`
	}
	if err := yaml.Unmarshal(o, &doc); err != nil {
		t.Fatalf("parse the override: %v\n%s", err, o)
	}
	return doc.Services, rawServices(t)
}

// TestComposeTestOverrideChangesOnlyTheMachine checks that the override make
// compose-test uses changes only what its machines force (host networking,
// loopback endpoints, image sources) and none of how the services are
// configured, depend on each other, become healthy or restart.
func TestComposeTestOverrideChangesOnlyTheMachine(t *testing.T) {
	over, base := machineOverride(t)
	if len(over) != len(base) {
		t.Errorf("override has %d services, docker-compose.yml %d", len(over), len(base))
	}
	allowed := []string{"network_mode", "ports", "image", "build", "command", "environment"}
	for name, o := range over {
		b, ok := base[name]
		if !ok {
			t.Errorf("override adds service %s", name)
			continue
		}
		for k := range o {
			if !slices.Contains(allowed, k) {
				t.Errorf("%s: override sets %s, which is not the machine's to change", name, k)
			}
		}
		if o["network_mode"] != "host" {
			t.Errorf("%s: network_mode %v, want host (no bridge network on these machines)", name, o["network_mode"])
		}
		if p, ok := o["ports"]; ok && !reflect.DeepEqual(p, []any{}) {
			t.Errorf("%s: ports %v, want reset to none", name, p)
		}
		if _, ok := o["image"]; ok && name != "postgres" && name != "nats" {
			t.Errorf("%s: override replaces its image; only the official images get stand-ins", name)
		}
		if bo, ok := o["build"].(map[string]any); ok {
			for k := range bo {
				if k != "network" && k != "args" {
					t.Errorf("%s: override sets build.%s", name, k)
				}
			}
		}
		if c, ok := o["command"]; ok {
			oc := stringList(t, name+" override command", c)
			bc := stringList(t, name+" command", b["command"])
			if !slices.Equal(oc[:min(len(bc), len(oc))], bc) {
				t.Errorf("%s: override command %q does not start with docker-compose.yml's %q", name, oc, bc)
			}
			for _, a := range oc[len(bc):] {
				if !strings.HasPrefix(a, "listen_addresses=") && a != "-c" && a != "-a" && a != "-p" && net.ParseIP(a) == nil && !regexp.MustCompile(`^\d+$`).MatchString(a) {
					t.Errorf("%s: override adds %q to the command: only listen addresses and ports may be added", name, a)
				}
			}
		}
		be := envMap(t, name, b["environment"])
		for k, v := range envMap(t, name+" override", o["environment"]) {
			bv, ok := be[k]
			switch {
			case !ok && k == "PGPORT" && name == "postgres":
			case !ok:
				t.Errorf("%s: override adds %s", name, k)
			case k == "OUTBOX_RELAY_HTTP_ADDR":
				if h, _, err := net.SplitHostPort(v); err != nil || !net.ParseIP(h).IsLoopback() {
					t.Errorf("%s: %s = %q, want a loopback address", name, k, v)
				}
			default:
				ou, err1 := url.Parse(v)
				bu, err2 := url.Parse(bv)
				if err1 != nil || err2 != nil {
					t.Errorf("%s: %s changed from %q to %q, which are not URLs", name, k, bv, v)
					continue
				}
				if !net.ParseIP(ou.Hostname()).IsLoopback() {
					t.Errorf("%s: %s points at %s, want a loopback address", name, k, ou.Host)
				}
				ou.Host, bu.Host = "", ""
				if ou.String() != bu.String() {
					t.Errorf("%s: %s changed beyond its host and port: %q -> %q", name, k, bv, v)
				}
			}
		}
	}
}

// TestComposeTestOverrideKeepsAWrongURL: the override rewrites only the
// address of a compose service, so a URL that names no service (a typo in
// docker-compose.yml) still reaches the test, and fails it.
func TestComposeTestOverrideKeepsAWrongURL(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(root, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	const good = "postgres://postgres:postgres@postgres:5432/postgres?sslmode=disable"
	const wrong = "postgres://postgres:postgres@postgress:5432/postgres?sslmode=disable"
	if !strings.Contains(string(b), "OUTBOX_RELAY_DATABASE_URL: "+good) {
		t.Fatalf("docker-compose.yml no longer sets OUTBOX_RELAY_DATABASE_URL: %s; update this test", good)
	}
	planted := strings.Replace(string(b), "OUTBOX_RELAY_DATABASE_URL: "+good, "OUTBOX_RELAY_DATABASE_URL: "+wrong, 1)
	cfg, err := composetest.Machine("127.0.0.1:15432", "127.0.0.1:14222", "127.0.0.1:18080")
	if err != nil {
		t.Fatal(err)
	}
	o, err := composetest.Override([]byte(planted), cfg)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Services map[string]map[string]any `yaml:"services"`
	}
	if err := yaml.Unmarshal(o, &doc); err != nil {
		t.Fatal(err)
	}
	var rewritten, kept int
	for name, s := range doc.Services {
		for k, v := range envMap(t, name, s["environment"]) {
			if k != "OUTBOX_RELAY_DATABASE_URL" {
				continue
			}
			if v == "postgres://postgres:postgres@127.0.0.1:15432/postgres?sslmode=disable" {
				rewritten++
			}
		}
		if _, ok := envMap(t, name, s["environment"])["OUTBOX_RELAY_DATABASE_URL"]; !ok && name == "migrate" {
			kept++ // the planted service: left as docker-compose.yml has it
		}
	}
	if kept != 1 || rewritten != 1 {
		t.Errorf("with a wrong URL planted in migrate: %d services' OUTBOX_RELAY_DATABASE_URL left alone, %d rewritten; want 1 and 1 (relay)\n%s", kept, rewritten, o)
	}
}

// TestComposeTestRefusesNonLoopback: the override never points a service
// at an address outside the loopback range.
func TestComposeTestRefusesNonLoopback(t *testing.T) {
	for _, addr := range []string{"10.0.0.5:5432", "172.17.0.2:5432", "postgres:5432"} {
		if _, err := composetest.Machine(addr, "127.0.0.1:14222", "127.0.0.1:18080"); err == nil {
			t.Errorf("Machine(%s): no error, want a refusal of a non-loopback address", addr)
		}
	}
}

// TestDockerfilesBuildWithoutARegistry checks what lets make compose-test
// build the Dockerfiles offline with Debian's docker.io (the legacy builder)
// while users get the official images by default.
func TestDockerfilesBuildWithoutARegistry(t *testing.T) {
	for _, name := range []string{"Dockerfile", filepath.Join("examples", "Dockerfile")} {
		b, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		if regexp.MustCompile(`(?mi)^#\s*syntax\s*=`).MatchString(text) {
			t.Errorf("%s has a # syntax= line: BuildKit would pull that frontend from a registry", name)
		}
		if regexp.MustCompile(`(?m)^[^#]*--mount`).MatchString(text) {
			t.Errorf("%s uses RUN --mount, which the legacy builder cannot run", name)
		}
		defaults := map[string]string{}
		for _, m := range regexp.MustCompile(`(?m)^ARG (\w+)(?:=(\S+))?`).FindAllStringSubmatch(text, -1) {
			defaults[m[1]] = m[2]
		}
		want := map[string]string{
			"GO_IMAGE":      "golang:${GO_VERSION}-bookworm",
			"RUNTIME_IMAGE": "gcr.io/distroless/static-debian12:nonroot",
		}
		for arg, def := range want {
			if defaults[arg] != def {
				t.Errorf("%s: ARG %s default %q, want the official %q", name, arg, defaults[arg], def)
			}
		}
		if _, ok := defaults["GOPROXY"]; !ok {
			t.Errorf("%s: no ARG GOPROXY: module downloads cannot be pointed at a local proxy", name)
		}
		froms := regexp.MustCompile(`(?m)^FROM (\S+)`).FindAllStringSubmatch(text, -1)
		if len(froms) != 2 || froms[0][1] != "${GO_IMAGE}" || froms[1][1] != "${RUNTIME_IMAGE}" {
			t.Errorf("%s: FROM lines %q, want ${GO_IMAGE} then ${RUNTIME_IMAGE}", name, froms)
		}
	}
}
