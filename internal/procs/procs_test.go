package procs

import (
	"context"
	"runtime"
	"testing"
	"time"
)

// The controller drops to one P only after DownAfter quiet samples in a
// row, comes back to every P on the first busy sample at one P, and holds
// its setting between the thresholds.
func TestControllerDecides(t *testing.T) {
	c := NewController(4)
	for i, s := range []struct {
		busy float64
		want int
	}{
		{0.1, 4}, {0.1, 4}, // quiet, not long enough
		{0.5, 4},                     // between: the count of quiet samples starts again
		{0.1, 4}, {0.2, 4}, {0.3, 1}, // three quiet samples: one P
		{0.5, 1}, {0.7, 1}, // between: stays on one P
		{0.9, 4},                     // busy on one P: every P
		{0.5, 4}, {0.1, 4}, {0.1, 4}, // not three quiet in a row yet
		{0.1, 1},
		{2.0, 4},
	} {
		if got := c.Step(s.busy); got != s.want {
			t.Fatalf("sample %d (%.2f cores): %d Ps, want %d", i, s.busy, got, s.want)
		}
	}
}

// One P by default: nothing to decide.
func TestControllerOnOneCPU(t *testing.T) {
	c := NewController(1)
	for _, busy := range []float64{0.1, 0.1, 0.1, 0.9, 3} {
		if got := c.Step(busy); got != 1 {
			t.Fatalf("%.1f cores: %d Ps, want 1", busy, got)
		}
	}
}

// The real thing, on this process: quiet, it goes down to one P within
// DownAfter samples; a goroutine burning CPU brings every P back; when
// Run ends, GOMAXPROCS's default is back. (The way up is asked for at a
// fifth of a core: on a loaded test machine the burning goroutine may get
// less than UpAbove.)
func TestRunFollowsTheProcessLoad(t *testing.T) {
	if !Enabled() {
		t.Skip("GOMAXPROCS is set, or one CPU: the controller does not run")
	}
	full := runtime.GOMAXPROCS(0)
	ctx, cancel := context.WithCancel(context.Background())
	changes := make(chan int, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c := NewController(full)
		c.upAbove = 0.2
		run(ctx, c, func(n int) { changes <- n })
	}()
	wait := func(want int, within time.Duration) {
		t.Helper()
		timeout := time.After(within)
		for {
			select {
			case n := <-changes:
				if n == want {
					if got := runtime.GOMAXPROCS(0); got != want {
						t.Fatalf("told %d Ps, GOMAXPROCS is %d", want, got)
					}
					return
				}
			case <-timeout:
				t.Fatalf("GOMAXPROCS %d after %v, want %d", runtime.GOMAXPROCS(0), within, want)
			}
		}
	}
	wait(1, (DownAfter+3)*Interval)
	stop := make(chan struct{})
	go func() { // a core's worth of work
		for {
			select {
			case <-stop:
				return
			default:
			}
			for i := 0; i < 1e5; i++ {
				_ = i * i
			}
		}
	}()
	wait(full, 10*Interval)
	close(stop)
	cancel()
	<-done
	if got := runtime.GOMAXPROCS(0); got != full {
		t.Fatalf("after Run: GOMAXPROCS %d, want the default %d", got, full)
	}
}
