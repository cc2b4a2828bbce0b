package devenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

// natsServerBin is the binary StartNATS and StartNATSCluster run.
func natsServerBin(opts NATSOptions) (string, error) {
	if opts.Bin != "" {
		return opts.Bin, nil
	}
	return PinnedNATSServer()
}

// PinnedNATSServer is the path of the nats-server that the product's go.mod
// pins with its tool directive, from `go tool -n nats-server` in the module
// root: tests run against a known version, not whatever is on PATH. It
// needs a source checkout and a Go toolchain. The result is cached because
// `go tool -n` has to build nats-server the first time (about a minute) and
// is not free afterwards either.
func PinnedNATSServer() (string, error) { return pinnedNATSServer() }

var pinnedNATSServer = sync.OnceValues(func() (string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.Command("go", "tool", "-n", "nats-server")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("go tool -n nats-server in %s: %w: %s", root, err, strings.TrimSpace(string(ee.Stderr)))
		}
		return "", fmt.Errorf("go tool -n nats-server in %s: %w", root, err)
	}
	path := strings.TrimSpace(string(out))
	if path == "" {
		return "", errors.New("go tool -n nats-server printed no path")
	}
	return path, nil
})

// FindNATSServer picks the nats-server for a run outside the tests, where
// there may be no source checkout (the binary alone, a container): explicit
// when it is not empty; else the pinned version when the working directory
// is inside a checkout of the product; else nats-server on PATH. The error
// lists what was tried and why each failed.
func FindNATSServer(explicit string) (string, error) {
	if explicit != "" {
		// A path the user named is used or refused, never silently replaced
		// by another version.
		p, err := exec.LookPath(explicit)
		if err != nil {
			return "", fmt.Errorf("nats-server: %w", err)
		}
		return p, nil
	}
	var tried []string
	if _, err := ModuleRoot(); err == nil {
		p, err := PinnedNATSServer()
		if err == nil {
			return p, nil
		}
		tried = append(tried, fmt.Sprintf("the version pinned in go.mod: %v", err))
	} else {
		tried = append(tried, "the version pinned in go.mod: not in a source checkout")
	}
	p, err := exec.LookPath("nats-server")
	if err == nil {
		return p, nil
	}
	tried = append(tried, fmt.Sprintf("PATH: %v", err))
	return "", fmt.Errorf("no nats-server found (tried %s)", strings.Join(tried, "; "))
}

// productModule is the module path of the relay itself; the proof module
// (proof/, the end-to-end tests, chaos run and benchmark) lives inside it.
const productModule = "github.com/outbox-relay/outbox-relay"

// ModuleRoot is the directory of the product's go.mod above the working
// directory: where tests run `go build ./cmd/outbox-relay` and `go tool
// nats-server` from, also when they run in the nested proof module.
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("find module root: %w", err)
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && modulePath(b) == productModule {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("find module root: no go.mod of %s above the working directory", productModule)
		}
		dir = parent
	}
}

func modulePath(gomod []byte) string {
	for _, line := range strings.Split(string(gomod), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
			return strings.Trim(strings.TrimSpace(rest), `"`)
		}
	}
	return ""
}
