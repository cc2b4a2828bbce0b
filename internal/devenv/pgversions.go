package devenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// The environment variables that choose the PostgreSQL a test (or the demo)
// runs when its options do not: a directory of binaries, or a major version
// resolved by PostgresBinDir. `make test-pg-versions` sets the version.
const (
	EnvPGBin     = "OUTBOX_RELAY_TEST_PG_BIN"
	EnvPGVersion = "OUTBOX_RELAY_TEST_PG_VERSION"
)

// PGVersionsDir is where scripts/install-pg-versions.sh (`make pg-versions`)
// puts the PostgreSQL versions that Debian does not package, one directory
// per major version: $OUTBOX_RELAY_PG_VERSIONS_DIR, else
// /opt/outbox-relay-pg for root, else the user's cache directory. The
// script computes the same; keep them in step.
func PGVersionsDir() string {
	if d := os.Getenv("OUTBOX_RELAY_PG_VERSIONS_DIR"); d != "" {
		return d
	}
	if os.Geteuid() == 0 {
		return "/opt/outbox-relay-pg"
	}
	if d := os.Getenv("XDG_CACHE_HOME"); d != "" {
		return filepath.Join(d, "outbox-relay-pg")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		// Not found later, with an error that names the directory.
		return "outbox-relay-pg"
	}
	return filepath.Join(home, ".cache", "outbox-relay-pg")
}

// PostgresBinDir returns the directory of PostgreSQL major's server
// binaries: Debian's /usr/lib/postgresql/<major>/bin when installed (15
// here, through `make setup`), else <PGVersionsDir>/<major>/bin (16 to 18,
// through `make pg-versions`). The npm-packaged binaries need no
// LD_LIBRARY_PATH: they find their bundled libraries through their RUNPATH
// ($ORIGIN/../lib), as postgres finds its share/ and lib/ relative to
// itself.
func PostgresBinDir(major int) (string, error) {
	if major <= 0 {
		return "", fmt.Errorf("PostgreSQL version %d: want a major version such as 15 or 17", major)
	}
	v := strconv.Itoa(major)
	candidates := []string{
		filepath.Join("/usr/lib/postgresql", v, "bin"),
		filepath.Join(PGVersionsDir(), v, "bin"),
	}
	for _, d := range candidates {
		if hasServerBinaries(d) {
			return d, nil
		}
	}
	return "", fmt.Errorf("no PostgreSQL %d server binaries (initdb, postgres) in %s or %s: `make setup` installs Debian's (15), `make pg-versions` installs 16 to 18",
		major, candidates[0], candidates[1])
}

func hasServerBinaries(dir string) bool {
	for _, exe := range []string{"initdb", "postgres"} {
		if fi, err := os.Stat(filepath.Join(dir, exe)); err != nil || fi.IsDir() {
			return false
		}
	}
	return true
}

// postgresBinDir chooses the binaries for opts. By default it picks the
// newest major version in /usr/lib/postgresql so tests follow the server
// that CI images ship. The variables keep their test names because `make
// setup` and the demo read them too. It also returns the major version
// asked for, 0 when none was, for initPostgres to check against the cluster
// the binaries made.
func postgresBinDir(opts PostgresOptions) (dir string, major int, err error) {
	switch {
	case opts.BinDir != "" && opts.Version != 0:
		return "", 0, errors.New("choose PostgreSQL by BinDir or by Version, not both")
	case opts.BinDir != "":
		return opts.BinDir, 0, nil
	case opts.Version != 0:
		dir, err := PostgresBinDir(opts.Version)
		return dir, opts.Version, err
	}
	envDir, envVer := os.Getenv(EnvPGBin), os.Getenv(EnvPGVersion)
	switch {
	case envDir != "" && envVer != "":
		// Which one the run tested would otherwise be a guess.
		return "", 0, fmt.Errorf("both %s=%s and %s=%s are set: set one", EnvPGBin, envDir, EnvPGVersion, envVer)
	case envDir != "":
		return envDir, 0, nil
	case envVer != "":
		major, err := strconv.Atoi(envVer)
		if err != nil {
			return "", 0, fmt.Errorf("%s=%q: want a major version such as 17", EnvPGVersion, envVer)
		}
		dir, err := PostgresBinDir(major)
		return dir, major, err
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	best, bestVer := "", -1.0
	for _, d := range dirs {
		v, err := strconv.ParseFloat(filepath.Base(filepath.Dir(d)), 64)
		if err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "postgres")); err != nil {
			continue
		}
		if v > bestVer {
			best, bestVer = d, v
		}
	}
	if best == "" {
		return "", 0, fmt.Errorf("no PostgreSQL server binaries (initdb, postgres) in /usr/lib/postgresql/*/bin: install them (`make setup` does, through apt) or set %s to the directory holding them", EnvPGBin)
	}
	return best, 0, nil
}
