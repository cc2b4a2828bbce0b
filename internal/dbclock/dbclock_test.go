package dbclock

import (
	"context"
	"errors"
	"testing"
	"time"
)

// The measurement keeps the probe with the shortest round trip: a slow
// answer says less about when the database read its clock.
func TestMeasureKeepsTheShortestRoundTrip(t *testing.T) {
	var c Clock
	if got := c.Now().Sub(time.Now()).Abs(); got > 50*time.Millisecond {
		t.Fatalf("unmeasured clock is %s off this process's", got)
	}
	delays := []time.Duration{40 * time.Millisecond, 2 * time.Millisecond, 30 * time.Millisecond}
	i := 0
	ahead := 60 * time.Second
	err := c.Measure(context.Background(), func(context.Context) (time.Time, error) {
		d := delays[i]
		i++
		time.Sleep(d / 2)
		at := time.Now().Add(ahead)
		time.Sleep(d / 2)
		return at, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	off, unc, ok := c.Offset()
	if !ok || (off-ahead).Abs() > 5*time.Millisecond || unc > 10*time.Millisecond {
		t.Fatalf("offset %s ± %s (measured %v), want 60s within a few ms from the 2 ms probe", off, unc, ok)
	}
	if d := c.Now().Sub(time.Now().Add(ahead)).Abs(); d > 10*time.Millisecond {
		t.Fatalf("Now is %s off the database's time", d)
	}
	if err := c.Measure(context.Background(), func(context.Context) (time.Time, error) { return time.Time{}, errors.New("down") }); err == nil {
		t.Fatal("a failed probe measured")
	}
	if off2, _, _ := c.Offset(); off2 != off {
		t.Fatalf("a failed measurement changed the offset: %s -> %s", off, off2)
	}
}
