package config

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

// Console logs in a file or a pipe carry no colour codes: there they are
// noise for grep and log shippers, not colour.
func TestConsoleLoggerWritesNoColourOffTerminal(t *testing.T) {
	var buf bytes.Buffer
	l := Logging{Level: "debug", Format: "console"}
	log, err := l.Logger(&buf)
	if err != nil {
		t.Fatal(err)
	}
	log.Warn().Str("slot", "outbox_relay").Err(errors.New("boom")).Msg("hello")
	if out := buf.String(); !strings.Contains(out, "hello") || strings.Contains(out, "\x1b[") {
		t.Fatalf("console log = %q, want the message without ANSI escapes", out)
	}
}

func TestColourOnlyOnATerminalWithoutNoColor(t *testing.T) {
	none := func(string) (string, bool) { return "", false }
	noColor := func(k string) (string, bool) { return "1", k == "NO_COLOR" }
	emptyNoColor := func(k string) (string, bool) { return "", k == "NO_COLOR" }
	f, err := os.CreateTemp(t.TempDir(), "log")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if colour(&bytes.Buffer{}, none) {
		t.Error("colour for a buffer")
	}
	if colour(f, none) {
		t.Error("colour for a regular file")
	}
	// A terminal: NO_COLOR set to anything turns colour off, set to the
	// empty string does not (no-color.org). CI has no controlling terminal,
	// so the test makes a pseudo-terminal and writes to its follower side.
	tty := openPTY(t)
	if !colour(tty, none) || !colour(tty, emptyNoColor) {
		t.Error("no colour on a terminal")
	}
	if colour(tty, noColor) {
		t.Error("colour on a terminal with NO_COLOR=1")
	}
}

// A command accepts flags it does not read, keeps their values working and
// says in --help which ones they are.
func TestIgnoredFlagsAreAcceptedAndMarked(t *testing.T) {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.String("database-url", "", "PostgreSQL URL")
	natsURL := fs.String("nats-url", "nats://127.0.0.1:4222", "NATS URL")
	verbose := fs.Bool("verbose", false, "more")
	Ignore(fs, "nats-url", "verbose")
	Ignore(fs, "nats-url") // twice is once
	lookup := func(k string) (string, bool) { return "nats://env:4222", k == "OUTBOX_RELAY_NATS_URL" }
	if err := Parse(fs, []string{"--verbose"}, lookup); err != nil {
		t.Fatal(err)
	}
	if *natsURL != "nats://env:4222" || !*verbose {
		t.Errorf("nats-url %q, verbose %v: an ignored flag still takes its value", *natsURL, *verbose)
	}
	var help bytes.Buffer
	Usage(fs, &help, "usage: x", Groups{})()
	for _, line := range strings.Split(help.String(), "\n") {
		if !strings.HasPrefix(line, "  --") {
			continue
		}
		name := strings.Fields(line)[0]
		marked := strings.Contains(line, "(ignored by migrate)")
		if want := name == "--nats-url" || name == "--verbose"; marked != want {
			t.Errorf("help line %q: marked %v, want %v", line, marked, want)
		}
	}
	if !strings.Contains(help.String(), "one set of\nflags or one environment file serves every command") {
		t.Errorf("help does not say why ignored flags are accepted:\n%s", help.String())
	}
}

// openPTY opens a new pseudo-terminal and returns its follower (the side a
// program sees as its terminal). Linux only; elsewhere the test skips.
func openPTY(t *testing.T) *os.File {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skipf("no pseudo-terminal helper for %s", runtime.GOOS)
	}
	leader, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("open /dev/ptmx: %v", err)
	}
	t.Cleanup(func() { leader.Close() })
	if err := unix.IoctlSetPointerInt(int(leader.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatalf("unlock pseudo-terminal: %v", err)
	}
	n, err := unix.IoctlGetInt(int(leader.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatalf("pseudo-terminal number: %v", err)
	}
	follower, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("open pseudo-terminal follower: %v", err)
	}
	t.Cleanup(func() { follower.Close() })
	return follower
}
