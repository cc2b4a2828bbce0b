package relay

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// Header names of the message format (DESIGN.md, "The message"); one
// definition in internal/wire, shared with the producer and inbox packages.
const (
	HeaderKind            = wire.HeaderKind
	HeaderCommitLSN       = wire.HeaderCommitLSN
	HeaderCommitTime      = wire.HeaderCommitTime
	HeaderAttempt         = wire.HeaderAttempt
	HeaderClaimGeneration = wire.HeaderClaimGeneration
)

// MessageFields is what a message is built from, on either path.
type MessageFields struct {
	WorkID, Kind, Subject string
	Payload, Headers      []byte
}

// BuildMessage turns a row into the message the broker stores: the payload's
// committed text as the data (G4), the subject column or prefix+kind, the
// row's headers, and the relay's own. extra holds path-specific headers.
// An error means the row can never be published as it is (a rejection).
func BuildMessage(f MessageFields, subjectPrefix string, extra map[string]string) (*sinks.Message, error) {
	subject := f.Subject
	if subject == "" {
		subject = subjectPrefix + f.Kind
	}
	hdr := make(map[string][]string, 4+len(extra))
	if len(f.Headers) > 0 {
		var user map[string]any
		if err := json.Unmarshal(f.Headers, &user); err != nil {
			return nil, fmt.Errorf("headers of %s are not a JSON object of strings: %w", f.WorkID, err)
		}
		for k, v := range user {
			s, ok := v.(string)
			if !ok {
				return nil, fmt.Errorf("header %q of %s is a JSON %T, not a string", k, f.WorkID, v)
			}
			if err := wire.ValidateHeader(k, s); err != nil {
				return nil, fmt.Errorf("row %s: %w", f.WorkID, err)
			}
			hdr[k] = []string{s}
		}
	}
	hdr[HeaderKind] = []string{f.Kind}
	for k, v := range extra {
		hdr[k] = []string{v}
	}
	return &sinks.Message{ID: f.WorkID, Subject: subject, Data: f.Payload, Header: hdr}, nil
}

// CDCHeaders are the CDC path's headers: where and when the row committed,
// so a consumer can detect order changes after a broker fault.
func CDCHeaders(commitLSN pglogrepl.LSN, commitTime time.Time) map[string]string {
	return map[string]string{
		HeaderCommitLSN:  commitLSN.String(),
		HeaderCommitTime: commitTime.UTC().Format(time.RFC3339Nano),
	}
}
