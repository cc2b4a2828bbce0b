// Package procs runs the relay's Go code on one thread while it has little
// to do, and on as many as GOMAXPROCS's default allows once it is busy.
//
// At a trickle of small transactions the relay's CPU goes to waking its
// goroutines, and with more than one P each wake-up also wakes an idle
// thread that spins looking for work before it sleeps again (futex,
// epoll_wait and nanosleep calls, measured: docs/benchmarks-cost.md). One P
// costs a fifth less CPU per message there and lowers the tail latency; a
// backlog drain on the same two-core host ran as fast on one P. A relay on
// a large host that drains a backlog of big rows can use more than a core,
// so the controller gives every P back as soon as one is busy.
package procs

import (
	"context"
	"os"
	"runtime"
	"syscall"
	"time"
)

// The controller's thresholds, in cores the process used over a sample.
const (
	// Interval is how often the process's CPU time is sampled.
	Interval = time.Second
	// DownBelow: below it for DownAfter samples in a row, one P.
	DownBelow = 0.35
	DownAfter = 3
	// UpAbove: above it in one sample on one P, every P again. Between
	// the two the setting stays as it is, so it does not flap.
	UpAbove = 0.75
)

// Controller decides, sample by sample, how many Ps the relay runs on.
type Controller struct {
	downBelow, upAbove float64
	downAfter          int

	full int // GOMAXPROCS's default when the controller started
	cur  int
	low  int // samples in a row below downBelow
}

// NewController starts at full, GOMAXPROCS's default.
func NewController(full int) *Controller {
	return &Controller{downBelow: DownBelow, upAbove: UpAbove, downAfter: DownAfter, full: full, cur: full}
}

// Step takes the cores the process used over the last sample and returns
// the number of Ps to run on from now.
func (c *Controller) Step(busy float64) int {
	if busy < c.downBelow {
		c.low++
	} else {
		c.low = 0
	}
	switch {
	case c.cur == 1 && busy > c.upAbove:
		c.cur = c.full
	case c.cur > 1 && c.low >= c.downAfter:
		c.cur = 1
	}
	return c.cur
}

// Enabled reports whether the controller may run: more than one P by
// default, and GOMAXPROCS not set by the operator (whose value stands).
func Enabled() bool {
	if _, set := os.LookupEnv("GOMAXPROCS"); set {
		return false
	}
	return runtime.GOMAXPROCS(0) > 1
}

// Run samples the process's CPU time every Interval until ctx ends and
// sets GOMAXPROCS as the Controller decides; changed is called after each
// change with the new setting. When ctx ends, GOMAXPROCS's default is
// back.
func Run(ctx context.Context, changed func(procs int)) {
	run(ctx, NewController(runtime.GOMAXPROCS(0)), changed)
}

func run(ctx context.Context, c *Controller, changed func(procs int)) {
	defer runtime.SetDefaultGOMAXPROCS()
	t := time.NewTicker(Interval)
	defer t.Stop()
	lastCPU, lastAt := cpuTime(), time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now, cpu := time.Now(), cpuTime()
		busy := float64(cpu-lastCPU) / float64(now.Sub(lastAt))
		lastCPU, lastAt = cpu, now
		before := c.cur
		n := c.Step(busy)
		if n == before {
			continue
		}
		if n == c.full {
			// The default again, with the runtime's own updates of it
			// (a container's CPU limit changing).
			runtime.SetDefaultGOMAXPROCS()
		} else {
			runtime.GOMAXPROCS(n)
		}
		changed(n)
	}
}

// cpuTime is the user and system CPU time of the whole process.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
