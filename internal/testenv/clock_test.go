package testenv

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestPostgresClockOffset starts a server ahead of and one behind the
// host's clock and reads its wall clock, before and after a restart.
func TestPostgresClockOffset(t *testing.T) {
	for _, tc := range []struct {
		name   string
		offset time.Duration
	}{{"ahead", 60 * time.Second}, {"behind", -60 * time.Second}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pg, err := StartPostgres(PostgresOptions{ClockOffset: tc.offset})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pg.Close)
			assertSkew(t, pg, tc.offset, "after start")
			if err := pg.Restart("fast"); err != nil {
				t.Fatal(err)
			}
			assertSkew(t, pg, tc.offset, "after a restart")
		})
	}
	t.Run("fractional", func(t *testing.T) {
		pg, err := StartPostgres(PostgresOptions{ClockOffset: 1500 * time.Millisecond})
		if err == nil {
			pg.Close()
			t.Fatal("StartPostgres with a clock offset of 1.5s succeeded")
		}
		if !strings.Contains(err.Error(), "whole seconds") {
			t.Errorf("error does not say what is wrong: %v", err)
		}
	})
}

// assertSkew compares the server's clock with the midpoint of the query's
// round trip, so a slow query cannot pass for skew.
func assertSkew(t *testing.T, pg *Postgres, want time.Duration, when string) {
	t.Helper()
	conn := connect(t, pg.URL("postgres"))
	defer conn.Close(context.Background())
	before := time.Now()
	var epoch float64
	if err := conn.QueryRow(context.Background(), "SELECT extract(epoch FROM clock_timestamp())::float8").Scan(&epoch); err != nil {
		t.Fatalf("%s: read the server's clock: %v", when, err)
	}
	local := before.Add(time.Since(before) / 2)
	server := time.Unix(0, int64(epoch*float64(time.Second)))
	skew := server.Sub(local)
	t.Logf("%s: server clock %v from the host's (want %v)", when, skew.Round(time.Millisecond), want)
	if d := skew - want; d < -5*time.Second || d > 5*time.Second {
		t.Errorf("%s: server clock is %v from the host's, want %v ± 5s", when, skew, want)
	}
}
