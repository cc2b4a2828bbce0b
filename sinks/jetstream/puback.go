package jetstream

import (
	"encoding/json"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/sinks"
)

// pubAckResponse is what JetStream answers a publish with: a PubAck, or an
// API error. It decodes like nats.go's own (jetstream.pubAckResponse).
type pubAckResponse struct {
	Error *jetstream.APIError `json:"error,omitempty"`
	*jetstream.PubAck
}

// ackParser turns JetStream's answers to publishes into acks. It is used by
// one goroutine at a time (under the publisher's pumpMu), so it can keep
// the last stream name and hand out that string again instead of
// allocating one per ack.
type ackParser struct {
	stream string
}

// parse decodes one answer exactly as nats.go does: a PubAck with a stream
// name, or the API error it carries, or ErrInvalidJSAck. The common answers
// take a hand-written path; whatever it does not fully recognise goes to
// encoding/json.
func (p *ackParser) parse(data []byte) (sinks.Ack, error) {
	if stream, seq, dup, ok := scanPubAck(data); ok {
		if string(stream) != p.stream { // no allocation for the comparison
			p.stream = string(stream)
		}
		return sinks.Ack{Stream: p.stream, Sequence: seq, Duplicate: dup}, nil
	}
	return decodePubAck(data)
}

// decodePubAck is nats.go's decoding of a publish's answer
// (jetstream.(*jetStream).handleAsyncReply).
func decodePubAck(data []byte) (sinks.Ack, error) {
	var resp pubAckResponse
	if err := json.Unmarshal(data, &resp); err != nil {
		return sinks.Ack{}, jetstream.ErrInvalidJSAck
	}
	if resp.Error != nil {
		// A refusal names the stream that refused (an expected stream that
		// did not match: the one the subject is bound to now).
		var ack sinks.Ack
		if resp.PubAck != nil {
			ack.Stream = resp.Stream
		}
		return ack, resp.Error
	}
	if resp.PubAck == nil || resp.PubAck.Stream == "" {
		return sinks.Ack{}, jetstream.ErrInvalidJSAck
	}
	return sinks.Ack{Stream: resp.Stream, Sequence: resp.Sequence, Duplicate: resp.Duplicate}, nil
}

// scanPubAck recognises the PubAcks nats-server writes (server/stream.go
// builds them from a template, not with encoding/json):
//
//	{"stream":"NAME","seq":123}
//	{"stream":"NAME","domain":"D","seq":123}
//	{"stream":"NAME","seq":123,"duplicate": true}
//
// It accepts a JSON object of exactly these keys, each at most once, in any
// order and with any JSON whitespace, with "stream" (not empty) and "seq"
// present, strings of printable ASCII without escapes, seq a JSON integer
// that fits a uint64, and duplicate true or false. For every input it
// accepts, encoding/json decodes the same stream, sequence and duplicate
// flag and no error; anything else ("error", "val", "batch", escapes,
// non-ASCII names, ...) is left to decodePubAck.
func scanPubAck(b []byte) (stream []byte, seq uint64, dup bool, ok bool) {
	const (
		haveStream = 1 << iota
		haveSeq
		haveDomain
		haveDup
	)
	var seen int
	i := skipWS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, 0, false, false
	}
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == '}' {
		return nil, 0, false, false // {}: no stream
	}
	for {
		key, j, kok := scanString(b, i)
		if !kok {
			return nil, 0, false, false
		}
		i = skipWS(b, j)
		if i >= len(b) || b[i] != ':' {
			return nil, 0, false, false
		}
		i = skipWS(b, i+1)
		var bit int
		switch string(key) {
		case "stream":
			bit = haveStream
			stream, i, ok = scanString(b, i)
		case "domain":
			bit = haveDomain
			_, i, ok = scanString(b, i)
		case "seq":
			bit = haveSeq
			seq, i, ok = scanUint(b, i)
		case "duplicate":
			bit = haveDup
			dup, i, ok = scanBool(b, i)
		default:
			return nil, 0, false, false
		}
		if !ok || seen&bit != 0 {
			return nil, 0, false, false
		}
		seen |= bit
		i = skipWS(b, i)
		if i >= len(b) {
			return nil, 0, false, false
		}
		if b[i] == '}' {
			break
		}
		if b[i] != ',' {
			return nil, 0, false, false
		}
		i = skipWS(b, i+1)
	}
	if skipWS(b, i+1) != len(b) || seen&(haveStream|haveSeq) != haveStream|haveSeq || len(stream) == 0 {
		return nil, 0, false, false
	}
	return stream, seq, dup, true
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// scanString reads a JSON string at b[i] made of printable ASCII other than
// '"' and '\\': the bytes between the quotes are then its value.
func scanString(b []byte, i int) ([]byte, int, bool) {
	if i >= len(b) || b[i] != '"' {
		return nil, i, false
	}
	for j := i + 1; j < len(b); j++ {
		switch c := b[j]; {
		case c == '"':
			return b[i+1 : j], j + 1, true
		case c < 0x20 || c > 0x7e || c == '\\':
			return nil, j, false
		}
	}
	return nil, len(b), false
}

// scanUint reads a JSON integer without sign, exponent or fraction ("0", or
// digits not starting with 0) that fits a uint64.
func scanUint(b []byte, i int) (uint64, int, bool) {
	if i >= len(b) || b[i] < '0' || b[i] > '9' {
		return 0, i, false
	}
	if b[i] == '0' {
		if i+1 < len(b) && (b[i+1] >= '0' && b[i+1] <= '9' || b[i+1] == '.' || b[i+1] == 'e' || b[i+1] == 'E') {
			return 0, i, false
		}
		return 0, i + 1, true
	}
	var n uint64
	for ; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
		d := uint64(b[i] - '0')
		if n > (1<<64-1-d)/10 {
			return 0, i, false // overflow: encoding/json refuses it too, leave it there
		}
		n = n*10 + d
	}
	if i < len(b) && (b[i] == '.' || b[i] == 'e' || b[i] == 'E') {
		return 0, i, false
	}
	return n, i, true
}

func scanBool(b []byte, i int) (bool, int, bool) {
	switch {
	case len(b)-i >= 4 && string(b[i:i+4]) == "true":
		return true, i + 4, true
	case len(b)-i >= 5 && string(b[i:i+5]) == "false":
		return false, i + 5, true
	}
	return false, i, false
}
