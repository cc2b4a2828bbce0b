package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

var relayBinaries sync.Map // race bool -> func() (string, error)

// RelayBinary builds cmd/outbox-relay once per process (with -race when
// race is set, as the calling tests run) and returns its path. The binary
// goes next to the test binary, which `go test` keeps in its work directory
// and removes afterwards; Main ends the process with os.Exit, so there is no
// later moment to clean up a directory of our own.
func RelayBinary(race bool) (string, error) {
	f, _ := relayBinaries.LoadOrStore(race, sync.OnceValues(func() (string, error) { return buildRelay(race) }))
	return f.(func() (string, error))()
}

func buildRelay(race bool) (string, error) {
	var err error
	dir := ""
	if exe, err := os.Executable(); err == nil {
		dir = filepath.Dir(exe)
		if f, err := os.CreateTemp(dir, ".probe-"); err == nil {
			f.Close()
			os.Remove(f.Name())
		} else {
			dir = ""
		}
	}
	if dir == "" {
		if dir, err = os.MkdirTemp("", "outbox-relay-bin-"); err != nil {
			return "", err
		}
	}
	bin := filepath.Join(dir, "outbox-relay")
	return bin, BuildRelay(bin, race)
}

// BuildRelay builds cmd/outbox-relay of this module into out, with -race
// when race is set.
func BuildRelay(out string, race bool) error {
	root, err := ModuleRoot()
	if err != nil {
		return err
	}
	args := []string{"build", "-o", out}
	if race {
		args = append(args, "-race")
	}
	cmd := exec.Command("go", append(args, "./cmd/outbox-relay")...)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, b)
	}
	return nil
}

// RelayEnv is this process's environment without OUTBOX_RELAY_* variables,
// plus extra: a developer's settings must not leak into relays under test.
func RelayEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OUTBOX_RELAY_") {
			env = append(env, kv)
		}
	}
	return append(env, extra...)
}
