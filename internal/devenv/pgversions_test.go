package devenv

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeVersionsDir makes OUTBOX_RELAY_PG_VERSIONS_DIR a new directory with
// <major>/bin for each of majors, whose initdb and postgres are links to
// the binaries in target.
func fakeVersionsDir(t *testing.T, target string, majors ...string) string {
	t.Helper()
	root := t.TempDir()
	// The server's user must get through to run them.
	for d := root; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range majors {
		bin := filepath.Join(root, m, "bin")
		if err := os.MkdirAll(bin, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, exe := range []string{"initdb", "postgres"} {
			if err := os.Symlink(filepath.Join(target, exe), filepath.Join(bin, exe)); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Setenv("OUTBOX_RELAY_PG_VERSIONS_DIR", root)
	return root
}

func TestPostgresBinDirFromVersionsDir(t *testing.T) {
	debian, err := PostgresBinDir(15)
	if err != nil {
		t.Fatal(err)
	}
	root := fakeVersionsDir(t, debian, "99")
	got, err := PostgresBinDir(99)
	if want := filepath.Join(root, "99", "bin"); err != nil || got != want {
		t.Errorf("PostgresBinDir(99) = %q, %v; want %q", got, err, want)
	}
	_, err = PostgresBinDir(98)
	if err == nil || !strings.Contains(err.Error(), "make pg-versions") || !strings.Contains(err.Error(), filepath.Join(root, "98", "bin")) {
		t.Errorf("PostgresBinDir(98) with none installed: %v; want an error naming where it looked and how to install", err)
	}
}

func TestPostgresBinDirChoices(t *testing.T) {
	t.Setenv(EnvPGBin, "")
	t.Setenv(EnvPGVersion, "")
	if _, _, err := postgresBinDir(PostgresOptions{BinDir: "/x", Version: 17}); err == nil {
		t.Error("BinDir and Version together were accepted")
	}
	t.Setenv(EnvPGBin, "/x")
	t.Setenv(EnvPGVersion, "17")
	if _, _, err := postgresBinDir(PostgresOptions{}); err == nil || !strings.Contains(err.Error(), EnvPGBin) {
		t.Errorf("both environment variables set: %v; want an error naming them", err)
	}
	// The options win over the environment.
	if dir, _, err := postgresBinDir(PostgresOptions{BinDir: "/y"}); err != nil || dir != "/y" {
		t.Errorf("BinDir /y with the environment set: %q, %v", dir, err)
	}
	t.Setenv(EnvPGBin, "")
	t.Setenv(EnvPGVersion, "seventeen")
	if _, _, err := postgresBinDir(PostgresOptions{}); err == nil {
		t.Error("a version that is not a number was accepted")
	}
}

// Binaries that are not the version asked for are refused rather than
// tested under the wrong name.
func TestStartPostgresChecksTheVersion(t *testing.T) {
	debian, err := PostgresBinDir(15)
	if err != nil {
		t.Fatal(err)
	}
	fakeVersionsDir(t, debian, "99")
	t.Setenv(EnvPGBin, "")
	t.Setenv(EnvPGVersion, "99")
	p, err := StartPostgres(PostgresOptions{})
	if err == nil {
		p.Close()
		t.Fatal("started PostgreSQL 15's binaries as 99")
	}
	if !strings.Contains(err.Error(), "asked for PostgreSQL 99") || !strings.Contains(err.Error(), "version 15") {
		t.Errorf("error %q does not say which version was asked for and which was found", err)
	}
}
