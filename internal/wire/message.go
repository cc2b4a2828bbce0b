package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"time"
	"unicode/utf8"
)

// Message is one outbox row as the broker will store it: what BuildMessage
// makes of a row on either path, and what a sink publishes.
type Message struct {
	ID      string // the row's work_id; brokers dedupe on it (Nats-Msg-Id)
	Subject string
	Data    []byte
	Header  map[string][]string

	// Checked says the subject and every header were checked as a broker
	// takes them, and HeaderBytes is then the header block's size with the
	// ID (BuildMessage sets both), so a sink need not walk the headers
	// again for each message.
	Checked     bool
	HeaderBytes int

	// ExpiresAt is the row's business deadline (G13), zero when it has
	// none: a sink that can make the broker enforce it (Nats-TTL, G21)
	// works out the time left when it publishes.
	ExpiresAt time.Time
}

// Size is what the message counts against in-flight byte limits.
func (m *Message) Size() int {
	n := len(m.ID) + len(m.Subject) + len(m.Data)
	if m.Checked {
		return n + m.HeaderBytes
	}
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// RejectedError says a message can never be published as it is: the row
// breaks the format (BuildMessage), or the broker definitively refused it
// (payload too large, no stream bound to the subject). A known non-effect
// that retrying unchanged will not fix.
type RejectedError struct {
	Reason string // short, stable, for metrics: "max_payload", "no_stream", "invalid_subject", ...
	Err    error
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("rejected (%s): %v", e.Reason, e.Err)
}

func (e *RejectedError) Unwrap() error { return e.Err }

// IsRejected reports whether err is a definitive rejection and returns it.
func IsRejected(err error) (*RejectedError, bool) {
	var re *RejectedError
	ok := errors.As(err, &re)
	return re, ok
}

// Row is what a message is built from, on either path (CDC or poller).
type Row struct {
	WorkID, Kind, Subject string
	Payload, Headers      []byte
	// The aggregate and the row's sequence in it (G12); Seq 0: unordered.
	AggregateType, AggregateID string
	AggregateSeq               int64
	// The business deadline (G13); zero: none.
	ExpiresAt time.Time
	// CreatedAt is the row's created_at: the CloudEvents time attribute,
	// the same on every path and attempt. Zero: not known (omitted).
	CreatedAt time.Time
	// Binary says the payload column is bytea: the payload is bytes, not
	// text, published as they are, and application/octet-stream unless the
	// row's Content-Type header names its type.
	Binary bool
}

// Rejection reasons of a row that can never become a message as it is. They
// end up in last_error ("rejected: <reason>: ...") and in metric labels.
const (
	ReasonInvalidWorkID    = "invalid_work_id"
	ReasonInvalidKind      = "invalid_kind"
	ReasonInvalidSubject   = "invalid_subject"
	ReasonInvalidHeader    = "invalid_header"
	ReasonHeaderTooLarge   = "header_too_large"
	ReasonReservedSubject  = "reserved_subject"
	ReasonInvalidAggregate = "invalid_aggregate"
	ReasonInvalidDeadline  = "invalid_deadline"
	ReasonInvalidPayload   = "invalid_payload"
	// ReasonInvalidEvent: with --message-format cloudevents or
	// cloudevents-structured, the row cannot be a valid CloudEvent as it
	// is (a Content-Type that is no media type, a ce-* header naming an
	// attribute the relay sets, a created_at outside RFC 3339).
	ReasonInvalidEvent = "invalid_event"
	// ReasonRefused: the broker answered the message with an error the
	// relay has no name for (a 4xx answer at once; a failure it does not
	// recognise, for the same row again and again, after bounded tries):
	// that row's refusal, never an endless replay of the stream (G7).
	ReasonRefused = "refused"
)

// Reasons is every reason above: the one list docs checks hold the docs to.
var Reasons = []string{ReasonInvalidWorkID, ReasonInvalidKind, ReasonInvalidSubject, ReasonInvalidHeader,
	ReasonHeaderTooLarge, ReasonReservedSubject, ReasonInvalidAggregate, ReasonInvalidDeadline, ReasonInvalidPayload, ReasonInvalidEvent, ReasonRefused}

// BuildMessage turns a row into the message the broker stores: the payload's
// committed text as the data (G4), the subject column or prefix+kind, the
// row's headers, and the relay's own. extra holds path-specific headers.
//
// Everything a header carries is checked to arrive exactly as committed:
// the client trims and rewrites what it cannot encode, and the broker
// deduplicates on what arrives, so a work ID that does not survive the trip
// would be stored as another row's message. The error, always a
// *RejectedError, means the row can never be published as it is.
func BuildMessage(r Row, subjectPrefix string, extra map[string]string) (*Message, error) {
	return BuildMessageShared(r, subjectPrefix, SharedHeaders(extra))
}

// SharedHeaders turns path-specific headers into the form
// BuildMessageShared takes, so that headers common to many messages (the
// CDC path's commit position and time, the same for every row of a
// transaction) are built once.
func SharedHeaders(extra map[string]string) map[string][]string {
	out := make(map[string][]string, len(extra))
	for k, v := range extra {
		out[k] = []string{v}
	}
	return out
}

// BuildMessageShared is BuildMessage with the extra headers already built by
// SharedHeaders. Their value slices are shared by every message built from
// them, and nothing downstream writes to them.
func BuildMessageShared(r Row, subjectPrefix string, extra map[string][]string) (*Message, error) {
	return buildMessage(r, subjectPrefix, extra, nil)
}

// buildMessage builds in the relay's own format when ce is nil, else in
// ce's CloudEvents mode.
func buildMessage(r Row, subjectPrefix string, extra map[string][]string, ce *Format) (*Message, error) {
	if err := ValidateWorkID(r.WorkID); err != nil {
		return nil, &RejectedError{Reason: ReasonInvalidWorkID, Err: err}
	}
	if err := ValidateKind(r.Kind); err != nil {
		return nil, &RejectedError{Reason: ReasonInvalidKind, Err: fmt.Errorf("row %s: %w", r.WorkID, err)}
	}
	subject := r.Subject
	if subject == "" {
		subject = subjectPrefix + r.Kind
	}
	if err := ValidateSubject(subject); err != nil {
		reason := ReasonInvalidSubject
		if errors.Is(err, ErrReservedSubject) {
			reason = ReasonReservedSubject
		}
		return nil, &RejectedError{Reason: reason, Err: fmt.Errorf("row %s: %w", r.WorkID, err)}
	}
	if !r.Binary {
		if err := ValidatePayload(r.Payload); err != nil {
			return nil, &RejectedError{Reason: ReasonInvalidPayload, Err: fmt.Errorf("row %s: %w", r.WorkID, err)}
		}
	}
	hdr := make(map[string][]string, 5+len(extra))
	if len(r.Headers) > 0 {
		if err := userHeaders(r.Headers, hdr); err != nil {
			return nil, &RejectedError{Reason: ReasonInvalidHeader, Err: fmt.Errorf("row %s: %w", r.WorkID, err)}
		}
	}
	hdr[HeaderKind] = []string{r.Kind}
	if r.AggregateSeq != 0 || r.AggregateType != "" || r.AggregateID != "" {
		if err := ValidateAggregate(r.AggregateType, r.AggregateID, r.AggregateSeq); err != nil {
			return nil, &RejectedError{Reason: ReasonInvalidAggregate, Err: fmt.Errorf("row %s: %w", r.WorkID, err)}
		}
		hdr[HeaderAggregateType] = []string{r.AggregateType}
		hdr[HeaderAggregateID] = []string{r.AggregateID}
		hdr[HeaderSequence] = []string{strconv.FormatInt(r.AggregateSeq, 10)}
	}
	if !r.ExpiresAt.IsZero() {
		// A row inserted before migration 0008 may hold a deadline that
		// has no RFC 3339 form: publishing it would hand receivers a
		// header they must call malformed.
		if err := ValidateTime("expires_at", r.ExpiresAt); err != nil {
			return nil, &RejectedError{Reason: ReasonInvalidDeadline, Err: fmt.Errorf("row %s: %w; redrive it with a new deadline (--expires-at) or none (--no-deadline)", r.WorkID, err)}
		}
		hdr[HeaderExpiresAt] = []string{FormatDeadline(r.ExpiresAt)}
	}
	for k, v := range extra {
		hdr[k] = v
	}
	data := r.Payload
	if ce != nil {
		var err error
		if data, err = ce.cloudEvent(&r, hdr); err != nil {
			return nil, &RejectedError{Reason: ReasonInvalidEvent, Err: err}
		}
	}
	n := HeaderBlockSize(r.WorkID, hdr)
	if !r.ExpiresAt.IsZero() {
		n += ttlHeaderRoom
	}
	if n > MaxHeaderBytes {
		return nil, &RejectedError{Reason: ReasonHeaderTooLarge, Err: fmt.Errorf(
			"row %s: its headers take %d bytes, over JetStream's %d-byte limit for a message's header block: send fewer or shorter headers (%s)",
			r.WorkID, n, MaxHeaderBytes, largestHeaders(hdr))}
	}
	return &Message{ID: r.WorkID, Subject: subject, Data: data, Header: hdr, Checked: true, HeaderBytes: n, ExpiresAt: r.ExpiresAt}, nil
}

// notUTF8 says where a database can have taken bytes that are not UTF-8.
const notUTF8 = "a database whose encoding is SQL_ASCII stores any bytes unchecked (the relay warns at start); fix the producer, or move the table to a UTF8 database"

// ValidatePayload checks that a payload is text a receiver can read: JSON
// is UTF-8 (RFC 8259), and a receiver's parser refuses other bytes or reads
// other characters than the producer wrote. jsonb in a database of any
// other encoding than SQL_ASCII holds only valid text, which PostgreSQL
// hands the relay in UTF-8.
func ValidatePayload(p []byte) error {
	if utf8.Valid(p) {
		return nil
	}
	return fmt.Errorf("its payload is not valid UTF-8 (the byte at offset %d of %d), and JSON must be: %s", invalidAt(p), len(p), notUTF8)
}

// invalidAt is the offset of the first byte of p that is not UTF-8.
func invalidAt(p []byte) int {
	for i := 0; i < len(p); {
		r, n := utf8.DecodeRune(p[i:])
		if r == utf8.RuneError && n == 1 {
			return i
		}
		i += n
	}
	return len(p)
}

// userHeaders adds a row's headers (its headers column) to hdr, each
// checked by ValidateHeader. The values are decoded one by one from their
// raw JSON because encoding/json turns bytes that are not UTF-8 into
// U+FFFD without an error: the message would carry other text than the row.
func userHeaders(raw []byte, hdr map[string][]string) error {
	var user map[string]json.RawMessage
	if err := json.Unmarshal(raw, &user); err != nil {
		return fmt.Errorf("its headers are not a JSON object of strings: %w", err)
	}
	if !utf8.Valid(raw) {
		for k, v := range user {
			if !utf8.Valid(v) {
				return fmt.Errorf("header %q: its value is not valid UTF-8 (the byte at offset %d of the value): %s", k, invalidAt(bytes.TrimPrefix(v, []byte(`"`))), notUTF8)
			}
		}
		// Only a name is left; the decoded name shows U+FFFD for its bytes.
		return fmt.Errorf("its headers hold a header name that is not valid UTF-8 (the byte at offset %d of the headers): %s", invalidAt(raw), notUTF8)
	}
	for k, v := range user {
		var s string
		if kind := jsonKind(v); kind != "a string" || json.Unmarshal(v, &s) != nil {
			if kind != "null" {
				kind += fmt.Sprintf(" (%.40s)", v)
			}
			return fmt.Errorf("header %q is %s: header values must be strings; %s is not one: write it as a string, or leave the header out", k, kind, jsonKind(v))
		}
		if err := ValidateHeader(k, s); err != nil {
			return err
		}
		hdr[k] = []string{s}
	}
	return nil
}

// jsonKind names a JSON value's type in JSON's words, for an operator who
// wrote the row in SQL.
func jsonKind(v json.RawMessage) string {
	v = bytes.TrimSpace(v)
	if len(v) == 0 {
		return "empty"
	}
	switch v[0] {
	case 'n':
		return "null"
	case 't', 'f':
		return "a boolean"
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	}
	return "a number"
}

// FormatDeadline is how Outbox-Expires-At carries a deadline: RFC 3339 in
// UTC, to the microsecond PostgreSQL keeps. Every time ValidateTime accepts
// has a four-digit year, so the header always parses as RFC 3339.
func FormatDeadline(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// The range of times a row may hold (migration 0008, package outbox's
// Enqueue): what RFC 3339 can write, years 0001 to 9999 in UTC. MinTime is
// inclusive, MaxTime exclusive.
var (
	MinTime = time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)
	MaxTime = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)
)

// Infinity and NegInfinity stand for PostgreSQL's 'infinity' and
// '-infinity' where a time.Time must carry them (pgx refuses to scan them
// into one): just past the largest and just before the smallest timestamp
// PostgreSQL holds (294276 AD, 4714 BC), so no stored value is mistaken for
// them and every comparison with a finite time comes out as PostgreSQL's
// own would.
var (
	Infinity    = time.Date(294277, 1, 1, 0, 0, 0, 0, time.UTC)
	NegInfinity = time.Date(-4714, 1, 1, 0, 0, 0, 0, time.UTC)
)

// FormatTime writes t for an operator: RFC 3339 in UTC, or 'infinity' /
// '-infinity' for the stand-ins above.
func FormatTime(t time.Time) string {
	switch {
	case t.Equal(Infinity):
		return "infinity"
	case t.Equal(NegInfinity):
		return "-infinity"
	}
	return t.UTC().Format(time.RFC3339Nano)
}

// ValidateTime checks that a row's time column (named col) holds a value
// in [MinTime, MaxTime): finite, and writable as RFC 3339.
func ValidateTime(col string, t time.Time) error {
	if t.Before(MinTime) || !t.Before(MaxTime) {
		return fmt.Errorf("%s %s is out of range: a time must be finite and between 0001-01-01 and 9999-12-31 UTC, what RFC 3339 (and so %s) can carry", col, FormatTime(t), HeaderExpiresAt)
	}
	return nil
}

// ValidateAggregate checks a row's aggregate: type and ID set together, each
// carried exactly by a header (see ValidateKind), and a positive sequence.
func ValidateAggregate(typ, id string, seq int64) error {
	if typ == "" || id == "" || seq <= 0 {
		return fmt.Errorf("aggregate %q/%q with sequence %d: type, ID and a sequence of at least 1 go together", typ, id, seq)
	}
	if len(typ) > MaxKindBytes {
		return fmt.Errorf("aggregate type %.40q... is %d bytes, over the %d-byte limit", typ, len(typ), MaxKindBytes)
	}
	if len(id) > MaxWorkIDBytes {
		return fmt.Errorf("aggregate ID %.40q... is %d bytes, over the %d-byte limit", id, len(id), MaxWorkIDBytes)
	}
	if err := headerText(typ, false); err != nil {
		return fmt.Errorf("aggregate type %q %v, so the %s header cannot carry it exactly", typ, err, HeaderAggregateType)
	}
	if err := headerText(id, false); err != nil {
		return fmt.Errorf("aggregate ID %q %v, so the %s header cannot carry it exactly", id, err, HeaderAggregateID)
	}
	return nil
}

// MaxHeaderBytes is the largest header block a JetStream stream stores: more
// is refused with error 10097 ("header size exceeds maximum allowed of
// 64k"), on every attempt.
const MaxHeaderBytes = 65535

// HeaderBlockSize is the size of the header block the NATS client sends for
// these headers plus the Nats-Msg-Id and Nats-Expected-Stream that the sink
// adds: "NATS/1.0\r\n", "name: value\r\n" per value, and a closing
// "\r\n". The stream is counted with the longest name JetStream allows, so
// a row accepted here fits whatever stream it is published to.
func HeaderBlockSize(msgID string, hdr map[string][]string) int {
	n := len("NATS/1.0\r\n") + len("\r\n") + len(HeaderMsgID) + len(msgID) + 4 +
		len(HeaderExpectedStream) + MaxStreamNameBytes + 4
	for k, vs := range hdr {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

func largestHeaders(hdr map[string][]string) string {
	type kv struct {
		k string
		n int
	}
	var all []kv
	for k, vs := range hdr {
		n := 0
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
		all = append(all, kv{k, n})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].n > all[j].n || (all[i].n == all[j].n && all[i].k < all[j].k) })
	s := "largest:"
	for i, e := range all {
		if i == 3 {
			break
		}
		s += fmt.Sprintf(" %.40q %d B", e.k, e.n)
	}
	return s
}

// MaxWorkIDBytes bounds a work ID: it is a header value on every message, a
// primary key here and in the consumer's inbox (B-tree entries must fit a
// third of a page), and it is printed by operator commands.
const MaxWorkIDBytes = 1024

// MaxKindBytes bounds a kind, which is a header value and, without an
// explicit subject, part of the subject (MaxSubjectBytes).
const MaxKindBytes = 256

// ValidateWorkID checks that a work ID arrives at the broker exactly as
// committed. The NATS client trims leading and trailing whitespace from
// header values and turns CR and LF into spaces; the broker deduplicates on
// what arrives. 'col-x', 'col-x ' and 'col-x\n' would all be stored as one
// message, and the three later rows marked published with the first one's
// sequence: intentions lost and recorded as delivered.
func ValidateWorkID(s string) error {
	if s == "" {
		return errors.New("work_id is empty: it is the message ID the broker deduplicates on; derive it from the business fact, e.g. order-103-ack")
	}
	if len(s) > MaxWorkIDBytes {
		return fmt.Errorf("work_id %.40q... is %d bytes, over the %d-byte limit", s, len(s), MaxWorkIDBytes)
	}
	if err := headerText(s, false); err != nil {
		return fmt.Errorf("work_id %q %v, so the Nats-Msg-Id header cannot carry it exactly (the broker would deduplicate it against another ID): use printable characters with no space at either end", s, err)
	}
	return nil
}

// ValidateKind checks a kind: it is carried in the Outbox-Kind header.
func ValidateKind(s string) error {
	if s == "" {
		return errors.New("kind is empty: say what the work is, e.g. order.received")
	}
	if len(s) > MaxKindBytes {
		return fmt.Errorf("kind %.40q... is %d bytes, over the %d-byte limit", s, len(s), MaxKindBytes)
	}
	if err := headerText(s, false); err != nil {
		return fmt.Errorf("kind %q %v, so the %s header cannot carry it exactly: use printable characters with no space at either end", s, err, HeaderKind)
	}
	return nil
}

// headerText checks that s survives as a NATS header value unchanged: valid
// UTF-8, no control characters (a tab inside only where tabOK), and no
// leading or trailing whitespace, which the client trims.
func headerText(s string, tabOK bool) error {
	if s == "" {
		return nil
	}
	if !utf8.ValidString(s) {
		return errors.New("is not valid UTF-8")
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == '\t' && tabOK {
			continue
		}
		if c < 0x20 || c == 0x7f {
			return fmt.Errorf("holds the control character %q at byte %d", c, i)
		}
	}
	if isSpace(s[0]) || isSpace(s[len(s)-1]) {
		return errors.New("starts or ends with whitespace")
	}
	return nil
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' }
