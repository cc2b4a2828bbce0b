// Package jetstream is the NATS JetStream sink: asynchronous publishes with
// Nats-Msg-Id set to the work ID, so JetStream stores a repeat inside its
// duplicate window once, and a classification of every failure into
// "rejected" (the broker will never take this message) or "outage" (retry).
//
// Like package sinks, it is the relay's own, not a public API: see there.
package jetstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// API is the part of JetStream the sink uses: the connection it publishes
// on, and the stream lookups that tell which streams bind a subject and
// "no stream binds this subject" from "JetStream is restarting". A
// jetstream.JetStream is one.
type API interface {
	Conn() *nats.Conn
	StreamNameBySubject(ctx context.Context, subject string) (string, error)
	Stream(ctx context.Context, name string) (jetstream.Stream, error)
}

// Sink publishes to JetStream.
type Sink struct {
	js      API
	binding *binding
	pub     *publisher
	window  atomic.Int64 // the own stream's duplicate window as last observed, in nanoseconds
	// known is a sequence of the own stream every message published from
	// now on is stored after: the highest acknowledged to this sink, or
	// read as the stream's last; knownAt is when it was last raised or
	// read (unix nanoseconds).
	known, knownAt atomic.Int64
}

var _ sinks.Sink = (*Sink)(nil)

// New returns a sink that publishes on js's connection, only into the
// streams o allows. A publish waits o.AckTimeout for its ack, or
// DefaultAckTimeout when that is zero: never forever, or a future could
// wait forever across a broker loss.
func New(js API, o Options) *Sink {
	timeout := o.AckTimeout
	if timeout <= 0 {
		timeout = DefaultAckTimeout
	}
	return &Sink{js: js, binding: newBinding(o), pub: newPublisher(js.Conn(), timeout, replyBuffer(o.Pending))}
}

// Publish implements sinks.Sink.
func (s *Sink) Publish(ctx context.Context, m *wire.Message) (sinks.Future, error) {
	f, err := s.prepare(ctx, m)
	if err != nil {
		return nil, err
	}
	if _, err := s.pub.publish(f); err != nil {
		return nil, classify(ctx, s.js, m.Subject, fmt.Errorf("publish %s to %s: %w", m.ID, m.Subject, err))
	}
	return f, nil
}

// prepare checks m, resolves its stream and sets the headers every publish
// of it carries.
func (s *Sink) prepare(ctx context.Context, m *wire.Message) (*future, error) {
	if !m.Checked {
		if err := checkMessage(m); err != nil {
			return nil, err
		}
	}
	stream, err := s.binding.check(ctx, s.js, m.Subject)
	if err != nil {
		return nil, err
	}
	f := &future{sink: s, msg: m, hdr: nats.Header(m.Header), stream: stream}
	if f.hdr == nil {
		f.hdr = nats.Header{}
	}
	// The broker refuses the message if its subject leads to any other
	// stream (error 10060): stream subjects can move between the check
	// above and the publish, and a message stored in another stream would
	// be a write where this relay may not write.
	f.hdr[wire.HeaderExpectedStream] = s.binding.expect[stream]
	// The time left is worked out now, at each attempt, on the database's
	// clock: a retry an hour later carries an hour less.
	if ttl, ok := s.ttl(m, stream); ok {
		f.hdr[wire.HeaderTTL] = []string{ttl}
	} else {
		delete(f.hdr, wire.HeaderTTL)
	}
	// The message's ID goes into its header map, as nats.go's WithMsgID
	// would put it (a republished message has it already).
	if vs := f.hdr[jetstream.MsgIDHeader]; len(vs) != 1 || vs[0] != m.ID {
		f.id[0] = m.ID
		f.hdr[jetstream.MsgIDHeader] = f.id[:]
	}
	return f, nil
}

// Wait implements sinks.Future.
func (f *future) Wait(ctx context.Context) (sinks.Ack, error) {
	if ch := f.done(); ch != nil {
		// Waiting, it takes the answers as they come (pump): its own
		// among them, or the sweep's timeout or a disconnect on ch.
		replies := f.sink.pub.replies
	wait:
		for {
			select {
			case <-ch:
				break wait
			case m := <-replies:
				f.sink.pub.handle(m)
			case <-ctx.Done():
				return sinks.Ack{}, ctx.Err()
			}
		}
	}
	if f.err == nil {
		if f.ack.Stream != f.stream {
			// Stored, but not where this relay may write: the header above
			// makes JetStream refuse that, so an answer from elsewhere (a
			// server that ignores the header, a responder that is no
			// stream) is evidence, never an acceptance.
			f.sink.binding.misrouted(f.msg.Subject, f.stream)
			return sinks.Ack{}, &wire.RejectedError{Reason: ReasonWrongStream, Err: fmt.Errorf(
				"%s on %s was acknowledged by stream %s at sequence %d, not by %s, the stream the relay published it to: %s",
				f.msg.ID, f.msg.Subject, f.ack.Stream, f.ack.Sequence, f.stream, f.sink.binding.wrongStreamFix(f.ack.Stream))}
		}
		if !f.ack.Duplicate && f.ack.Stream == f.sink.binding.opts.Stream {
			f.sink.raiseKnown(f.ack.Sequence)
		}
		return f.ack, nil
	}
	if errors.Is(f.err, jetstream.ErrAsyncPublishTimeout) {
		return sinks.Ack{}, fmt.Errorf("ack for %s on %s: %w: %w", f.msg.ID, f.msg.Subject, sinks.ErrAckTimeout, f.err)
	}
	if errors.Is(f.err, sinks.ErrBatchRefused) {
		return sinks.Ack{}, fmt.Errorf("ack for %s on %s: %w", f.msg.ID, f.msg.Subject, f.err)
	}
	var apiErr *jetstream.APIError
	if errors.As(f.err, &apiErr) && apiErr.ErrorCode == errCodeMsgTTLDisabled {
		// Not stored. The stream was read as allowing TTL and is one that
		// does not (re-created since): an outage for this attempt, and the
		// next goes without the header.
		f.sink.binding.noTTL(f.stream)
		return sinks.Ack{}, fmt.Errorf("ack for %s on %s: stream %s refused its Nats-TTL (per-message TTL is not allowed there): the next attempt publishes it without: %w",
			f.msg.ID, f.msg.Subject, f.stream, f.err)
	}
	if errors.As(f.err, &apiErr) && apiErr.ErrorCode == errCodeStreamNotMatch {
		// Known non-effect: the stream that binds the subject now refused
		// it because it is not the one expected.
		f.sink.binding.misrouted(f.msg.Subject, f.stream)
		actual := "another stream"
		if f.ack.Stream != "" {
			actual = "stream " + f.ack.Stream
		}
		return sinks.Ack{}, &wire.RejectedError{Reason: ReasonWrongStream, Err: fmt.Errorf(
			"subject %q of %s is bound to %s now, not to %s as the relay's view of the streams said (their subjects changed): the broker refused the message and stored nothing; %s: %w",
			f.msg.Subject, f.msg.ID, actual, f.stream, f.sink.binding.wrongStreamFix(f.ack.Stream), f.err)}
	}
	return sinks.Ack{}, classify(ctx, f.sink.js, f.msg.Subject, fmt.Errorf("ack for %s on %s: %w", f.msg.ID, f.msg.Subject, f.err))
}

// checkMessage refuses what the broker or the client would mangle: a
// message built by wire.BuildMessage was checked there already.
func checkMessage(m *wire.Message) error {
	if err := ValidateSubject(m.Subject); err != nil {
		reason := wire.ReasonInvalidSubject
		if errors.Is(err, wire.ErrReservedSubject) {
			reason = wire.ReasonReservedSubject
		}
		return &wire.RejectedError{Reason: reason, Err: err}
	}
	if n := wire.HeaderBlockSize(m.ID, m.Header); n > wire.MaxHeaderBytes {
		return &wire.RejectedError{Reason: wire.ReasonHeaderTooLarge, Err: fmt.Errorf(
			"message %.40q: header block of %d bytes, over JetStream's %d-byte limit", m.ID, n, wire.MaxHeaderBytes)}
	}
	return nil
}

// classify turns err into a *wire.RejectedError when the broker refused the
// message for good, and leaves it alone (an outage: retry) otherwise.
// Storage failures, timeouts, disconnects and the broker's errors about its
// stream or account (a 5xx, a full account, a sealed stream) are outages:
// treating them as poison would turn a broker restart into a write per row.
// Any other 4xx answer is a refusal of the message (its request is wrong,
// and will be wrong again: an endless replay otherwise, as a Nats-TTL the
// server could not parse was). What is neither is wrapped in
// sinks.ErrUnrecognised, for the caller to count against the row (G7: a
// refusal after bounded tries).
func classify(ctx context.Context, js API, subject string, err error) error {
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		return &wire.RejectedError{Reason: ReasonMaxPayload, Err: err}
	case errors.Is(err, nats.ErrBadSubject):
		return &wire.RejectedError{Reason: wire.ReasonInvalidSubject, Err: err}
	case errors.Is(err, nats.ErrBadHeaderMsg):
		return &wire.RejectedError{Reason: wire.ReasonInvalidHeader, Err: err}
	case errors.Is(err, nats.ErrReconnectBufExceeded):
		// The relay's connection buffers nothing while it is down
		// (ReconnectBufSize(-1)), so nats.go answers every publish with
		// "outbound buffer limit exceeded": say what that means here.
		return fmt.Errorf("the broker is unreachable (the NATS connection is down and reconnecting; nothing was sent, and the row stays to be published once it is back, nothing is lost): "+
			"check that nats-server is running and reachable at the relay's --nats-url: %w", err)
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case jetstream.JSErrCodeStreamMessageExceedsMaximum:
			return &wire.RejectedError{Reason: ReasonMaxMsgSize, Err: err}
		case errCodeHeaderExceedsMaximum:
			return &wire.RejectedError{Reason: wire.ReasonHeaderTooLarge, Err: err}
		}
		if apiErr.Code >= 400 && apiErr.Code < 500 && !streamWide(apiErr.ErrorCode) {
			return &wire.RejectedError{Reason: wire.ReasonRefused, Err: fmt.Errorf("the broker refused the message (error %d, code %d: %s): %w", apiErr.ErrorCode, apiErr.Code, apiErr.Description, err)}
		}
		return err
	}
	if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
		// No responders also happens while JetStream restarts; only a lookup
		// that answers "no stream" makes it a rejection.
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if _, lerr := js.StreamNameBySubject(lctx, subject); errors.Is(lerr, jetstream.ErrStreamNotFound) {
			return &wire.RejectedError{Reason: ReasonNoStream, Err: fmt.Errorf("no JetStream stream binds subject %q: %w", subject, err)}
		}
		return err
	}
	for _, outage := range []error{jetstream.ErrAsyncPublishTimeout, nats.ErrDisconnected, nats.ErrConnectionClosed, nats.ErrConnectionDraining,
		nats.ErrConnectionReconnecting, nats.ErrInvalidConnection, nats.ErrStaleConnection, nats.ErrMaxConnectionsExceeded,
		nats.ErrTimeout, context.DeadlineExceeded, context.Canceled, sinks.ErrAckTimeout, sinks.ErrBatchRefused} {
		if errors.Is(err, outage) {
			return err
		}
	}
	return fmt.Errorf("%w: %w", sinks.ErrUnrecognised, err)
}

// streamWide says whether a 4xx JetStream error is about the stream or the
// account (full, sealed, without limits, atomic batches turned off), not
// about the message: an outage
// that ends when an operator acts, never a refusal of every row.
func streamWide(code jetstream.ErrorCode) bool {
	switch code {
	case errCodeAccountResourcesExceeded, errCodeStreamSealed, errCodeNoLimits,
		// A batch's, not a message's (batchError): the stream's setting,
		// the server's limits, a batch that can be taken later, its form.
		errCodeAtomicDisabled, errCodeAtomicTooLarge, errCodeAtomicTooMany, errCodeDuplicateInProcess,
		errCodeAtomicMissingSeq, errCodeAtomicInvalidID, errCodeAtomicInvalidCommit, errCodeAtomicUnsupported:
		return true
	}
	return false
}

// JetStream's errors about the account or stream rather than the message.
const (
	errCodeAccountResourcesExceeded jetstream.ErrorCode = 10002
	errCodeStreamSealed             jetstream.ErrorCode = 10109
	errCodeNoLimits                 jetstream.ErrorCode = 10120
)

// ValidateSubject applies NATS's rules for a publish subject: dot-separated
// non-empty tokens, no whitespace, no wildcards.
func ValidateSubject(s string) error { return wire.ValidateSubject(s) }

// Defaults of the stream the relay creates and of its publishes.
const (
	// DefaultDuplicateWindow is the stream's duplicate window: repeats of
	// a work ID inside it are stored once.
	DefaultDuplicateWindow = 2 * time.Minute
	// DefaultAckTimeout bounds a publish's wait for its ack.
	DefaultAckTimeout = 10 * time.Second
)

// StreamConfig is what the relay creates when its stream is missing.
type StreamConfig struct {
	Name            string
	SubjectPrefix   string // the stream binds SubjectPrefix + ">"
	DuplicateWindow time.Duration
	Replicas        int
	NoCreate        bool // a missing stream is an error (--create-stream=false)
	// MsgTTL creates the stream with per-message TTL allowed (G21), which
	// can never be turned off on it again.
	MsgTTL bool
	// AtomicPublish creates the stream with atomic batch publish allowed
	// (G20, run --atomic-transactions).
	AtomicPublish bool
}

// errCodeHeaderExceedsMaximum is JetStream's "header size exceeds maximum
// allowed of 64k": the stream refuses this message's headers on every try.
const errCodeHeaderExceedsMaximum jetstream.ErrorCode = 10097

// errCodeStreamNotMatch is JetStream's "expected stream does not match":
// the publish's Nats-Expected-Stream names another stream than the one
// that binds its subject, and nothing was stored.
const errCodeStreamNotMatch jetstream.ErrorCode = 10060

// errCodeMsgTTLDisabled is JetStream's "per-message TTL is disabled": the
// message carried Nats-TTL to a stream without AllowMsgTTL.
const errCodeMsgTTLDisabled jetstream.ErrorCode = 10166

// MaxTTL is the longest Nats-TTL the relay sends. nats-server reads the
// header with time.ParseDuration (about 292 years at most: a longer one is
// refused, error 10165) and adds it to the message's timestamp in
// nanoseconds (past the year 2262 that overflows, and the message would
// expire at once). A message whose deadline is further ahead carries none:
// the stream's own limits keep it, and Outbox-Expires-At says the deadline.
const MaxTTL = 100 * 365 * 24 * time.Hour

// ttl is the Nats-TTL of m when it goes to stream now: false for a message
// without a deadline, to a stream that does not allow the header, or with
// a deadline more than MaxTTL ahead on the deadline clock.
func (s *Sink) ttl(m *wire.Message, stream string) (string, bool) {
	if m.ExpiresAt.IsZero() || !s.binding.allowsTTL(stream) {
		return "", false
	}
	now := s.now()
	if m.ExpiresAt.Sub(now) > MaxTTL {
		return "", false
	}
	return TTL(m.ExpiresAt, now), true
}

// now is the clock deadlines are measured on (Options.Clock).
func (s *Sink) now() time.Time {
	if c := s.binding.opts.Clock; c != nil {
		return c()
	}
	return time.Now()
}

// TTL is the Nats-TTL of a message whose deadline is expires, published at
// now: the time left in whole seconds, rounded up so the broker never
// removes it before the deadline, and at least the 1 s the server accepts
// (a row that close to its deadline is the poller's, G13, and the poller
// does not publish one past it).
func TTL(expires, now time.Time) string {
	left := expires.Sub(now)
	secs := int64(left / time.Second)
	if left%time.Second > 0 {
		secs++
	}
	return strconv.FormatInt(max(secs, 1), 10) + "s"
}

// Observe records what info says of its stream that publishes depend on
// (whether it allows per-message TTL). The relay calls it with the stream
// it read at each session's start.
func (s *Sink) Observe(info *jetstream.StreamInfo) {
	if info == nil {
		return
	}
	if info.Config.Name == s.binding.opts.Stream {
		s.window.Store(int64(info.Config.Duplicates))
		s.binding.setTTL(info.Config.Name, info.Config.AllowMsgTTL)
		return
	}
	s.binding.mu.Lock()
	s.binding.setTTL(info.Config.Name, info.Config.AllowMsgTTL)
	s.binding.mu.Unlock()
}

// DuplicateWindow is the own stream's duplicate window as last observed
// (Observe), or 0 before the stream was read.
func (s *Sink) DuplicateWindow() time.Duration { return time.Duration(s.window.Load()) }

// errCodeSubjectOverlap is JetStream's "subjects overlap with an existing
// stream" (the client library names no constant for it).
const errCodeSubjectOverlap jetstream.ErrorCode = 10065

// ErrStreamConfig marks a stream setup that no retry can fix: missing with
// creation off, bound to other subjects, or overlapping another stream.
var ErrStreamConfig = errors.New("stream configuration")

// EnsureStream creates the stream when it is missing and never changes an
// existing one: operators own it once it exists. Either way it checks that
// the stream is the one that binds the prefix's subjects, so rows are not
// all rejected as "no stream" later. It returns the stream's info so the
// caller can warn about a short duplicate window.
func EnsureStream(ctx context.Context, js jetstream.StreamManager, c StreamConfig) (*jetstream.StreamInfo, bool, error) {
	info, created, err := ensureStream(ctx, js, c)
	if err != nil {
		return nil, false, err
	}
	probe := c.SubjectPrefix + "outbox_relay_probe"
	bound, err := js.StreamNameBySubject(ctx, probe)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, false, fmt.Errorf("%w: stream %s does not bind %s> (its subjects: %s): add the subject to it, or set --stream and --subject-prefix to match",
			ErrStreamConfig, c.Name, c.SubjectPrefix, strings.Join(info.Config.Subjects, ", "))
	case err != nil:
		return nil, false, fmt.Errorf("look up the stream bound to %s: %w", probe, err)
	case bound != c.Name:
		return nil, false, fmt.Errorf("%w: subjects under %s go to stream %s, not %s: set --stream %s, or change the streams' subjects",
			ErrStreamConfig, c.SubjectPrefix, bound, c.Name, bound)
	}
	return info, created, nil
}

func ensureStream(ctx context.Context, js jetstream.StreamManager, c StreamConfig) (*jetstream.StreamInfo, bool, error) {
	st, err := js.Stream(ctx, c.Name)
	if err == nil {
		info, err := st.Info(ctx)
		if err != nil {
			return nil, false, fmt.Errorf("read stream %s: %w", c.Name, err)
		}
		return info, false, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, false, fmt.Errorf("look up stream %s: %w", c.Name, err)
	}
	if c.NoCreate {
		return nil, false, fmt.Errorf("%w: stream %s does not exist and --create-stream=false: create it (bound to %s>) or let the relay create it",
			ErrStreamConfig, c.Name, c.SubjectPrefix)
	}
	replicas := c.Replicas
	if replicas < 1 {
		replicas = 1
	}
	st, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name:               c.Name,
		Description:        "outbox-relay: transactional outbox messages",
		Subjects:           []string{c.SubjectPrefix + ">"},
		Storage:            jetstream.FileStorage,
		Duplicates:         c.DuplicateWindow,
		Replicas:           replicas,
		AllowMsgTTL:        c.MsgTTL,
		AllowAtomicPublish: c.AtomicPublish,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Another instance created it first.
		return ensureStream(ctx, js, c)
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeSubjectOverlap {
		return nil, false, fmt.Errorf("%w: create stream %s for %s>: another stream already binds some of these subjects (%v): use that stream (--stream) or another --subject-prefix",
			ErrStreamConfig, c.Name, c.SubjectPrefix, err)
	}
	if err != nil {
		return nil, false, fmt.Errorf("create stream %s for %s>: %w", c.Name, c.SubjectPrefix, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, true, fmt.Errorf("read stream %s: %w", c.Name, err)
	}
	return info, true, nil
}
