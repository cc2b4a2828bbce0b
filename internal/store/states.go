package store

import "strings"

// The states of a row (DESIGN.md, States). This file is the one list: the
// SQL below renders its IN lists from it, the console and the status
// command count by it, and TestStatesMatchMigrationsAndDocs holds the
// migrations' CHECK constraint and the docs' states tables to it.
const (
	StateReady     = "ready"
	StateScheduled = "scheduled"
	StateRunning   = "running"
	StatePublished = "published"
	StateFailed    = "failed"
	StateCancelled = "cancelled"
	StateExpired   = "expired"
)

// States is every state, in the order of their walk (the order the
// migrations' CHECK, the docs and every listing by state use).
var States = []string{StateReady, StateScheduled, StateRunning, StatePublished, StateFailed, StateCancelled, StateExpired}

// BlockingStates are the states in which a row of an aggregate blocks the
// later rows of that aggregate (G12): unpublished and not given up on.
// 'ready' (the CDC path has it), 'scheduled', 'running', or 'failed' (a dead
// letter blocks until it is redriven or cancelled). 'published',
// 'cancelled' and 'expired' rows block nothing: a cancelled or expired one
// leaves a gap the receiver can see in Outbox-Sequence.
var BlockingStates = []string{StateReady, StateScheduled, StateRunning, StateFailed}

// WithPollerStates are the blocking states other than 'ready': the row is
// with the poller or dead-lettered, so the CDC path must not publish later
// rows of its aggregate itself (it holds the aggregate). A 'ready' row
// blocks too, but it is the CDC path's own, ordered by its chains.
var WithPollerStates = []string{StateScheduled, StateRunning, StateFailed}

// sqlList renders states as a parenthesised SQL list of quoted literals,
// ('a', 'b'), for an IN. The states are constants of this file, never input.
func sqlList(states []string) string {
	q := make([]string, len(states))
	for i, s := range states {
		q[i] = "'" + strings.ReplaceAll(s, "'", "''") + "'"
	}
	return "(" + strings.Join(q, ", ") + ")"
}

var (
	blockingStatesSQL   = sqlList(BlockingStates)
	withPollerStatesSQL = sqlList(WithPollerStates)
)
