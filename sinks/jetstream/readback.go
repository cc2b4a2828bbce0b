package jetstream

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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
	st, err := s.js.Stream(ctx, o.Stream)
	if err != nil {
		return 0, false, fmt.Errorf("read back stream %s: %w", o.Stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("read back stream %s: %w", o.Stream, err)
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 || info.State.LastTime.Before(since) {
		return 0, true, nil
	}
	start := since
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{o.SubjectPrefix + ">"},
		DeliverPolicy:  jetstream.DeliverByStartTimePolicy,
		OptStartTime:   &start,
		HeadersOnly:    true,
	})
	if err != nil {
		return 0, false, fmt.Errorf("read back stream %s: create an ordered consumer (the relay's NATS user needs to create consumers on it): %w", o.Stream, err)
	}
	read := 0
	for read < limit {
		// No wait: a fetch that waited for messages the stream does not
		// have yet would hold every session start (and leave its
		// goroutine behind when the read stops early).
		batch, err := c.FetchNoWait(min(readBackBatch, limit-read))
		if err != nil {
			return read, false, fmt.Errorf("read back stream %s: %w", o.Stream, err)
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
				if !each(sinks.Stored{ID: id, Stream: o.Stream, Seq: md.Sequence.Stream, Header: m.Headers()}) {
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
			return read, false, fmt.Errorf("read back stream %s: %w", o.Stream, merr)
		case stop:
			return read, false, nil
		case done:
			return read, true, nil
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return read, false, fmt.Errorf("read back stream %s: %w", o.Stream, err)
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
