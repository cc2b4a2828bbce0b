package wire

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/url"
	"slices"
	"strings"
	"time"
	"unicode/utf8"
)

// Mode is how a message carries its row (run --message-format).
type Mode uint8

const (
	// ModeOutbox is the relay's own format: the payload as the data, the
	// row's facts as Outbox-* headers.
	ModeOutbox Mode = iota
	// ModeCloudEvents adds the CloudEvents attributes as ce-* headers
	// (the NATS binding's binary content mode); the data is the payload.
	ModeCloudEvents
	// ModeCloudEventsStructured makes the data an application/cloudevents+json
	// envelope holding the attributes and the payload (structured content
	// mode), for consumers such as Dapr that expect one.
	ModeCloudEventsStructured
)

// Modes are the values of --message-format, in Mode order.
var Modes = []string{"outbox", "cloudevents", "cloudevents-structured"}

func (m Mode) String() string {
	if int(m) < len(Modes) {
		return Modes[m]
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// ParseMode reads --message-format.
func ParseMode(s string) (Mode, error) {
	for i, name := range Modes {
		if s == name {
			return Mode(i), nil
		}
	}
	return 0, fmt.Errorf("--message-format %q: want %s", s, strings.Join(Modes, ", "))
}

// CloudEvents names: the attributes the relay sets (DESIGN.md, "The
// message"), their ce-* headers in binary mode, and the media types.
const (
	HeaderContentType = "Content-Type"
	// CEHeaderPrefix is the NATS binding's prefix of an attribute's header.
	CEHeaderPrefix = "ce-"
	// CESpecVersion is the CloudEvents version the relay writes.
	CESpecVersion = "1.0"
	// MediaCloudEventsJSON is a structured event's Content-Type.
	MediaCloudEventsJSON = "application/cloudevents+json"
	// MediaJSON and MediaOctetStream are a payload's content type when the
	// row names none: JSON for jsonb and json payloads, bytes for bytea.
	MediaJSON        = "application/json"
	MediaOctetStream = "application/octet-stream"
)

// CEAttributes are the attributes the relay sets from the row. A row's own
// ce-* header may add an extension or an optional attribute (subject,
// dataschema), never one of these.
var CEAttributes = []string{"specversion", "id", "source", "type", "time", "datacontenttype", "partitionkey", "sequence"}

// ceSeqDigits pads the sequence extension, which CloudEvents compares as a
// string: 19 digits hold every int64, so string order is number order.
const ceSeqDigits = 19

// Format is how rows become messages: one value shared by both paths and
// by republish, so a row's every message has the same attributes and, in
// structured mode, the same envelope.
type Format struct {
	SubjectPrefix string
	Mode          Mode
	// Source is the CloudEvents source attribute (--cloudevents-source).
	Source string
}

// DefaultCloudEventsSource is the source attribute when
// --cloudevents-source is not given: the relay, the database and the
// table, like Debezium's /debezium/<connector>/<server>.
func DefaultCloudEventsSource(database string, t string) string {
	return "/outbox-relay/" + url.PathEscape(database) + "/" + url.PathEscape(t)
}

// ValidateSource checks a CloudEvents source: a non-empty URI-reference
// that a header carries exactly.
func ValidateSource(s string) error {
	if s == "" {
		return errors.New("--cloudevents-source is empty: CloudEvents requires a source, e.g. /outbox-relay/shop/public.outbox")
	}
	if _, err := url.Parse(s); err != nil {
		return fmt.Errorf("--cloudevents-source %q is not a URI-reference: %v", s, err)
	}
	if err := headerText(s, false); err != nil {
		return fmt.Errorf("--cloudevents-source %q %v, so the ce-source header cannot carry it", s, err)
	}
	return nil
}

// Validate checks f once, at start.
func (f Format) Validate() error {
	if f.Mode > ModeCloudEventsStructured {
		return fmt.Errorf("message format %s: unknown", f.Mode)
	}
	if f.Mode != ModeOutbox {
		return ValidateSource(f.Source)
	}
	return nil
}

// Build turns a row into its message in f (see BuildMessageShared for the
// checks and for extra).
func (f Format) Build(r Row, extra map[string][]string) (*Message, error) {
	if f.Mode == ModeOutbox {
		return BuildMessageShared(r, f.SubjectPrefix, extra)
	}
	return buildMessage(r, f.SubjectPrefix, extra, &f)
}

// cloudEvent adds the row's CloudEvents attributes to hdr (binary mode) or
// makes the envelope the message's data (structured mode). hdr holds the
// row's own headers and the relay's; it returns the data.
func (f *Format) cloudEvent(r *Row, hdr map[string][]string) ([]byte, error) {
	// The row's content type: its own Content-Type header, in any case, or
	// what its payload column holds.
	ct, ctKey := "", ""
	var ext []string // the row's ce-* headers, by name
	for k, vs := range hdr {
		switch {
		case strings.EqualFold(k, HeaderContentType):
			if ctKey != "" {
				return nil, fmt.Errorf("row %s: headers %q and %q both set the content type; keep one", r.WorkID, ctKey, k)
			}
			ct, ctKey = vs[0], k
		case strings.HasPrefix(k, CEHeaderPrefix):
			name := k[len(CEHeaderPrefix):]
			if err := validExtension(name, vs[0]); err != nil {
				return nil, fmt.Errorf("row %s: header %q: %w", r.WorkID, k, err)
			}
			ext = append(ext, k)
		}
	}
	if ctKey != "" {
		if _, _, err := mime.ParseMediaType(ct); err != nil {
			return nil, fmt.Errorf("row %s: header %q: %q is not a media type (RFC 2046, e.g. application/x-protobuf): %v", r.WorkID, ctKey, ct, err)
		}
	} else if r.Binary {
		ct = MediaOctetStream
	} else {
		ct = MediaJSON
	}
	var at string
	if !r.CreatedAt.IsZero() {
		if err := ValidateTime("created_at", r.CreatedAt); err != nil {
			return nil, fmt.Errorf("row %s: %w; the CloudEvents time attribute is created_at", r.WorkID, err)
		}
		at = r.CreatedAt.UTC().Format(time.RFC3339Nano)
	}
	var partition, seq string
	if r.AggregateSeq != 0 {
		partition = r.AggregateType + "/" + r.AggregateID
		seq = fmt.Sprintf("%0*d", ceSeqDigits, r.AggregateSeq)
	}

	if f.Mode == ModeCloudEvents {
		set := func(name, v string) { hdr[CEHeaderPrefix+name] = []string{v} }
		set("specversion", CESpecVersion)
		set("id", r.WorkID)
		set("source", f.Source)
		set("type", r.Kind)
		set("datacontenttype", ct)
		if at != "" {
			set("time", at)
		}
		if partition != "" {
			set("partitionkey", partition)
			set("sequence", seq)
		}
		if ctKey == "" {
			hdr[HeaderContentType] = []string{ct}
		}
		return r.Payload, nil
	}

	// Structured: the envelope is the data and says what it is; the row's
	// content type moves into it.
	if ctKey != "" {
		delete(hdr, ctKey)
	}
	hdr[HeaderContentType] = []string{MediaCloudEventsJSON}
	b := make([]byte, 0, len(r.Payload)*4/3+256+len(f.Source)+len(r.WorkID)+len(r.Kind))
	b = append(b, `{"specversion":"1.0","id":`...)
	b = appendJSONString(b, r.WorkID)
	b = append(b, `,"source":`...)
	b = appendJSONString(b, f.Source)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, r.Kind)
	if at != "" {
		b = append(b, `,"time":`...)
		b = appendJSONString(b, at)
	}
	b = append(b, `,"datacontenttype":`...)
	b = appendJSONString(b, ct)
	if partition != "" {
		b = append(b, `,"partitionkey":`...)
		b = appendJSONString(b, partition)
		b = append(b, `,"sequence":`...)
		b = appendJSONString(b, seq)
	}
	slices.Sort(ext)
	for _, k := range ext {
		b = append(b, ',')
		b = appendJSONString(b, k[len(CEHeaderPrefix):])
		b = append(b, ':')
		b = appendJSONString(b, hdr[k][0])
	}
	if embedsAsJSON(ct, r) {
		b = append(b, `,"data":`...)
		b = append(b, r.Payload...)
	} else {
		b = append(b, `,"data_base64":"`...)
		b = base64.StdEncoding.AppendEncode(b, r.Payload)
		b = append(b, '"')
	}
	return append(b, '}'), nil
}

// embedsAsJSON says whether the payload goes into the envelope as a JSON
// value ("data") rather than as base64 ("data_base64"): only when the
// content type is application/json or text/json and the bytes are a JSON
// text that a reader hands back unchanged. The CloudEvents SDK for Go reads
// the data of any other type, +json ones included, as a JSON string, and a
// JSON reader drops whitespace around a value: such payloads keep their
// exact bytes in data_base64.
func embedsAsJSON(ct string, r *Row) bool {
	mt, _, _ := mime.ParseMediaType(ct)
	if mt != MediaJSON && mt != "text/json" {
		return false
	}
	p := r.Payload
	if len(p) == 0 || isJSONSpace(p[0]) || isJSONSpace(p[len(p)-1]) {
		return false
	}
	if r.Binary {
		return utf8.Valid(p) && json.Valid(p)
	}
	// jsonb's text, or a json column's, which PostgreSQL checked.
	return json.Valid(p)
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// validExtension checks a row's ce-<name> header: an attribute name
// CloudEvents allows (lower-case letters and digits, RFC: at most 20),
// not one the relay sets, and for dataschema a URI.
func validExtension(name, value string) error {
	for _, a := range CEAttributes {
		if name == a {
			return fmt.Errorf("the %s attribute is the relay's (from the row: %s); remove the header", name, ceFrom(name))
		}
	}
	if name == "data" || name == "data_base64" || name == "" || len(name) > 20 {
		return fmt.Errorf("%q is not a CloudEvents extension name (1 to 20 lower-case letters or digits, not data)", name)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
			return fmt.Errorf("%q is not a CloudEvents extension name: only lower-case letters and digits", name)
		}
	}
	if value == "" {
		return errors.New("an attribute's value may not be empty")
	}
	if name == "dataschema" {
		if _, err := url.Parse(value); err != nil {
			return fmt.Errorf("dataschema %q is not a URI: %v", value, err)
		}
	}
	return nil
}

func ceFrom(name string) string {
	switch name {
	case "id":
		return "work_id"
	case "type":
		return "kind"
	case "time":
		return "created_at"
	case "source":
		return "--cloudevents-source"
	case "datacontenttype":
		return "the Content-Type header, or the payload's column type"
	case "partitionkey", "sequence":
		return "the aggregate and its sequence"
	}
	return "fixed"
}

// appendJSONString appends s as a JSON string. Every string here passed
// headerText (valid UTF-8, no control characters), so only the quote and
// the backslash need escaping.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '"', '\\':
			b = append(b, '\\', c)
		default:
			if c < 0x20 {
				b = append(b, `\u00`...)
				b = append(b, "0123456789abcdef"[c>>4], "0123456789abcdef"[c&0xf])
				continue
			}
			b = append(b, c)
		}
	}
	return append(b, '"')
}
