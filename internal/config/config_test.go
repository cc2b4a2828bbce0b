package config

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

func newFS() (*flag.FlagSet, *string, *time.Duration) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	url := fs.String("database-url", "", "")
	lease := fs.Duration("lease", 30*time.Second, "")
	return fs, url, lease
}

func TestEnvFillsUnsetFlags(t *testing.T) {
	fs, url, lease := newFS()
	env := map[string]string{"OUTBOX_RELAY_DATABASE_URL": "postgres://env", "OUTBOX_RELAY_LEASE": "5s"}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	if err := Parse(fs, []string{"--database-url", "postgres://flag"}, lookup); err != nil {
		t.Fatal(err)
	}
	if got, want := *url, "postgres://flag"; got != want {
		t.Errorf("database-url = %q, want %q (flag wins)", got, want)
	}
	if got, want := *lease, 5*time.Second; got != want {
		t.Errorf("lease = %v, want %v (from env)", got, want)
	}
}

func TestBadEnvValueNamesVariableAndFlag(t *testing.T) {
	fs, _, _ := newFS()
	lookup := func(k string) (string, bool) {
		if k == "OUTBOX_RELAY_LEASE" {
			return "soon", true
		}
		return "", false
	}
	err := Parse(fs, nil, lookup)
	if err == nil || !strings.Contains(err.Error(), "OUTBOX_RELAY_LEASE") || !strings.Contains(err.Error(), "--lease") {
		t.Fatalf("err = %v, want one naming OUTBOX_RELAY_LEASE and --lease", err)
	}
}

func TestEnvName(t *testing.T) {
	if got, want := EnvName("nats-url"), "OUTBOX_RELAY_NATS_URL"; got != want {
		t.Errorf("EnvName = %q, want %q", got, want)
	}
}
