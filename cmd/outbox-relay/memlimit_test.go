package main

import (
	"runtime/debug"
	"testing"
)

// The relay's soft memory limit follows --max-buffered-bytes (G15), and
// GOMEMLIMIT, when set, wins.
func TestMemoryLimitFollowsTheBudget(t *testing.T) {
	old := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(old) })

	tuneMemoryLimit(32 << 20)
	if got, want := debug.SetMemoryLimit(-1), int64(memoryLimitBase+64<<20); got != want {
		t.Fatalf("memory limit %d with --max-buffered-bytes 32 MiB, want %d", got, want)
	}
	debug.SetMemoryLimit(old)
	t.Setenv("GOMEMLIMIT", "1GiB")
	tuneMemoryLimit(32 << 20)
	if got := debug.SetMemoryLimit(-1); got != old {
		t.Fatalf("memory limit %d with GOMEMLIMIT set, want it left at %d", got, old)
	}
}
