package jetstream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Options says where the sink may publish. A row's subject is untrusted
// input: a core NATS publish goes wherever its subject leads, to the
// server's API ($JS.API.STREAM.DELETE...) or to a service that answers
// requests, and the reply would even be read as an ack. So the sink
// publishes only to subjects that one of these streams binds.
type Options struct {
	// Stream is the relay's own stream; it binds SubjectPrefix + ">" (the
	// relay checks that at start), so subjects under the prefix need no
	// lookup.
	Stream        string
	SubjectPrefix string
	// AllowStreams are further streams whose subjects a row's subject
	// column may name (run --allow-stream).
	AllowStreams []string
	// Refresh is how long a read of the allowed streams' subjects is used
	// before it is read again (DefaultBindingRefresh when zero). A subject
	// no allowed stream binds triggers a new read at most once a second.
	Refresh time.Duration
	// AckTimeout is how long a publish waits for the broker's ack before
	// it fails with sinks.ErrAckTimeout (see New for the default).
	AckTimeout time.Duration
	// DeadlineTTL: a message with a deadline carries Nats-TTL, the time
	// left until it, when its stream allows per-message TTL (G21).
	DeadlineTTL bool
	// Clock is the clock deadlines are measured on: the database's (G13),
	// as the relay measures it. nil: this process's.
	Clock func() time.Time
	// Pending is how many publishes the caller keeps waiting for at most
	// (the CDC path's --max-in-flight, the poller's batches in flight): the
	// channel the answers wait in holds twice as many (at least
	// minReplyBuffer), so none is dropped while its waiter is busy.
	Pending int
}

// DefaultBindingRefresh is how long the allowed streams' subject lists are
// trusted, and how long a refusal of a subject is remembered: an operator
// who adds a subject to a stream waits at most this.
const DefaultBindingRefresh = 30 * time.Second

// minReread spaces re-reads caused by unbound subjects, so a flood of rows
// with made-up subjects costs one stream read a second, not one per row.
const minReread = time.Second

// maxRefused bounds the remembered refusals: a flood of distinct made-up
// subjects costs a lookup each once the memory is full, never unbounded
// memory.
const maxRefused = 4096

// Reasons of rejections decided by the binding check, or by the broker
// finding the message's subject bound to another stream than the one the
// binding resolved, or refusing the message for its size. The broker's
// refusals of a malformed subject or header carry wire's reasons
// (wire.ReasonInvalidSubject, ...).
const (
	ReasonNoStream         = "no_stream"
	ReasonStreamNotAllowed = "stream_not_allowed"
	ReasonWrongStream      = "wrong_stream"
	ReasonMaxPayload       = "max_payload"  // larger than the server's max_payload
	ReasonMaxMsgSize       = "max_msg_size" // larger than the stream's max_msg_size
)

// Reasons is every reason above; wire.Reasons has the rest a publish can
// end with.
var Reasons = []string{ReasonNoStream, ReasonStreamNotAllowed, ReasonWrongStream, ReasonMaxPayload, ReasonMaxMsgSize}

// binding caches the allowed streams' subject filters, and the refusals of
// subjects no allowed stream binds. Every publish carries the stream it
// resolved in Nats-Expected-Stream, so a view that went stale (subjects
// moved to another stream since the last read) makes the broker refuse the
// message instead of storing it elsewhere; misrouted then makes the next
// check read the streams again.
type binding struct {
	opts    Options
	allowed []string            // stream names, own first
	expect  map[string][]string // per allowed stream, its Nats-Expected-Stream header value (shared, read-only)

	// prefixOwned: the relay's own stream binds every subject under the
	// prefix (checked at start, re-checked by every read), so those need
	// neither the lock nor the filters.
	prefixOwned atomic.Bool

	// ownTTL: the own stream allows per-message TTL (AllowMsgTTL), as
	// last read; ttl holds the same for the other allowed streams (b.mu).
	ownTTL atomic.Bool

	mu      sync.Mutex
	ttl     map[string]bool
	filters []streamFilter
	readAt  time.Time
	refused map[string]refusal
	// lookups counts the broker round trips check made (stream reads and
	// subject lookups), for tests.
	lookups atomic.Int64
}

type streamFilter struct {
	stream, filter string
}

// refusal is a remembered answer "no allowed stream binds this subject".
type refusal struct {
	err   error
	until time.Time
}

func newBinding(o Options) *binding {
	allowed := []string{}
	if o.Stream != "" {
		allowed = append(allowed, o.Stream)
	}
	for _, s := range o.AllowStreams {
		if s != "" && !slices.Contains(allowed, s) {
			allowed = append(allowed, s)
		}
	}
	if o.Refresh <= 0 {
		o.Refresh = DefaultBindingRefresh
	}
	b := &binding{opts: o, allowed: allowed, expect: make(map[string][]string, len(allowed)), refused: map[string]refusal{}, ttl: map[string]bool{}}
	for _, s := range allowed {
		b.expect[s] = []string{s}
	}
	b.prefixOwned.Store(o.SubjectPrefix != "" && o.Stream != "")
	return b
}

// check returns the allowed stream that binds subject, a
// *wire.RejectedError when none does, and another error when the streams
// could not be read (an outage: retry).
func (b *binding) check(ctx context.Context, js API, subject string) (string, error) {
	if b.prefixOwned.Load() && strings.HasPrefix(subject, b.opts.SubjectPrefix) {
		return b.opts.Stream, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if b.readAt.IsZero() || now.Sub(b.readAt) > b.opts.Refresh {
		if err := b.read(ctx, js, now); err != nil {
			return "", err
		}
	}
	if s := b.bound(subject); s != "" {
		return s, nil
	}
	// A subject refused a moment ago is refused again without asking the
	// broker: a burst of rows with one bad subject would otherwise cost a
	// round trip each, under this lock, on the CDC loop's goroutine.
	if r, ok := b.refused[subject]; ok && now.Before(r.until) {
		return "", r.err
	}
	if now.Sub(b.readAt) > minReread {
		if err := b.read(ctx, js, now); err != nil {
			return "", err
		}
		if s := b.bound(subject); s != "" {
			return s, nil
		}
	}
	// Refused. Name the stream that does bind it, if one does, so the
	// operator can tell a typo from a stream that was not allowed.
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b.lookups.Add(1)
	name, err := js.StreamNameBySubject(lctx, subject)
	var rerr error
	switch {
	case err == nil && name != "":
		rerr = &wire.RejectedError{Reason: ReasonStreamNotAllowed, Err: fmt.Errorf(
			"subject %q is bound to stream %s, which this relay does not publish to (it publishes to %s): fix the row's subject, or allow the stream with --allow-stream %s",
			subject, name, strings.Join(b.allowed, ", "), name)}
	case err == nil, errors.Is(err, jetstream.ErrStreamNotFound), errors.Is(err, jetstream.ErrInvalidSubject):
		rerr = &wire.RejectedError{Reason: ReasonNoStream, Err: fmt.Errorf(
			"no JetStream stream binds subject %q (this relay publishes to %s): fix the row's subject, or bind it to one of those streams",
			subject, strings.Join(b.allowed, ", "))}
	default:
		return "", fmt.Errorf("look up the stream bound to %q: %w", subject, err)
	}
	b.remember(subject, rerr, now)
	return "", rerr
}

// remember keeps a refusal for the refresh interval. b.mu is held.
func (b *binding) remember(subject string, err error, now time.Time) {
	if len(b.refused) >= maxRefused {
		for s, r := range b.refused {
			if !now.Before(r.until) {
				delete(b.refused, s)
			}
		}
		if len(b.refused) >= maxRefused {
			clear(b.refused)
		}
	}
	b.refused[subject] = refusal{err: err, until: now.Add(b.opts.Refresh)}
}

// misrouted records that the broker found subject bound to another stream
// than expected, the one check resolved: the view of the streams is stale.
// The next check reads them again, and a subject under the prefix no longer
// takes the fast path unless that read finds the own stream binding the
// whole prefix again.
func (b *binding) misrouted(subject, expected string) {
	if expected == b.opts.Stream && strings.HasPrefix(subject, b.opts.SubjectPrefix) {
		b.prefixOwned.Store(false)
	}
	b.mu.Lock()
	b.readAt = time.Time{}
	b.mu.Unlock()
}

// wrongStreamFix says what happens next to a message that the broker found
// bound to stream actual ("" when unknown), and what an operator can do.
func (b *binding) wrongStreamFix(actual string) string {
	if actual != "" && slices.Contains(b.allowed, actual) {
		return "the next attempt publishes it into " + actual
	}
	name := actual
	if name == "" {
		name = "<stream>"
	}
	return fmt.Sprintf("this relay publishes only to %s: fix the row's subject, move the subject back to one of those streams, or allow the stream with --allow-stream %s",
		strings.Join(b.allowed, ", "), name)
}

func (b *binding) read(ctx context.Context, js API, now time.Time) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var filters []streamFilter
	owned := false
	for _, name := range b.allowed {
		b.lookups.Add(1)
		st, err := js.Stream(rctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue // an allowed stream that does not exist binds nothing
		}
		if err != nil {
			return fmt.Errorf("read the subjects of stream %s: %w", name, err)
		}
		b.setTTL(name, st.CachedInfo().Config.AllowMsgTTL)
		for _, f := range st.CachedInfo().Config.Subjects {
			filters = append(filters, streamFilter{stream: name, filter: f})
			if name == b.opts.Stream && b.opts.SubjectPrefix != "" && filterCovers(f, b.opts.SubjectPrefix+">") {
				owned = true
			}
		}
	}
	b.filters, b.readAt = filters, now
	b.prefixOwned.Store(owned)
	return nil
}

// setTTL records whether stream allows per-message TTL. b.mu is held, or
// the stream is the own one.
func (b *binding) setTTL(stream string, allowed bool) {
	if stream == b.opts.Stream {
		b.ownTTL.Store(allowed)
		return
	}
	b.ttl[stream] = allowed
}

// allowsTTL says whether a message to stream may carry Nats-TTL: asked
// for, and the stream allowed it when last read.
func (b *binding) allowsTTL(stream string) bool {
	if !b.opts.DeadlineTTL {
		return false
	}
	if stream == b.opts.Stream {
		return b.ownTTL.Load()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ttl[stream]
}

// noTTL records that stream refused a message for its Nats-TTL (the
// stream was re-created without AllowMsgTTL): the next attempt goes
// without it.
func (b *binding) noTTL(stream string) {
	if stream == b.opts.Stream {
		b.ownTTL.Store(false)
		return
	}
	b.mu.Lock()
	b.ttl[stream] = false
	b.mu.Unlock()
}

// bound returns the allowed stream whose filters match subject, or "".
// Streams' subjects never overlap, so at most one does.
func (b *binding) bound(subject string) string {
	for _, f := range b.filters {
		if SubjectMatches(f.filter, subject) {
			return f.stream
		}
	}
	return ""
}

// filterCovers reports whether every subject that pattern (tokens, '*',
// and a final '>') matches is matched by filter too.
func filterCovers(filter, pattern string) bool {
	for {
		ftok, frest, fmore := strings.Cut(filter, ".")
		ptok, prest, pmore := strings.Cut(pattern, ".")
		switch {
		case ftok == ">" && !fmore:
			return true
		case ptok == ">" && !pmore:
			return false // the filter is narrower from here
		case ptok == "*" && ftok != "*":
			return false
		case ftok != "*" && ftok != ptok:
			return false
		case !fmore || !pmore:
			return fmore == pmore
		}
		filter, pattern = frest, prest
	}
}

// SubjectMatches reports whether the literal subject matches the filter,
// with NATS's wildcards: '*' matches one token, a final '>' one or more.
func SubjectMatches(filter, subject string) bool {
	for {
		ftok, frest, fmore := strings.Cut(filter, ".")
		stok, srest, smore := strings.Cut(subject, ".")
		switch {
		case ftok == ">" && !fmore:
			return stok != ""
		case ftok != "*" && ftok != stok:
			return false
		case !fmore || !smore:
			return fmore == smore
		}
		filter, subject = frest, srest
	}
}
