package inbox

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Payload returns the payload msg carries, the bytes the producer enqueued,
// whatever the relay's --message-format:
//
//   - outbox and cloudevents (binary content mode): the message's data;
//   - cloudevents-structured: msg's Content-Type is
//     application/cloudevents+json and its data is the event envelope;
//     Payload returns the envelope's "data" member (the raw bytes of the
//     JSON value, or a JSON string's text when the event's datacontenttype
//     is not application/json or text/json, as the CloudEvents SDK for Go
//     reads it) or its decoded "data_base64". The relay embeds a payload
//     as "data" only when that gives back its exact bytes, and in
//     data_base64 otherwise, so the result is the same in every format.
//
// Any message whose Content-Type is application/cloudevents+json is read as
// an envelope, whoever published it. An envelope that is not a JSON object
// with specversion "1.0", or holds both data and data_base64, or a
// data_base64 that is not a base64 string, is an error wrapping
// ErrRejected: a handler that returns it terminates the message. An event
// without data has an empty payload.
//
// Process hashes what Payload returns, so a message delivered once in one
// format and again in another (an operator changed --message-format between
// a publish and a republish) is a repeat, not a conflict.
func Payload(msg jetstream.Msg) ([]byte, error) {
	data := msg.Data()
	if !structured(msg.Headers()) {
		return data, nil
	}
	p, err := envelopePayload(data)
	if err != nil {
		return nil, fmt.Errorf("%w: %s event: %v", ErrRejected, wire.MediaCloudEventsJSON, err)
	}
	return p, nil
}

// structured says whether h's Content-Type names a structured CloudEvent.
func structured(h nats.Header) bool {
	ct := h.Get(wire.HeaderContentType)
	if ct == "" {
		// Header names are case-insensitive on the wire; the relay writes
		// this spelling, other publishers may not.
		for k, vs := range h {
			if len(vs) > 0 && strings.EqualFold(k, wire.HeaderContentType) {
				ct = vs[0]
				break
			}
		}
	}
	if ct == "" {
		return false
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil && !errors.Is(err, mime.ErrInvalidMediaParameter) {
		return false
	}
	return mt == wire.MediaCloudEventsJSON
}

// envelopePayload reads the payload out of a structured event (CloudEvents
// JSON format, section 3.1).
func envelopePayload(env []byte) ([]byte, error) {
	var ev map[string]json.RawMessage
	if err := json.Unmarshal(env, &ev); err != nil {
		return nil, fmt.Errorf("not a JSON object: %v", err)
	}
	if ev == nil {
		return nil, errors.New("not a JSON object: null")
	}
	var version string
	if err := json.Unmarshal(ev["specversion"], &version); err != nil || version != wire.CESpecVersion {
		return nil, fmt.Errorf("specversion %.40s: want %q", orMissing(ev["specversion"]), wire.CESpecVersion)
	}
	data, hasData := ev["data"]
	b64, hasB64 := ev["data_base64"]
	switch {
	case hasData && hasB64:
		return nil, errors.New("both data and data_base64: an event holds one")
	case hasB64:
		var s string
		if err := json.Unmarshal(b64, &s); err != nil {
			return nil, fmt.Errorf("data_base64 is not a string: %.40s", b64)
		}
		p, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			return nil, fmt.Errorf("data_base64 is not base64: %v", err)
		}
		return p, nil
	case hasData:
		// A JSON datacontenttype (or none: JSON by default) means the value
		// is the payload; any other type is carried as a JSON string
		// holding the text. As in the CloudEvents SDK for Go, only
		// application/json and text/json count as JSON here: it writes the
		// data of a +json type as a string.
		if data[0] == '"' && !jsonContentType(ev["datacontenttype"]) {
			var s string
			if err := json.Unmarshal(data, &s); err != nil {
				return nil, fmt.Errorf("data: %v", err)
			}
			return []byte(s), nil
		}
		return bytes.Clone(data), nil
	}
	return []byte{}, nil
}

// jsonContentType says whether an envelope's datacontenttype member names
// JSON data: absent (CloudEvents reads that as JSON), application/json or
// text/json.
func jsonContentType(raw json.RawMessage) bool {
	if raw == nil {
		return true
	}
	var ct string
	if json.Unmarshal(raw, &ct) != nil {
		return false
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil && !errors.Is(err, mime.ErrInvalidMediaParameter) {
		return false
	}
	return mt == wire.MediaJSON || mt == "text/json"
}

func orMissing(raw json.RawMessage) string {
	if raw == nil {
		return "missing"
	}
	return string(raw)
}
