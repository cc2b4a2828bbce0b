package devenv

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeNATSServer puts an executable named nats-server in a new directory
// and returns both.
func fakeNATSServer(t *testing.T) (dir, path string) {
	t.Helper()
	dir = t.TempDir()
	path = filepath.Join(dir, "nats-server")
	if err := os.WriteFile(path, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return dir, path
}

func TestFindNATSServerOutsideACheckout(t *testing.T) {
	t.Chdir(t.TempDir())
	dir, fake := fakeNATSServer(t)

	t.Setenv("PATH", dir)
	if got, err := FindNATSServer(""); err != nil || got != fake {
		t.Errorf("with nats-server on PATH: got %q, %v; want %q", got, err, fake)
	}

	t.Setenv("PATH", t.TempDir())
	_, err := FindNATSServer("")
	if err == nil {
		t.Fatal("found a nats-server with none on PATH and no checkout")
	}
	for _, want := range []string{"not in a source checkout", "PATH"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say what was tried (%q)", err, want)
		}
	}
}

// A binary the user names is used, and one that does not work is refused
// rather than replaced by another version.
func TestFindNATSServerExplicit(t *testing.T) {
	dir, fake := fakeNATSServer(t)
	t.Setenv("PATH", dir)
	if got, err := FindNATSServer(fake); err != nil || got != fake {
		t.Errorf("FindNATSServer(%q) = %q, %v", fake, got, err)
	}
	missing := filepath.Join(t.TempDir(), "nats-server")
	if got, err := FindNATSServer(missing); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("FindNATSServer(%q) = %q, %v; want an error naming it", missing, got, err)
	}
}

// Inside the checkout the pinned version wins over one on PATH.
func TestFindNATSServerPrefersPinned(t *testing.T) {
	pinned, err := PinnedNATSServer()
	if err != nil {
		t.Fatal(err)
	}
	dir, _ := fakeNATSServer(t)
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	got, err := FindNATSServer("")
	if err != nil || got != pinned {
		t.Errorf("FindNATSServer in the checkout = %q, %v; want the pinned %q", got, err, pinned)
	}
}

func TestModuleRootFromProof(t *testing.T) {
	root, err := ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	t.Chdir(filepath.Join(root, "proof"))
	if got, err := ModuleRoot(); err != nil || got != root {
		t.Errorf("ModuleRoot in proof/ = %q, %v; want %q", got, err, root)
	}
}
