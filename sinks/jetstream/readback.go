package jetstream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

var _ sinks.StoredReader = (*Sink)(nil)

// readBatch is the most headers one fetch asks for. A fetch asks for no
// more than the broker said are left, so it is answered at once and never
// waits for messages the stream does not have yet.
const readBatch = 5000

// fetchWait bounds one fetch: the broker's answer may be late (a cold store
// after a restart, a leader election, a long link) and is waited for this
// long before the fetch is asked again from where the read got.
const fetchWait = 5 * time.Second

// consumerIdle is the idle time after which the broker removes a read's
// consumer that its reader could not delete (the reader crashed, or the
// broker was away when the read ended).
const consumerIdle = time.Minute

// ReadStored implements sinks.StoredReader on the relay's own stream and
// subjects (SubjectPrefix + ">"), headers only. Rows whose subject column
// names another allowed stream are not read back; their repeats are left
// to the duplicate window.
func (s *Sink) ReadStored(ctx context.Context, from sinks.From, limit int, each func(sinks.Stored) bool) (sinks.ReadResult, error) {
	o := s.binding.opts
	if o.Stream == "" || o.SubjectPrefix == "" {
		return sinks.ReadResult{}, errors.New("read back: no own stream and prefix")
	}
	return s.readStored(ctx, o.Stream, []string{o.SubjectPrefix + ">"}, s.startOf(o.Stream, from), limit, each)
}

// startOf is where a read of stream starts: the own stream at its
// position when one is given, any other by time.
func (s *Sink) startOf(stream string, from sinks.From) readStart {
	if from.BySeq && stream == s.binding.opts.Stream {
		return readStart{afterSeq: from.AfterSeq, bySeq: true}
	}
	return readStart{since: from.Since}
}

var _ sinks.Finder = (*Sink)(nil)

// FindStored implements sinks.Finder: per stream that binds the wanted
// subjects (the binding's check, as a publish resolves it), one headers-only
// read filtered on those subjects, from from to the stream's last message
// when the read began, stopping early once every wanted message of that
// stream is found. A subject no allowed stream binds is not read, and makes
// the answer incomplete.
func (s *Sink) FindStored(ctx context.Context, want []sinks.Wanted, from sinks.From, limit int) (map[string]sinks.Stored, bool, error) {
	found := make(map[string]sinks.Stored, len(want))
	byStream := map[string]map[string]bool{} // stream -> subjects
	ids := map[string]map[string]bool{}      // stream -> IDs
	var order []string
	complete := true
	for _, w := range want {
		st, err := s.binding.check(ctx, s.js, w.Subject)
		if err != nil {
			if _, ok := wire.IsRejected(err); ok {
				// Not on a stream this sink may read: not looked for,
				// so not ruled out either.
				complete = false
				continue
			}
			return found, false, fmt.Errorf("find stored messages: %w", err)
		}
		if byStream[st] == nil {
			byStream[st], ids[st] = map[string]bool{}, map[string]bool{}
			order = append(order, st)
		}
		byStream[st][w.Subject] = true
		ids[st][w.ID] = true
	}
	read := 0
	for _, st := range order {
		if read >= limit {
			return found, false, nil
		}
		subjects := make([]string, 0, len(byStream[st]))
		for subj := range byStream[st] {
			subjects = append(subjects, subj)
		}
		slices.Sort(subjects)
		left := len(ids[st])
		res, err := s.readStored(ctx, st, subjects, s.startOf(st, from), limit-read, func(m sinks.Stored) bool {
			if ids[st][m.ID] {
				if _, dup := found[m.ID]; !dup {
					found[m.ID] = m // the first stored copy is the one kept
					left--
				}
			}
			return left > 0
		})
		read += res.Read
		if err != nil {
			return found, false, err
		}
		if !res.Complete && left > 0 {
			complete = false
		}
	}
	return found, complete, nil
}

// readStart is where readStored begins: after a sequence, or at a time.
type readStart struct {
	afterSeq uint64
	bySeq    bool
	since    time.Time
}

// readStored reads the headers of stream's messages on filters from start
// to the stream's last sequence when the read began (its end), calling
// each in stream order. The read ends only on evidence from the broker: a
// message at or past the end, or a message (or the consumer's creation)
// saying nothing on the filters is pending. An answer that is empty,
// late or cut short before that is asked again, from where the read got,
// until ctx ends; then the read is an error, never a short complete read
// (a fetch that answers late reads as empty in nats.go: its FetchNoWait
// ends after 1 s with no messages and no error).
//
// One consumer at a time, deleted when the read ends: an ephemeral,
// in-memory, headers-only pull consumer with no acks. A fetch cut short can
// leave messages delivered to an inbox nobody reads (the consumer counts
// them as delivered), so after one the consumer is replaced by one starting
// after the last message read; a gap in the consumer's sequence is caught
// the same way.
func (s *Sink) readStored(ctx context.Context, stream string, filters []string, start readStart, limit int, each func(sinks.Stored) bool) (sinks.ReadResult, error) {
	res := sinks.ReadResult{After: start.afterSeq}
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		return res, fmt.Errorf("read stream %s: %w", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return res, fmt.Errorf("read stream %s: %w", stream, err)
	}
	res.End = info.State.LastSeq
	if !start.bySeq {
		res.After = res.End
	}
	switch {
	case info.State.Msgs == 0, start.bySeq && start.afterSeq >= res.End:
		res.Complete = true
		return res, nil
	case !start.bySeq && !start.since.IsZero() && info.State.LastTime.Before(start.since):
		res.Complete = true
		return res, nil
	}
	r := &streamRead{st: st, stream: stream, filters: filters, end: res.End}
	defer r.drop()
	first := true
	for res.Read < limit {
		if r.cons == nil {
			from := start
			if res.Read > 0 {
				from = readStart{afterSeq: r.last, bySeq: true}
			}
			if err := r.create(ctx, from); err != nil {
				return res, err
			}
			if r.pending == 0 {
				res.Complete = true
				return res, nil
			}
		}
		n := int(min(uint64(min(readBatch, limit-res.Read)), r.pending))
		fctx, cancel := context.WithTimeout(ctx, fetchWait)
		batch, err := r.cons.Fetch(n, jetstream.FetchContext(fctx))
		if err != nil {
			cancel()
			return res, fmt.Errorf("read stream %s after sequence %d of %d: %w", stream, r.last, res.End, err)
		}
		got, done, stop := 0, false, false
		var merr error
		for m := range batch.Messages() {
			if done || stop || merr != nil {
				continue // drain: the fetch ends with its messages taken
			}
			md, err := m.Metadata()
			if err != nil {
				merr = err
				continue
			}
			if md.Sequence.Consumer != r.delivered+1 {
				// Messages went to an inbox nobody reads: start over
				// after the last one read.
				r.replace()
				break
			}
			r.delivered = md.Sequence.Consumer
			got++
			res.Read++
			if first {
				if !start.bySeq {
					res.After = md.Sequence.Stream - 1
				}
				first = false
			}
			r.last, r.pending = md.Sequence.Stream, md.NumPending
			if id := m.Headers().Get(jetstream.MsgIDHeader); id != "" {
				if !each(sinks.Stored{ID: id, Stream: stream, Seq: md.Sequence.Stream, Header: m.Headers()}) {
					stop = true
					continue
				}
			}
			if md.Sequence.Stream >= res.End || md.NumPending == 0 {
				done = true
			}
		}
		berr := batch.Error()
		cancel()
		switch {
		case merr != nil:
			return res, fmt.Errorf("read stream %s: %w", stream, merr)
		case stop:
			return res, nil
		case done:
			res.Complete = true
			return res, nil
		}
		if ctx.Err() != nil {
			return res, fmt.Errorf("read stream %s: stopped after sequence %d, short of its end %d (the broker answered too slowly, or not at all): %w", stream, r.last, res.End, ctx.Err())
		}
		if berr != nil && !errors.Is(berr, jetstream.ErrNoMessages) && !errors.Is(berr, context.DeadlineExceeded) {
			return res, fmt.Errorf("read stream %s after sequence %d of %d: %w", stream, r.last, res.End, berr)
		}
		if got < n {
			// Short of what the broker said was there: its answer was
			// late, or cut. Ask again from the last message read, on a
			// new consumer (the old one may have sent the rest into the
			// fetch's closed inbox).
			r.replace()
		}
	}
	return res, nil
}

// streamRead is one read's consumer and how far it got.
type streamRead struct {
	st        jetstream.Stream
	stream    string
	filters   []string
	end       uint64
	cons      jetstream.Consumer
	name      string
	delivered uint64 // the consumer's sequence of the last message taken
	last      uint64 // the stream sequence of the last message read
	pending   uint64 // messages on the filters left after it, as the broker last said
}

// create makes the read's consumer, starting at start.
func (r *streamRead) create(ctx context.Context, start readStart) error {
	cfg := jetstream.ConsumerConfig{
		AckPolicy:         jetstream.AckNonePolicy,
		HeadersOnly:       true,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: consumerIdle,
	}
	if len(r.filters) == 1 {
		cfg.FilterSubject = r.filters[0]
	} else {
		cfg.FilterSubjects = r.filters
	}
	switch {
	case start.bySeq:
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = start.afterSeq + 1
	case !start.since.IsZero():
		since := start.since
		cfg.DeliverPolicy = jetstream.DeliverByStartTimePolicy
		cfg.OptStartTime = &since
	default:
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	}
	c, err := r.st.CreateConsumer(ctx, cfg)
	if err != nil {
		return fmt.Errorf("read stream %s: create a consumer (%s): %w", r.stream, consumerFix(err), err)
	}
	r.cons, r.name, r.delivered = c, c.CachedInfo().Name, 0
	r.pending = c.CachedInfo().NumPending
	return nil
}

// replace drops the consumer; the next fetch creates one after r.last.
func (r *streamRead) replace() {
	r.drop()
	r.cons = nil
}

// drop deletes the consumer, bounded: one the broker does not hear of goes
// after consumerIdle.
func (r *streamRead) drop() {
	if r.cons == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = r.st.DeleteConsumer(ctx, r.name)
}

// consumerFix says what to change when a read's consumer cannot be made.
func consumerFix(err error) string {
	var apiErr *jetstream.APIError
	switch {
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeMaximumConsumersLimit:
		return "the stream is at its max_consumers: raise it by one for each relay instance, or turn the read-back and lookups off with --readback-limit 0, leaving repeats to the duplicate window"
	case errors.Is(err, nats.ErrPermissionViolation):
		return "the relay's NATS user needs permission to create and delete consumers on the stream ($JS.API.CONSUMER.CREATE.<stream>.> and $JS.API.CONSUMER.DELETE.<stream>.>, docs/security.md), or turn the read-back and lookups off with --readback-limit 0"
	case errors.Is(err, nats.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return "no answer in time: the broker is slow or away, or the relay's NATS user may not create consumers on the stream (then grant $JS.API.CONSUMER.CREATE.<stream>.> and $JS.API.CONSUMER.DELETE.<stream>.>, docs/security.md)"
	}
	return "the relay's NATS user needs to create consumers on the stream"
}

var _ sinks.ReadChecker = (*Sink)(nil)

// checkReadsWait bounds CheckReads' consumer: a request refused for want
// of permission is never answered.
const checkReadsWait = 5 * time.Second

// CheckReads implements sinks.ReadChecker: it creates and deletes a
// consumer on the own stream as a read would, and says what to fix when
// that fails.
func (s *Sink) CheckReads(ctx context.Context) error {
	name := s.binding.opts.Stream
	if name == "" {
		return nil
	}
	st, err := s.js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("check reads of stream %s: %w", name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return fmt.Errorf("check reads of stream %s: %w", name, err)
	}
	r := &streamRead{st: st, stream: name, filters: []string{s.binding.opts.SubjectPrefix + ">"}}
	cctx, cancel := context.WithTimeout(ctx, checkReadsWait)
	defer cancel()
	if err := r.create(cctx, readStart{afterSeq: info.State.LastSeq, bySeq: true}); err != nil {
		// No retry fixes these: the relay would start, its first read
		// after a crash would fail, and delivery stall.
		const what = "the relay reads the stream back after a restart and looks uncertain rows up in it (G18), each read through a consumer it creates and deletes"
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeMaximumConsumersLimit {
			return fmt.Errorf("%w: %s, and stream %s is at its max_consumers (%d): raise it by one for each relay instance, or turn the reads off with --readback-limit 0 (then only the duplicate window drops repeats): %w",
				ErrStreamConfig, what, name, info.Config.MaxConsumers, apiErr)
		}
		// A request the server refuses for permissions gets no answer:
		// nats.go reports the violation to the connection only.
		if last := s.js.Conn().LastError(); errors.Is(last, nats.ErrPermissionViolation) && strings.Contains(last.Error(), "$JS.API.CONSUMER.CREATE."+name) {
			return fmt.Errorf("%w: %s, and the relay's NATS user may not create consumers on stream %s (%w): allow it to publish to $JS.API.CONSUMER.CREATE.%s.> and $JS.API.CONSUMER.DELETE.%s.> (docs/security.md), or turn the reads off with --readback-limit 0 (then only the duplicate window drops repeats)",
				ErrStreamConfig, what, name, last, name, name)
		}
		return err
	}
	r.drop()
	return nil
}

var _ sinks.StreamStater = (*Sink)(nil)

// OwnStreamState implements sinks.StreamStater on the relay's own stream.
func (s *Sink) OwnStreamState(ctx context.Context) (sinks.StreamState, error) {
	name := s.binding.opts.Stream
	if name == "" {
		return sinks.StreamState{}, errors.New("stream state: no own stream")
	}
	st, err := s.js.Stream(ctx, name)
	if err != nil {
		return sinks.StreamState{}, fmt.Errorf("stream state of %s: %w", name, err)
	}
	sent := time.Now()
	info, err := st.Info(ctx)
	if err != nil {
		return sinks.StreamState{}, fmt.Errorf("stream state of %s: %w", name, err)
	}
	got := time.Now()
	state := sinks.StreamState{Stream: name, FirstSeq: info.State.FirstSeq, LastSeq: info.State.LastSeq, Created: info.Created}
	if !info.TimeStamp.IsZero() {
		rtt := got.Sub(sent)
		state.BrokerOffset, state.OffsetUncertainty, state.OffsetKnown = info.TimeStamp.Sub(sent.Add(rtt/2)), rtt/2, true
	}
	return state, nil
}

// raiseKnown notes that the own stream holds seq: every message published
// after this is stored past it.
func (s *Sink) raiseKnown(seq uint64) {
	for {
		cur := s.known.Load()
		if int64(seq) <= cur {
			s.knownAt.Store(time.Now().UnixNano())
			return
		}
		if s.known.CompareAndSwap(cur, int64(seq)) {
			s.knownAt.Store(time.Now().UnixNano())
			return
		}
	}
}

var _ sinks.Positioner = (*Sink)(nil)

// StreamPosition implements sinks.Positioner: the highest sequence of the
// own stream this sink saw acknowledged or read as its last, read again
// from the broker when older than maxAge (within ctx). A message published
// after it returns is stored past the sequence, whatever the clocks: the
// broker stored that one before. ok is false when no sequence is known and
// the broker did not answer.
func (s *Sink) StreamPosition(ctx context.Context, maxAge time.Duration) (uint64, bool) {
	if at := s.knownAt.Load(); at != 0 && time.Since(time.Unix(0, at)) <= maxAge {
		return uint64(s.known.Load()), true
	}
	if state, err := s.OwnStreamState(ctx); err == nil {
		// Set, not raised: a broker that lost its newest messages hands
		// their sequences out again, and a position past its last would
		// miss what it stores there next.
		s.known.Store(int64(state.LastSeq))
		s.knownAt.Store(time.Now().UnixNano())
		return state.LastSeq, true
	}
	if s.knownAt.Load() != 0 {
		return uint64(s.known.Load()), true
	}
	return 0, false
}
