// Package testenv runs real PostgreSQL and NATS JetStream servers as child
// processes of the test binary, so that tests exercise the same failure modes
// as production (crash recovery, lost connections, redelivery) instead of
// fakes that cannot be killed. The servers are devenv's; this package adds
// what only tests need and keeps package testing out of devenv, which the
// outbox-relay binary links for its demo.
//
// Every server gets its own temporary directory and free TCP port; the
// system-wide PostgreSQL (5432) and nats-server (4222) are never touched, so
// tests are hermetic and packages can run in parallel.
//
// A package normally shares one PostgreSQL and one NATS between its tests:
//
//	func TestMain(m *testing.M) { testenv.Main(m) }
//
//	func TestX(t *testing.T) {
//		env := testenv.Shared(t)
//		dbURL := env.PG.CreateDatabase(t)
//		stream, subjects := env.StreamName(t)
//		...
//	}
//
// NewFixture adds to that the outbox table migrated, a pool, a NATS
// connection and its JetStream context: what the delivery paths' tests
// start from.
//
// Tests that stop, kill or restart a server must start their own with
// StartPostgres or StartNATS, since doing it to the shared servers would break
// the tests running alongside.
//
// Binaries: PostgreSQL from PostgresOptions.Version or BinDir, else
// OUTBOX_RELAY_TEST_PG_BIN, else OUTBOX_RELAY_TEST_PG_VERSION (a major
// version: 15 is Debian's, 16 to 18 are what `make pg-versions` installs),
// else the highest /usr/lib/postgresql/*/bin; the shared server follows the
// variables, so `make test-pg-versions` runs whole packages on each version.
// nats-server from OUTBOX_RELAY_TEST_NATS_SERVER or
// the version pinned in go.mod via `go tool -n nats-server`, never from PATH,
// so that every run tests against the same server. Setting
// OUTBOX_RELAY_TEST_KEEP=1 keeps data directories and logs after Close.
package testenv

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"go.uber.org/goleak"
	"time"
)

// Env is one PostgreSQL and one NATS shared by the tests of a package.
type Env struct {
	PG   *Postgres
	NATS *NATS
}

var (
	sharedOnce sync.Once
	sharedEnv  *Env
	sharedErr  error
)

// Shared starts the package's shared servers on first use and returns them.
// A failure to start is fatal rather than a skip: a skipped test proves nothing
// and would hide a broken environment in CI.
func Shared(t testing.TB) *Env {
	t.Helper()
	sharedOnce.Do(func() { sharedEnv, sharedErr = startShared() })
	if sharedErr != nil {
		t.Fatalf("testenv: start shared servers: %v", sharedErr)
	}
	return sharedEnv
}

func startShared() (*Env, error) {
	// Started concurrently: together they are the fixed cost of every test run.
	var (
		wg      sync.WaitGroup
		pg      *Postgres
		nt      *NATS
		pgErr   error
		natsErr error
	)
	wg.Add(2)
	go func() { defer wg.Done(); pg, pgErr = StartPostgres(PostgresOptions{}) }()
	go func() { defer wg.Done(); nt, natsErr = StartNATS(NATSOptions{}) }()
	wg.Wait()
	if pgErr != nil || natsErr != nil {
		if pg != nil {
			pg.Close()
		}
		if nt != nil {
			nt.Close()
		}
		if pgErr != nil {
			return nil, pgErr
		}
		return nil, natsErr
	}
	return &Env{PG: pg, NATS: nt}, nil
}

// Main is called from TestMain. It exists so that the shared servers are shut
// down and their directories removed once all tests are done; on failure the
// directories are kept and their location printed, because the server logs
// are usually what explains a failed fault test.
func Main(m *testing.M) {
	code := m.Run()
	if sharedEnv != nil {
		keep := code != 0 || keepFiles()
		sharedEnv.PG.Shutdown(keep)
		sharedEnv.NATS.Shutdown(keep)
		if keep {
			fmt.Fprintf(os.Stderr, "testenv: kept postgres log %s and nats log %s\n",
				sharedEnv.PG.LogPath(), sharedEnv.NATS.LogPath())
		}
	}
	// Every test has stopped what it started: a goroutine still running
	// now is a relay loop, poller, connection or timer that outlives its
	// owner, which in the daemon means a leak per session.
	if code == 0 {
		if err := goleak.Find(LeakIgnores...); err != nil {
			fmt.Fprintf(os.Stderr, "testenv: goroutines left running after the tests: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// LeakIgnores are the goroutines that outlive tests by design: none of the
// relay's own.
var LeakIgnores = []goleak.Option{
	// The process-wide signal and log machinery of the runtime and zerolog.
	goleak.IgnoreTopFunction("os/signal.signal_recv"),
}

func keepFiles() bool {
	v := os.Getenv("OUTBOX_RELAY_TEST_KEEP")
	return v != "" && v != "0" && v != "false"
}

var streamSeq atomic.Int64

var natsUnsafe = regexp.MustCompile(`[^A-Za-z0-9_-]+`)

// StreamName returns a JetStream stream name and subject prefix that no other
// test uses, so tests sharing a server cannot see each other's messages. The
// stream is deleted when the test ends, because the shared server lives for
// the whole package run.
func (e *Env) StreamName(t testing.TB) (stream, subjectPrefix string) {
	t.Helper()
	n := streamSeq.Add(1)
	san := strings.Trim(natsUnsafe.ReplaceAllString(t.Name(), "_"), "_")
	if len(san) > 48 {
		san = san[:48]
	}
	if san == "" {
		san = "x"
	}
	stream = fmt.Sprintf("T_%s_%d", san, n)
	subjectPrefix = fmt.Sprintf("t%d.%s.", n, san)
	t.Cleanup(func() {
		if e.NATS != nil {
			deleteStream(t, e.NATS, stream)
		}
	})
	return stream, subjectPrefix
}

// WaitFor polls cond every 20ms until it returns true, failing the test with
// what and the last error after timeout. Tests wait for conditions rather than
// sleeping, so they are neither flaky on slow machines nor slow on fast ones.
// Like t.Fatal, it must be called from the test's goroutine.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			if err != nil {
				t.Fatalf("timed out after %v waiting for %s: last error: %v", timeout, what, err)
			}
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
