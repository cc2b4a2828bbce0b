package retry_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/retry"
)

func TestCeiling(t *testing.T) {
	for _, c := range []struct {
		attempt  int
		min, max time.Duration
		want     time.Duration
	}{
		{0, time.Second, time.Minute, time.Second}, {1, time.Second, time.Minute, time.Second},
		{2, time.Second, time.Minute, 2 * time.Second}, {6, time.Second, time.Minute, 32 * time.Second},
		{7, time.Second, time.Minute, time.Minute}, {1 << 20, time.Second, time.Minute, time.Minute},
		{100, time.Duration(1 << 62), time.Duration(1<<63 - 1), time.Duration(1<<63 - 1)},
		{3, 0, time.Minute, 0}, {3, time.Second, 0, 0}, {1, time.Minute, time.Second, time.Second},
	} {
		if got := retry.Ceiling(c.attempt, c.min, c.max); got != c.want {
			t.Errorf("Ceiling(%d, %v, %v) = %v, want %v", c.attempt, c.min, c.max, got, c.want)
		}
	}
}

func TestJitterBounds(t *testing.T) {
	lowest := func(int64) int64 { return 0 }
	highest := func(n int64) int64 { return n - 1 }
	for attempt := 1; attempt < 40; attempt++ {
		ceil := retry.Ceiling(attempt, 10*time.Millisecond, time.Minute)
		if d := retry.Full(attempt, 10*time.Millisecond, time.Minute, lowest); d != 0 {
			t.Fatalf("Full lowest = %v, want 0", d)
		}
		if d := retry.Full(attempt, 10*time.Millisecond, time.Minute, highest); d != ceil {
			t.Fatalf("Full highest = %v, want %v", d, ceil)
		}
		if d := retry.Equal(attempt, 10*time.Millisecond, time.Minute, lowest); d != ceil/2 {
			t.Fatalf("Equal lowest = %v, want %v", d, ceil/2)
		}
		if d := retry.Equal(attempt, 10*time.Millisecond, time.Minute, highest); d != ceil {
			t.Fatalf("Equal highest = %v, want %v", d, ceil)
		}
		for range 100 {
			if d := retry.Full(attempt, 10*time.Millisecond, time.Minute, rand.Int64N); d < 0 || d > ceil {
				t.Fatalf("Full = %v, want within [0, %v]", d, ceil)
			}
			if d := retry.Equal(attempt, 10*time.Millisecond, time.Minute, nil); d < ceil/2 || d > ceil {
				t.Fatalf("Equal = %v, want within [%v, %v]", d, ceil/2, ceil)
			}
		}
	}
}

func TestSleepEndsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if err := retry.Sleep(ctx, time.Hour); !errors.Is(err, context.Canceled) || time.Since(start) > time.Second {
		t.Fatalf("Sleep on a cancelled context = %v after %v", err, time.Since(start))
	}
	if err := retry.Sleep(context.Background(), time.Millisecond); err != nil {
		t.Fatal(err)
	}
}

// Full jitter stays within [0, min(max, min*2^(attempt-1))] whatever the
// random source returns, and reaches the ceiling at the top of its range.
func TestFullJitterBounds(t *testing.T) {
	minD, maxD := 100*time.Millisecond, 30*time.Second
	sources := map[string]func(int64) int64{
		"lowest":  func(int64) int64 { return 0 },
		"highest": func(n int64) int64 { return n - 1 },
		"seeded":  rand.New(rand.NewPCG(1, 2)).Int64N,
	}
	for name, rnd := range sources {
		for attempt := -1; attempt <= 80; attempt++ {
			ceil := maxD
			if a := max(attempt, 1); a < 20 {
				ceil = min(maxD, minD*time.Duration(1<<(a-1)))
			}
			d := retry.Full(attempt, minD, maxD, rnd)
			if d < 0 || d > ceil || d > maxD {
				t.Fatalf("%s: Full(%d) = %v, want within [0, %v]", name, attempt, d, ceil)
			}
			if name == "highest" && d != ceil {
				t.Fatalf("highest: Full(%d) = %v, want the ceiling %v", attempt, d, ceil)
			}
			if name == "lowest" && d != 0 {
				t.Fatalf("lowest: Full(%d) = %v, want 0", attempt, d)
			}
		}
	}
	if d := retry.Full(1, 0, 0, rand.Int64N); d != 0 {
		t.Fatalf("zero bounds: %v", d)
	}
}
