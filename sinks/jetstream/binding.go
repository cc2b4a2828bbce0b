package jetstream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/sinks"
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
}

// DefaultBindingRefresh is how long the allowed streams' subject lists are
// trusted: an operator who adds a subject to a stream waits at most this.
const DefaultBindingRefresh = 30 * time.Second

// minReread spaces re-reads caused by unbound subjects, so a flood of rows
// with made-up subjects costs one stream read a second, not one per row.
const minReread = time.Second

// Reasons of rejections decided by the binding check.
const (
	ReasonNoStream         = "no_stream"
	ReasonStreamNotAllowed = "stream_not_allowed"
)

// binding caches the allowed streams' subject filters.
type binding struct {
	opts    Options
	allowed []string // stream names, own first

	mu      sync.Mutex
	filters []streamFilter
	readAt  time.Time
}

type streamFilter struct {
	stream, filter string
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
	return &binding{opts: o, allowed: allowed}
}

// check returns nil when an allowed stream binds subject, a
// *sinks.RejectedError when none does, and another error when the streams
// could not be read (an outage: retry).
func (b *binding) check(ctx context.Context, js API, subject string) error {
	if b.opts.SubjectPrefix != "" && b.opts.Stream != "" && strings.HasPrefix(subject, b.opts.SubjectPrefix) {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if b.readAt.IsZero() || now.Sub(b.readAt) > b.opts.Refresh {
		if err := b.read(ctx, js, now); err != nil {
			return err
		}
	}
	if b.bound(subject) {
		return nil
	}
	if now.Sub(b.readAt) > minReread {
		if err := b.read(ctx, js, now); err != nil {
			return err
		}
		if b.bound(subject) {
			return nil
		}
	}
	// Refused. Name the stream that does bind it, if one does, so the
	// operator can tell a typo from a stream that was not allowed.
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	name, err := js.StreamNameBySubject(lctx, subject)
	switch {
	case err == nil && name != "":
		return &sinks.RejectedError{Reason: ReasonStreamNotAllowed, Err: fmt.Errorf(
			"subject %q is bound to stream %s, which this relay does not publish to (it publishes to %s): fix the row's subject, or allow the stream with --allow-stream %s",
			subject, name, strings.Join(b.allowed, ", "), name)}
	case err == nil, errors.Is(err, jetstream.ErrStreamNotFound), errors.Is(err, jetstream.ErrInvalidSubject):
		return &sinks.RejectedError{Reason: ReasonNoStream, Err: fmt.Errorf(
			"no JetStream stream binds subject %q (this relay publishes to %s): fix the row's subject, or bind it to one of those streams",
			subject, strings.Join(b.allowed, ", "))}
	default:
		return fmt.Errorf("look up the stream bound to %q: %w", subject, err)
	}
}

func (b *binding) read(ctx context.Context, js API, now time.Time) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var filters []streamFilter
	for _, name := range b.allowed {
		st, err := js.Stream(rctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue // an allowed stream that does not exist binds nothing
		}
		if err != nil {
			return fmt.Errorf("read the subjects of stream %s: %w", name, err)
		}
		for _, f := range st.CachedInfo().Config.Subjects {
			filters = append(filters, streamFilter{stream: name, filter: f})
		}
	}
	b.filters, b.readAt = filters, now
	return nil
}

func (b *binding) bound(subject string) bool {
	for _, f := range b.filters {
		if SubjectMatches(f.filter, subject) {
			return true
		}
	}
	return false
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
