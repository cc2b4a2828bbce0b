// Package sinks defines what the relay needs from a message broker: publish a
// message asynchronously under a stable ID and learn, per message, whether the
// broker stored it. It knows nothing of PostgreSQL; implementations live in
// subpackages (sinks/jetstream).
//
// # The relay's own
//
// The repository's layout puts this package and its subpackages at the top level
// (replication/, sinks/), so it can be imported; it is not a public API.
// Its exported names serve the relay's other packages and change with
// them in any release, and its signatures use internal packages
// (internal/wire), which nothing outside this module can name. The public
// packages are outbox and inbox (docs/layout.md).
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

// ErrUnrecognised marks a publish that failed in a way the sink knows
// neither as a refusal of the message nor as an outage (a timeout, a
// disconnect, a broker-wide error). A caller retries it as an outage, and
// counts such failures per message: after bounded tries it is that
// message's refusal, never an endless replay of the stream (G7).
var ErrUnrecognised = errors.New("an unrecognised publish failure")

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

// From is where a read of the stream starts (G18). A position, never a
// time, where one is known: the clocks of PostgreSQL, the relay and the
// broker need not agree for a read that starts at a stream sequence.
type From struct {
	// AfterSeq: the relay's own stream is read from the message after this
	// sequence (when BySeq).
	AfterSeq uint64
	BySeq    bool
	// Since is the fallback where no position is known: every stream
	// other than the own one, and the own one when not BySeq, is read from
	// the messages the broker stored at or after it, by the broker's clock
	// (zero: from the stream's first message).
	Since time.Time
}

// ReadResult is how far a read of the stream got.
type ReadResult struct {
	// Read is the messages read.
	Read int
	// Complete: the read reached End (or the broker said no message on
	// its subjects was left up to it). A read that stopped at its limit,
	// or because the callback asked it to, is not complete. A read whose
	// answers stopped coming before End is an error, never a short
	// complete read.
	Complete bool
	// After is the position the read covered from (the messages after
	// it): the From's AfterSeq, or for a read by time the sequence before
	// the first message it found (End when it found none).
	After uint64
	// End is the stream's last sequence when the read began: what it had
	// to reach.
	End uint64
}

// StoredReader is what a Sink may also implement: reading back what the
// broker stored, so that a relay starting again publishes only what is not
// there yet (G18), whatever the broker's duplicate window.
type StoredReader interface {
	// ReadStored calls each for every message on the relay's own
	// subjects from from to the stream's last message when the read
	// began, in stream order, reading at most limit messages.
	ReadStored(ctx context.Context, from From, limit int, each func(Stored) bool) (ReadResult, error)
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
	// stored from from on (AfterSeq on the own stream, Since on the
	// others), at most limit messages in all, and returns the wanted
	// messages it found by ID. complete is false when the read stopped at
	// limit before the streams' ends, or a subject is on no stream it may
	// read: a message not found then may still be stored (inconclusive).
	// A read the broker did not answer up to its end is an error.
	FindStored(ctx context.Context, want []Wanted, from From, limit int) (found map[string]Stored, complete bool, err error)
}

// StreamState is where the relay's own stream stands: its first and last
// sequence, and when it was created.
type StreamState struct {
	Stream            string
	FirstSeq, LastSeq uint64
	// Created is the stream's creation time, on the broker's clock.
	Created time.Time
	// BrokerOffset is the broker's clock less this process's, measured
	// with the request that read this state (the server's timestamp of
	// its answer against the request's midpoint), to within
	// OffsetUncertainty (half its round trip); OffsetKnown is false when
	// the broker gave no timestamp.
	BrokerOffset      time.Duration
	OffsetUncertainty time.Duration
	OffsetKnown       bool
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

// ReadChecker is what a Sink that reads the stream back may also
// implement: finding out at start whether its reads can work at all (a
// consumer it may create, room under the stream's consumer limit), so
// that a relay that could not check the stream is named at start, not
// after its first crash, when every read fails and delivery stalls.
type ReadChecker interface {
	CheckReads(ctx context.Context) error
}

// Positioner is what a Sink may also implement: a sequence of its own
// stream that every message published from now on is stored after, so
// that a lookup of those messages can start there instead of at a time
// (G18).
type Positioner interface {
	StreamPosition(ctx context.Context, maxAge time.Duration) (seq uint64, ok bool)
}
