// Package sinks defines what the relay needs from a message broker: publish a
// message asynchronously under a stable ID and learn, per message, whether the
// broker stored it. It knows nothing of PostgreSQL; implementations live in
// subpackages (sinks/jetstream).
package sinks

import (
	"context"
	"errors"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

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

// Sink publishes messages to a broker.
type Sink interface {
	// Publish starts publishing m. It may block while the client's own buffers
	// are full. An error returned here, or from the Future, is either a
	// *wire.RejectedError (the broker will never take this message) or an
	// outage (retry later; the message may or may not have been stored).
	Publish(ctx context.Context, m *wire.Message) (Future, error)
}

// ErrAckTimeout marks a publish whose ack did not come in time: the broker
// may or may not have stored it (an uncertain outcome, not a rejection).
var ErrAckTimeout = errors.New("no ack in time")

// Stored is a message the broker already holds: its ID (the row's work
// ID), where it is, and its headers.
type Stored struct {
	ID     string
	Stream string
	Seq    uint64
	Header map[string][]string
}

// StoredReader is what a Sink may also implement: reading back what the
// broker stored, so that a relay starting again publishes only what is not
// there yet (G18), whatever the broker's duplicate window.
type StoredReader interface {
	// StoredSince calls each for every message on the relay's own
	// subjects stored at or after since, in stream order, reading at most
	// limit messages. complete is false when it stopped at the limit (or
	// each returned false) before the stream's end.
	StoredSince(ctx context.Context, since time.Time, limit int, each func(Stored) bool) (read int, complete bool, err error)
}

// Resolved is a Future that has its answer already: a message found
// stored, never published again.
type Resolved Ack

// Wait implements Future.
func (r Resolved) Wait(context.Context) (Ack, error) { return Ack(r), nil }

// Batcher is what a Sink may also implement: publishing the messages of one
// transaction as an atomic batch, all of them stored or none (G20, run
// --atomic-transactions).
type Batcher interface {
	// PublishBatch starts publishing ms as one atomic batch per stream
	// they go to, in their order. It returns a future per message; where
	// errs[i] is set instead, message i is refused alone (a
	// *wire.RejectedError) and the batch goes without it. err is an
	// outage: nothing of the batch is committed, no future is to be
	// waited for.
	//
	// A batch the broker refused whole resolves every future with an
	// error wrapping ErrBatchRefused: nothing of it was stored, and each
	// message is to be published again alone (Republish), for the broker
	// to give each its own answer.
	PublishBatch(ctx context.Context, ms []*wire.Message) (futs []Future, errs []error, err error)
	// Republish publishes alone a message whose batch was refused whole,
	// like Publish.
	Republish(ctx context.Context, m *wire.Message) (Future, error)
}

// ErrBatchRefused marks a batch the broker refused whole (a message ID it
// already holds, a message it refuses, an incomplete batch): nothing of
// it was stored.
var ErrBatchRefused = errors.New("the broker refused the batch whole")

// Wanted is a message looked up by FindStored: its ID (the row's work ID)
// and the subject it was published to.
type Wanted struct {
	ID      string
	Subject string
}

// Finder is what a Sink may also implement: looking up whether the broker
// stored given messages, to settle rows whose last publish had an
// uncertain outcome (no ack came) instead of publishing them again past the
// broker's duplicate window (G18).
type Finder interface {
	// FindStored reads, on the wanted messages' subjects only, what was
	// stored at or after since, at most limit messages in all, and
	// returns the wanted messages it found by ID. complete is false when
	// the read stopped at limit before the streams' ends: a message not
	// found then may still be stored (inconclusive).
	FindStored(ctx context.Context, want []Wanted, since time.Time, limit int) (found map[string]Stored, complete bool, err error)
}

// StreamState is where the relay's own stream stands: its first and last
// sequence, and when it was created.
type StreamState struct {
	Stream            string
	FirstSeq, LastSeq uint64
	Created           time.Time
}

// StreamStater is what a Sink may also implement: reading its own
// stream's state, so the relay can tell acknowledged messages the broker
// lost (G19).
type StreamStater interface {
	OwnStreamState(ctx context.Context) (StreamState, error)
}

// Windowed is a sink that knows its own stream's duplicate window (0 before
// it read the stream).
type Windowed interface {
	DuplicateWindow() time.Duration
}
