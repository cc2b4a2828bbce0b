package jetstream

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// Atomic batch publish (ADR-50, nats-server 2.12+; G20). Every message of a
// batch carries Nats-Batch-Id and its Nats-Batch-Sequence (1, 2, ...); the
// last also Nats-Batch-Commit: 1. The server stages the messages and
// stores them all, consecutively, when the commit arrives, or none. Only
// the commit is sent with a reply subject: the server answers a staged
// message only when it has a reply (an empty ack), so one answer comes
// per batch, a PubAck of the last message with "batch" and "count". A
// message the server refuses while staging goes unanswered, and the commit
// then finds the batch incomplete (10176) and stores nothing.
//
// synadia-io/orbit.go's jetstreamext (v0.3.2) implements the same protocol,
// but its BatchPublisher waits for a reply to the first message and makes
// the commit a blocking request: one batch at a time, two round trips
// each. Here a batch's commit is one more pending publish in the
// publisher's ring, so batches pipeline like single messages do.

// Headers of the atomic batch protocol.
const (
	HeaderBatchID     = "Nats-Batch-Id"
	HeaderBatchSeq    = "Nats-Batch-Sequence"
	HeaderBatchCommit = "Nats-Batch-Commit"
)

// DefaultMaxBatch is nats-server's default limit of messages in one atomic
// batch (jetstream { limits { max_batch_size } }).
const DefaultMaxBatch = 1000

// Error codes of atomic batch publish (nats-server's errors.json).
const (
	errCodeAtomicDisabled      jetstream.ErrorCode = 10174 // the stream does not allow atomic publish
	errCodeAtomicMissingSeq    jetstream.ErrorCode = 10175
	errCodeAtomicIncomplete    jetstream.ErrorCode = 10176 // a message of the batch is missing (refused while staged, timed out)
	errCodeAtomicUnsupported   jetstream.ErrorCode = 10177
	errCodeAtomicInvalidID     jetstream.ErrorCode = 10179
	errCodeAtomicTooLarge      jetstream.ErrorCode = 10199 // more messages than max_batch_size
	errCodeAtomicInvalidCommit jetstream.ErrorCode = 10200
	errCodeAtomicDuplicate     jetstream.ErrorCode = 10201 // the batch holds a Nats-Msg-Id the stream already has
	errCodeAtomicTooMany       jetstream.ErrorCode = 10210 // too many batches open on the stream or server
	errCodeDuplicateInProcess  jetstream.ErrorCode = 10158 // a message with the same ID is being stored
)

var batchCommitValue = []string{"1"}

// PublishBatch implements sinks.Batcher. Messages go to their streams in
// one batch per stream; a stream that gets one message gets it as a plain
// publish (a single message is stored whole anyway, and a batch costs the
// server a staging store).
func (s *Sink) PublishBatch(ctx context.Context, ms []*wire.Message) ([]sinks.Future, []error, error) {
	futs := make([]sinks.Future, len(ms))
	errs := make([]error, len(ms))
	var groups [][]*future
	var maxPayload int64
	if nc := s.js.Conn(); nc != nil {
		maxPayload = nc.MaxPayload()
	}
	for i, m := range ms {
		f, err := s.prepare(ctx, m)
		if _, rejected := wire.IsRejected(err); err != nil && !rejected {
			// Nothing is sent: a batch without this message would store
			// the transaction in part.
			return nil, nil, err
		}
		if err != nil {
			errs[i] = err
			continue
		}
		// A message over max_payload would fail in the client with the
		// batch half sent: it is refused alone, before anything is sent.
		if maxPayload > 0 && int64(len(m.Data)+headerBytes(f.hdr)+batchHeaderRoom) > maxPayload {
			errs[i] = &wire.RejectedError{Reason: ReasonMaxPayload, Err: fmt.Errorf("publish %s to %s: %w", m.ID, m.Subject, nats.ErrMaxPayload)}
			continue
		}
		f.index = i
		futs[i] = f
		g := 0
		for g < len(groups) && groups[g][0].stream != f.stream {
			g++
		}
		if g == len(groups) {
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], f)
	}
	for _, g := range groups {
		if len(g) > 1 {
			if err := s.pub.publishBatch(g); err != nil {
				return nil, nil, fmt.Errorf("publish a batch of %d messages to stream %s: %w", len(g), g[0].stream, err)
			}
			continue
		}
		f := g[0]
		if _, err := s.pub.publish(f); err != nil {
			err = classify(ctx, s.js, f.msg.Subject, fmt.Errorf("publish %s to %s: %w", f.msg.ID, f.msg.Subject, err))
			if _, ok := wire.IsRejected(err); !ok {
				return nil, nil, err
			}
			futs[f.index], errs[f.index] = nil, err
		}
	}
	return futs, errs, nil
}

// Republish implements sinks.Batcher: m is published alone, without the
// batch's headers.
func (s *Sink) Republish(ctx context.Context, m *wire.Message) (sinks.Future, error) {
	delete(m.Header, HeaderBatchID)
	delete(m.Header, HeaderBatchSeq)
	delete(m.Header, HeaderBatchCommit)
	return s.Publish(ctx, m)
}

// batchHeaderRoom is what the batch's headers add to a message at most.
const batchHeaderRoom = len(HeaderBatchID) + 32 + len(HeaderBatchSeq) + 24 + len(HeaderBatchCommit) + 8

// headerBytes is the size of h encoded as NATS headers.
func headerBytes(h nats.Header) int {
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": \r\n") + len(v)
		}
	}
	return n
}

// publishBatch sends fs (two or more messages to one stream) as one atomic
// batch. Only the commit is registered for an answer; its answer, timeout
// or disconnect resolves every message (resolveBatch, future.resolve).
func (p *publisher) publishBatch(fs []*future) error {
	last := fs[len(fs)-1]
	id := p.nextBatchID()
	ids := []string{id}
	// Every header is written before the commit is registered: the
	// answer's handler (another goroutine) starts from that registration.
	for i, f := range fs {
		f.hdr[HeaderBatchID] = ids
		f.hdr[HeaderBatchSeq] = []string{strconv.Itoa(i + 1)}
	}
	last.hdr[HeaderBatchCommit] = batchCommitValue
	last.batch, last.batchID = fs, id

	p.mu.Lock()
	if err := p.start(); err != nil {
		p.mu.Unlock()
		return err
	}
	token := p.register(last)
	p.mu.Unlock()

	var err error
	for _, f := range fs[:len(fs)-1] {
		if err = p.nc.PublishMsg(&nats.Msg{Subject: f.msg.Subject, Data: f.msg.Data, Header: f.hdr}); err != nil {
			break
		}
	}
	if err == nil {
		var buf [96]byte
		reply := string(strconv.AppendUint(append(buf[:0], p.prefix...), token, 10))
		err = p.nc.PublishMsg(&nats.Msg{Subject: last.msg.Subject, Reply: reply, Data: last.msg.Data, Header: last.hdr})
	}
	if err != nil {
		// Not committed: the server drops what it staged after its batch
		// timeout. A disconnect may have resolved the batch meanwhile.
		p.mu.Lock()
		p.remove(last, token)
		p.mu.Unlock()
		return err
	}
	return nil
}

// nextBatchID returns a batch ID unique among the batches open on a
// stream: a random prefix of this publisher's and a counter (64 bytes at
// most, the server's limit).
func (p *publisher) nextBatchID() string {
	p.batchOnce.Do(func() {
		var b [12]byte
		_, _ = rand.Read(b[:])
		p.batchPrefix = base64.RawURLEncoding.EncodeToString(b[:]) + "."
	})
	return p.batchPrefix + strconv.FormatUint(p.batches.Add(1), 36)
}

// batchAckResponse is the answer to a batch's commit.
type batchAckResponse struct {
	Error    *jetstream.APIError `json:"error,omitempty"`
	Stream   string              `json:"stream"`
	Sequence uint64              `json:"seq"`
	BatchID  string              `json:"batch"`
	Count    int                 `json:"count"`
}

// resolveBatch resolves every message of last's batch from the answer to
// its commit. Stored: the batch is stored consecutively, ending at the
// sequence the answer names. Refused: nothing is stored; where the refusal
// may concern one message or the stream's content (a known message ID, a
// message refused while staged), every message fails with ErrBatchRefused
// so that each is published again alone; where it is about the batch
// (limits, the stream's settings), every message fails with it as an
// outage.
func (p *publisher) resolveBatch(last *future, m *nats.Msg) {
	fs := last.batch
	if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
		// No responders: no stream took the commit. Not retried alone (the
		// batch is gone with it): the caller classifies the failure.
		last.resolve(sinks.Ack{}, jetstream.ErrNoStreamResponse)
		return
	}
	var resp batchAckResponse
	if err := json.Unmarshal(m.Data, &resp); err != nil {
		last.resolve(sinks.Ack{}, jetstream.ErrInvalidJSAck)
		return
	}
	if resp.Error != nil {
		last.resolve(sinks.Ack{Stream: resp.Stream}, batchError(resp.Error, len(fs)))
		return
	}
	if resp.Stream == "" || resp.BatchID != last.batchID || resp.Count != len(fs) || resp.Sequence < uint64(len(fs)) {
		last.resolve(sinks.Ack{}, fmt.Errorf("%w: the answer to batch %s of %d messages names batch %q of %d ending at sequence %d",
			jetstream.ErrInvalidJSAck, last.batchID, len(fs), resp.BatchID, resp.Count, resp.Sequence))
		return
	}
	first := resp.Sequence - uint64(len(fs)) + 1
	for i, f := range fs {
		f.settle(sinks.Ack{Stream: resp.Stream, Sequence: first + uint64(i)}, nil)
	}
}

// batchError is the outcome of every message of a batch of n the broker
// refused with apiErr.
func batchError(apiErr *jetstream.APIError, n int) error {
	switch apiErr.ErrorCode {
	case errCodeAtomicDisabled:
		return fmt.Errorf("the stream does not allow atomic batch publish (it was changed since the session began; the next session's check says the fix): %w", apiErr)
	case errCodeAtomicTooLarge:
		return fmt.Errorf("a batch of %d messages is over the server's max_batch_size: lower --atomic-batch-max to it, or raise the server's limit: %w", n, apiErr)
	case errCodeAtomicTooMany, errCodeDuplicateInProcess:
		// Nothing stored, and the same batch can be taken later.
		return apiErr
	case errCodeAtomicMissingSeq, errCodeAtomicInvalidID, errCodeAtomicInvalidCommit, errCodeAtomicUnsupported:
		return fmt.Errorf("the server refused the batch's form (a relay bug): %w", apiErr)
	}
	return fmt.Errorf("%w: %w", sinks.ErrBatchRefused, apiErr)
}

var _ sinks.Batcher = (*Sink)(nil)
