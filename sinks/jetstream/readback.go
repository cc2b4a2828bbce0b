package jetstream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

var _ sinks.StoredReader = (*Sink)(nil)

// readBackBatch is how many headers one fetch asks for.
const readBackBatch = 1000

// StoredSince implements sinks.StoredReader on the relay's own stream and
// subjects (SubjectPrefix + ">"): headers only, through an ordered
// consumer that starts at since, up to the stream's last message when the
// read began. Rows whose subject column names another allowed stream are
// not read back; their repeats are left to the duplicate window.
func (s *Sink) StoredSince(ctx context.Context, since time.Time, limit int, each func(sinks.Stored) bool) (int, bool, error) {
	o := s.binding.opts
	if o.Stream == "" || o.SubjectPrefix == "" {
		return 0, false, errors.New("read back: no own stream and prefix")
	}
	return s.readStored(ctx, o.Stream, []string{o.SubjectPrefix + ">"}, since, limit, each)
}

var _ sinks.Finder = (*Sink)(nil)

// FindStored implements sinks.Finder: per stream that binds the wanted
// subjects (the binding's check, as a publish resolves it), one ordered
// headers-only read filtered on those subjects, from since to the stream's
// last message when the read began, stopping early once every wanted
// message of that stream is found. A subject no allowed stream binds is
// not read, and makes the answer incomplete.
func (s *Sink) FindStored(ctx context.Context, want []sinks.Wanted, since time.Time, limit int) (map[string]sinks.Stored, bool, error) {
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
		n, done, err := s.readStored(ctx, st, subjects, since, limit-read, func(m sinks.Stored) bool {
			if ids[st][m.ID] {
				if _, dup := found[m.ID]; !dup {
					found[m.ID] = m // the first stored copy is the one kept
					left--
				}
			}
			return left > 0
		})
		read += n
		if err != nil {
			return found, false, err
		}
		if !done && left > 0 {
			complete = false
		}
	}
	return found, complete, nil
}

// readStored reads the headers of stream's messages on filters from since
// on, calling each in stream order (see StoredSince).
func (s *Sink) readStored(ctx context.Context, stream string, filters []string, since time.Time, limit int, each func(sinks.Stored) bool) (int, bool, error) {
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		return 0, false, fmt.Errorf("read back stream %s: %w", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("read back stream %s: %w", stream, err)
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 || info.State.LastTime.Before(since) {
		return 0, true, nil
	}
	start := since
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: filters,
		DeliverPolicy:  jetstream.DeliverByStartTimePolicy,
		OptStartTime:   &start,
		HeadersOnly:    true,
	})
	if err != nil {
		return 0, false, fmt.Errorf("read back stream %s: create an ordered consumer (the relay's NATS user needs to create consumers on it): %w", stream, err)
	}
	read := 0
	for read < limit {
		// No wait: a fetch that waited for messages the stream does not
		// have yet would hold every session start (and leave its
		// goroutine behind when the read stops early).
		batch, err := c.FetchNoWait(min(readBackBatch, limit-read))
		if err != nil {
			return read, false, fmt.Errorf("read back stream %s: %w", stream, err)
		}
		n, done, stop := 0, false, false
		var merr error
		for m := range batch.Messages() {
			n++
			if done || stop || merr != nil {
				continue // drain: the fetch ends with its messages taken
			}
			read++
			md, err := m.Metadata()
			if err != nil {
				merr = err
				continue
			}
			if id := m.Headers().Get(jetstream.MsgIDHeader); id != "" {
				if !each(sinks.Stored{ID: id, Stream: stream, Seq: md.Sequence.Stream, Header: m.Headers()}) {
					stop = true
					continue
				}
			}
			if md.Sequence.Stream >= last || md.NumPending == 0 {
				done = true
			}
		}
		switch {
		case merr != nil:
			return read, false, fmt.Errorf("read back stream %s: %w", stream, merr)
		case stop:
			return read, false, nil
		case done:
			return read, true, nil
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return read, false, fmt.Errorf("read back stream %s: %w", stream, err)
		}
		if n == 0 {
			// Nothing more on these subjects up to now.
			return read, true, nil
		}
	}
	return read, false, nil
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
	info, err := st.Info(ctx)
	if err != nil {
		return sinks.StreamState{}, fmt.Errorf("stream state of %s: %w", name, err)
	}
	return sinks.StreamState{Stream: name, FirstSeq: info.State.FirstSeq, LastSeq: info.State.LastSeq, Created: info.Created}, nil
}
