// Package retry is the one place for how long to wait before trying again:
// capped exponential backoff with jitter, and a sleep that ends with its
// context. The relay's sessions, the poller's rescheduled rows and the
// inbox's redeliveries all wait with it.
package retry

import (
	"context"
	"math/rand/v2"
	"time"
)

// Ceiling is the capped exponential bound for retry number attempt
// (1-based): minD doubled attempt-1 times, at most maxD. Zero when either
// bound is not positive.
func Ceiling(attempt int, minD, maxD time.Duration) time.Duration {
	if minD <= 0 || maxD <= 0 {
		return 0
	}
	ceil := minD
	for i := 1; i < attempt && ceil < maxD; i++ {
		ceil *= 2
		if ceil <= 0 { // overflow
			ceil = maxD
		}
	}
	return min(ceil, maxD)
}

// Full is "full jitter": uniform in [0, Ceiling]. Retries that failed
// together spread over the whole interval, which is what a fleet of rows
// rejected at once needs. rnd(n) returns a value in [0, n); nil uses
// math/rand.
func Full(attempt int, minD, maxD time.Duration, rnd func(int64) int64) time.Duration {
	ceil := Ceiling(attempt, minD, maxD)
	if ceil <= 0 {
		return 0
	}
	return clamp(time.Duration(random(rnd)(int64(ceil)+1)), 0, ceil)
}

// Equal is "equal jitter": uniform in [Ceiling/2, Ceiling]. It never
// retries at once, for one connection or one message whose retry should not
// come back before some time has passed.
func Equal(attempt int, minD, maxD time.Duration, rnd func(int64) int64) time.Duration {
	ceil := Ceiling(attempt, minD, maxD)
	if ceil <= 0 {
		return 0
	}
	half := ceil / 2
	return clamp(half+time.Duration(random(rnd)(int64(ceil-half)+1)), half, ceil)
}

// Sleep waits for d, or until ctx ends, and then returns ctx's error.
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func random(rnd func(int64) int64) func(int64) int64 {
	if rnd == nil {
		return rand.Int64N
	}
	return rnd
}

func clamp(d, lo, hi time.Duration) time.Duration { return max(lo, min(d, hi)) }
