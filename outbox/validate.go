package outbox

import (
	"encoding/json"
	"fmt"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Validate checks m with the rules the relay applies when it publishes, and
// says what to fix. Enqueue calls it; it is exported for callers that build
// messages long before they enqueue them.
func (m Message) Validate() error {
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
	for _, k := range sortedKeys(m.Headers) {
		if err := wire.ValidateHeader(k, m.Headers[k]); err != nil {
			return fmt.Errorf("%w: work_id %q: %v", ErrInvalid, m.WorkID, err)
		}
	}
	return nil
}
