package console

import (
	"errors"
	"strings"
	"testing"
)

func TestSafeErrorHidesCredentials(t *testing.T) {
	for _, e := range []string{
		"connect postgres://relay:hunter2@db:5432/app failed",
		"failed to connect to host=db user=relay password=hunter2 dbname=app",
		"parse: password='hunter2 x' sslmode=require",
		"nats: nats://tok:hunter2@broker:4222: refused",
	} {
		got := safeError(errors.New(e))
		if strings.Contains(got, "hunter2") {
			t.Errorf("safeError(%q) = %q: shows the password", e, got)
		}
	}
}

func TestCleanName(t *testing.T) {
	for in, want := range map[string]string{
		"  alice ":               "alice",
		"bob\x1b[2K\r\nmallory":  "bob[2Kmallory",
		"eve\u202egnp.exe":       "evegnp.exe",
		strings.Repeat("é", 100): strings.Repeat("é", 32),
	} {
		if got := cleanName(in); got != want {
			t.Errorf("cleanName(%q) = %q, want %q", in, got, want)
		}
	}
}
