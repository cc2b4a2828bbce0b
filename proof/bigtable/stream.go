package bigtable

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

type jetstreamAPI = jetstream.JetStream

func streamMsgs(ctx context.Context, js jetstream.JetStream, name string) (uint64, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

type storedMsg struct {
	id string
	at time.Time // the stream's timestamp: when the server stored it
}

// readStream reads every message of the stream with an ordered consumer.
func readStream(ctx context.Context, js jetstream.JetStream, name string) ([]storedMsg, error) {
	want, err := streamMsgs(ctx, js, name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, name, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		return nil, fmt.Errorf("ordered consumer on %s: %w", name, err)
	}
	out := make([]storedMsg, 0, want)
	for uint64(len(out)) < want {
		if ctx.Err() != nil {
			return out, fmt.Errorf("read stream %s: %d of %d messages before the deadline", name, len(out), want)
		}
		batch, err := cons.Fetch(int(min(1000, want-uint64(len(out)))), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return out, fmt.Errorf("fetch from %s: %w", name, err)
		}
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				return out, fmt.Errorf("message metadata: %w", err)
			}
			out = append(out, storedMsg{id: m.Headers().Get(jetstream.MsgIDHeader), at: md.Timestamp})
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return out, fmt.Errorf("fetch from %s: %w", name, err)
		}
	}
	return out, nil
}
