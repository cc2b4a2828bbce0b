package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// ErrStale says an operation carries a lower claim generation than one
// already accepted for its resource. It wraps ErrRejected, so a handler that
// returns it gets its message terminated, not redelivered.
var ErrStale = fmt.Errorf("%w: stale claim generation", ErrRejected)

// ClaimGeneration reads the Outbox-Claim-Generation header. Messages
// published by the relay's poller carry it (the row's claim generation at
// publish time, 1 or more); messages from the CDC path carry none, and that
// reads as 0: they were published before any claim existed.
func ClaimGeneration(msg jetstream.Msg) (int64, error) {
	v := msg.Headers().Get(wire.HeaderClaimGeneration)
	if v == "" {
		return 0, nil
	}
	g, err := strconv.ParseInt(v, 10, 64)
	if err != nil || g < 0 {
		return 0, fmt.Errorf("%w: %s header %q is not a non-negative integer", ErrRejected, wire.HeaderClaimGeneration, v)
	}
	return g, nil
}

// Fence accepts generation for resource only if no higher generation was
// accepted before, recording it in the fences table with tx, so the check and
// the handler's operation commit or roll back together. It returns an error
// wrapping ErrStale when generation is lower than the highest accepted. An
// equal generation is accepted: a fence orders authorities, it does not
// deduplicate (the inbox does).
//
// Limits. Claim generations count the claims of one outbox row, so they
// order only the attempts of that one row: use a resource that belongs to
// that row's work alone (its work_id, or a resource no other row's work
// touches). Unrelated rows have unrelated generations and must not share a
// fence. Only the relay's poller path sets the header; CDC-path messages read
// as generation 0, accepted until a poller-path message of the same resource
// raised the fence. And a fence learns of a higher generation only when that
// message arrives: a stale message that arrives first is accepted.
func (in *Inbox) Fence(ctx context.Context, tx pgx.Tx, resource string, generation int64) error {
	var got int64
	err := tx.QueryRow(ctx, in.fenceSQL, resource, generation).Scan(&got)
	if err == nil {
		return nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("inbox: fence %q at generation %d: %w", resource, generation, err)
	}
	var highest int64
	if err := tx.QueryRow(ctx, in.fenceReadSQL, resource).Scan(&highest); err != nil {
		return fmt.Errorf("inbox: fence %q: read highest generation: %w", resource, err)
	}
	return fmt.Errorf("%w: resource %q: generation %d is lower than %d, already accepted", ErrStale, resource, generation, highest)
}

// FenceMsg is Fence with msg's claim generation (see ClaimGeneration).
func (in *Inbox) FenceMsg(ctx context.Context, tx pgx.Tx, resource string, msg jetstream.Msg) error {
	g, err := ClaimGeneration(msg)
	if err != nil {
		return err
	}
	return in.Fence(ctx, tx, resource, g)
}
