package composecheck

import (
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

// TestExampleServices checks the example producer and consumer services:
// started by a plain `docker compose up`, built from examples/Dockerfile for a program
// that exists, and pointed at the compose services.
func TestExampleServices(t *testing.T) {
	c := loadCompose(t)
	raw := rawServices(t)
	pgEnv := envMap(t, "postgres", mustService(t, c, "postgres").Environment)
	df, err := os.ReadFile(filepath.Join(root, "examples", "Dockerfile"))
	if err != nil {
		t.Fatalf("read examples/Dockerfile: %v", err)
	}
	for _, want := range []string{"ARG EXAMPLE", "./examples/${EXAMPLE}", "CGO_ENABLED=0", "USER nonroot"} {
		if !strings.Contains(string(df), want) {
			t.Errorf("examples/Dockerfile does not contain %q", want)
		}
	}

	for _, name := range []string{"producer", "consumer"} {
		s := mustService(t, c, name)
		if profiles := stringList(t, name+" profiles", raw[name]["profiles"]); len(profiles) > 0 {
			t.Errorf("%s: profiles %q, want none so a plain `docker compose up` shows rows flowing", name, profiles)
		}
		b, ok := s.Build.(map[string]any)
		if !ok {
			t.Fatalf("%s: build is a %T, want context, dockerfile and args", name, s.Build)
		}
		if ctx, _ := b["context"].(string); filepath.Clean(ctx) != "." {
			t.Errorf("%s: build context %q, want the repository root", name, ctx)
		}
		if d, _ := b["dockerfile"].(string); d != "examples/Dockerfile" {
			t.Errorf("%s: dockerfile %q, want examples/Dockerfile", name, d)
		}
		args := envMap(t, name+" build args", b["args"])
		if _, err := os.Stat(filepath.Join(root, "examples", args["EXAMPLE"], "main.go")); args["EXAMPLE"] == "" || err != nil {
			t.Errorf("%s: build arg EXAMPLE=%q does not name a program under examples/", name, args["EXAMPLE"])
		}

		env := envMap(t, name, s.Environment)
		u, err := url.Parse(env["DATABASE_URL"])
		if err != nil || u.Hostname() != "postgres" {
			t.Errorf("%s: DATABASE_URL %q, want the compose service postgres", name, env["DATABASE_URL"])
		} else if pw, _ := u.User.Password(); pw != pgEnv["POSTGRES_PASSWORD"] {
			t.Errorf("%s: DATABASE_URL password does not match POSTGRES_PASSWORD", name)
		}
		deps := dependsOn(t, name, s.DependsOn)
		if deps["postgres"] != "service_healthy" {
			t.Errorf("%s: depends_on postgres %q, want service_healthy", name, deps["postgres"])
		}
		switch name {
		case "producer":
			// It writes into the outbox table, which migrate creates.
			if deps["migrate"] != "service_completed_successfully" {
				t.Errorf("producer: depends_on migrate %q, want service_completed_successfully", deps["migrate"])
			}
		case "consumer":
			if u, err := url.Parse(env["NATS_URL"]); err != nil || u.Scheme != "nats" || u.Hostname() != "nats" {
				t.Errorf("consumer: NATS_URL %q, want nats://nats:4222", env["NATS_URL"])
			}
			if deps["nats"] != "service_healthy" {
				t.Errorf("consumer: depends_on nats %q, want service_healthy", deps["nats"])
			}
			// The relay's defaults: stream OUTBOX bound to outbox.>.
			if env["STREAM"] != "" && env["STREAM"] != "OUTBOX" {
				t.Errorf("consumer: STREAM %q, want the relay's default OUTBOX", env["STREAM"])
			}
			if sub := env["SUBJECT"]; sub != "" && !strings.HasPrefix(sub, "outbox.") {
				t.Errorf("consumer: SUBJECT %q is outside the relay's default subject prefix outbox.", sub)
			}
		}
	}
}

// rawServices reads the services as plain maps, for fields the typed view
// leaves out.
func rawServices(t *testing.T) map[string]map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Services map[string]map[string]any `yaml:"services"`
	}
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	return doc.Services
}
