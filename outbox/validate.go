package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"strings"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Validate checks m with the rules the relay applies when it publishes, and
// says what to fix. It is exported for callers that build messages long
// before they enqueue them.
//
// Validate does not know the table, so it checks the payload as JSON unless
// the message's content type (ContentType, or a Content-Type header) is a
// media type other than JSON (application/json, text/json, */*+json): a
// Protobuf message with ContentType application/x-protobuf passes, and may
// be empty. Enqueue and EnqueueBatch check the payload against the table's
// payload column instead: JSON for jsonb and json, any bytes for bytea
// (JSON again when the content type says JSON).
func (m Message) Validate() error {
	if err := m.validateFields(); err != nil {
		return err
	}
	if m.declaresOther() {
		return nil
	}
	return m.validateJSON()
}

// validateFields checks everything but the payload, which needs the table's
// payload type.
func (m Message) validateFields() error {
	if err := wire.ValidateWorkID(m.WorkID); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := wire.ValidateKind(m.Kind); err != nil {
		return fmt.Errorf("%w: work_id %q: %v", ErrInvalid, m.WorkID, err)
	}
	if m.Subject != "" {
		if err := wire.ValidateSubject(m.Subject); err != nil {
			return fmt.Errorf("%w: work_id %q: %v; NATS would refuse to publish it", ErrInvalid, m.WorkID, err)
		}
	} else if err := wire.ValidateSubject(m.Kind); err != nil {
		// The relay publishes to <subject-prefix><kind>; the prefix is valid
		// and ends in a dot, so the kind's tokens must be valid ones.
		return fmt.Errorf("%w: work_id %q: kind %q cannot form the default subject <subject-prefix><kind>: %v; change the kind or set Subject", ErrInvalid, m.WorkID, m.Kind, err)
	}
	if m.Aggregate != (Aggregate{}) || m.Sequence != 0 {
		seq := m.Sequence
		if seq == 0 {
			seq = 1 // taken from the counter
		}
		if err := wire.ValidateAggregate(m.Aggregate.Type, m.Aggregate.ID, seq); err != nil {
			return fmt.Errorf("%w: work_id %q: %v", ErrInvalid, m.WorkID, err)
		}
	}
	// The table refuses other times at insert (migration 0008); checked
	// here too, so the caller learns it before its transaction does.
	if !m.AvailableAt.IsZero() {
		if err := wire.ValidateTime("AvailableAt", m.AvailableAt); err != nil {
			return fmt.Errorf("%w: work_id %q: %v", ErrInvalid, m.WorkID, err)
		}
	}
	if !m.ExpiresAt.IsZero() {
		if err := wire.ValidateTime("ExpiresAt", m.ExpiresAt); err != nil {
			return fmt.Errorf("%w: work_id %q: %v", ErrInvalid, m.WorkID, err)
		}
	}
	for _, k := range sortedKeys(m.Headers) {
		if err := wire.ValidateHeader(k, m.Headers[k]); err != nil {
			return fmt.Errorf("%w: work_id %q: %v", ErrInvalid, m.WorkID, err)
		}
	}
	if m.ContentType != "" {
		if err := wire.ValidateHeader(wire.HeaderContentType, m.ContentType); err != nil {
			return fmt.Errorf("%w: work_id %q: ContentType: %v", ErrInvalid, m.WorkID, err)
		}
		mt, _, err := mime.ParseMediaType(m.ContentType)
		if err == nil && !strings.Contains(mt, "/") {
			err = errors.New("no subtype (want type/subtype)")
		}
		if err != nil {
			return fmt.Errorf("%w: work_id %q: ContentType %q is not a media type (RFC 2046, e.g. application/x-protobuf): %v", ErrInvalid, m.WorkID, m.ContentType, err)
		}
		for _, k := range sortedKeys(m.Headers) {
			if v := m.Headers[k]; strings.EqualFold(k, wire.HeaderContentType) && v != m.ContentType {
				return fmt.Errorf("%w: work_id %q: ContentType %q and header %q: %q disagree; set the content type once", ErrInvalid, m.WorkID, m.ContentType, k, v)
			}
		}
	}
	return nil
}

// validateJSON checks the payload as JSON, the rule for a jsonb or json
// table.
func (m Message) validateJSON() error {
	if len(m.Payload) == 0 {
		return fmt.Errorf("%w: work_id %q: payload is empty; want JSON, e.g. {}", ErrInvalid, m.WorkID)
	}
	if !json.Valid(m.Payload) {
		return fmt.Errorf("%w: work_id %q: payload is not valid JSON: %.80q", ErrInvalid, m.WorkID, m.Payload)
	}
	// json.Valid takes bytes that are not UTF-8, and a SQL_ASCII database
	// stores them: the relay would refuse the row.
	if err := wire.ValidatePayload(m.Payload); err != nil {
		return fmt.Errorf("%w: work_id %q: %v", ErrInvalid, m.WorkID, err)
	}
	return nil
}

// contentTypeHeader finds a Content-Type entry of Headers, in any case (the
// relay reads it so). With two, the first name in sort order.
func (m Message) contentTypeHeader() (name, value string, ok bool) {
	for _, k := range sortedKeys(m.Headers) {
		if strings.EqualFold(k, wire.HeaderContentType) {
			return k, m.Headers[k], true
		}
	}
	return "", "", false
}

// contentType is the message's content type: ContentType, else a
// Content-Type header; "" when neither is set.
func (m Message) contentType() string {
	if m.ContentType != "" {
		return m.ContentType
	}
	_, v, _ := m.contentTypeHeader()
	return v
}

// declaresOther says whether the message's content type is a media type
// other than JSON (application/json, text/json, */*+json, with any
// parameters). No content type, or a header value that is no media type,
// declares nothing.
func (m Message) declaresOther() bool {
	mt := m.mediaType()
	return mt != "" && !isJSONType(mt)
}

// declaresJSON says whether the message's content type is JSON's.
func (m Message) declaresJSON() bool {
	mt := m.mediaType()
	return mt != "" && isJSONType(mt)
}

// mediaType is the message's content type without parameters, lower case;
// "" when none is set or it is no media type (type/subtype).
func (m Message) mediaType() string {
	mt, _, err := mime.ParseMediaType(m.contentType())
	if err != nil || !strings.Contains(mt, "/") {
		return ""
	}
	return mt
}

func isJSONType(mt string) bool {
	return mt == "application/json" || mt == "text/json" || strings.HasSuffix(mt, "+json")
}
