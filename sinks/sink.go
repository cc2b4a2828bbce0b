// Package sinks defines what the relay needs from a message broker: publish a
// message asynchronously under a stable ID and learn, per message, whether the
// broker stored it. It knows nothing of PostgreSQL; implementations live in
// subpackages (sinks/jetstream).
package sinks

import (
	"context"
	"errors"
	"fmt"
)

// Message is one outbox row as the broker will store it.
type Message struct {
	ID      string // the row's work_id; brokers dedupe on it (Nats-Msg-Id)
	Subject string
	Data    []byte
	Header  map[string][]string

	// Checked says the subject and every header were checked as a broker
	// takes them, and HeaderBytes is then the header block's size with the
	// ID (wire.BuildMessage sets both), so a sink need not walk the
	// headers again for each message.
	Checked     bool
	HeaderBytes int
}

// Size is what the message counts against in-flight byte limits.
func (m *Message) Size() int {
	n := len(m.ID) + len(m.Subject) + len(m.Data)
	if m.Checked {
		return n + m.HeaderBytes
	}
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// Ack is the broker's acceptance of one message.
type Ack struct {
	Stream    string
	Sequence  uint64
	Duplicate bool // the broker already held a message with this ID (still a success)
}

// Future resolves once the broker answered for one message, or gave up.
type Future interface {
	// Wait blocks until the broker answered or the publish timed out. Every
	// future must be waited for: a batch that completed can still hold
	// failures, and a reconnect fails pending futures whose messages may
	// have been stored.
	Wait(ctx context.Context) (Ack, error)
}

// Ready is what a Future may also implement: Ready reports, without
// blocking, that Wait would return at once. A caller collecting many
// futures uses it to take every answer already in with one wake-up.
type Ready interface {
	Ready() bool
}

// Sink publishes messages to a broker.
type Sink interface {
	// Publish starts publishing m. It may block while the client's own buffers
	// are full. An error returned here, or from the Future, is either a
	// *RejectedError (the broker will never take this message) or an outage
	// (retry later; the message may or may not have been stored).
	Publish(ctx context.Context, m *Message) (Future, error)
}

// RejectedError says the broker definitively refused a message: a known
// non-effect that retrying unchanged will not fix (payload too large, no
// stream bound to the subject, an invalid subject).
type RejectedError struct {
	Reason string // short, stable, for metrics: "max_payload", "no_stream", "invalid_subject", ...
	Err    error
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("rejected (%s): %v", e.Reason, e.Err)
}

func (e *RejectedError) Unwrap() error { return e.Err }

// ErrAckTimeout marks a publish whose ack did not come in time: the broker
// may or may not have stored it (an uncertain outcome, not a rejection).
var ErrAckTimeout = errors.New("no ack in time")

// IsRejected reports whether err is a definitive rejection and returns it.
func IsRejected(err error) (*RejectedError, bool) {
	var re *RejectedError
	ok := errors.As(err, &re)
	return re, ok
}
