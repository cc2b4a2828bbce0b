package wire_test

import (
	"encoding/json"
	"errors"
	"net/textproto"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/internal/wire/wiretest"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

func TestSubjectRules(t *testing.T) {
	for s, want := range map[string]string{
		"a": "", "outbox.order.received": "", "a-b_c": "", "a/b": "", "ä.ö": "", "a*": "", "a>": "", "x.$JS": "", "_INBOXES.x": "",
		"": "empty", "a b": "whitespace", "a\tb": "whitespace", "a\nb": "whitespace", " a": "whitespace", "a\x00b": "control", "a\x7fb": "control",
		"a.": "empty token", ".a": "empty token", "a..b": "empty token", "*": "wildcard", ">": "wildcard", "a.*.b": "wildcard", "a.>": "wildcard",
		strings.Repeat("x.", 200) + "y": "byte limit",
		"$JS.API.STREAM.DELETE.OUTBOX":  "namespace", "$JS.API.STREAM.PURGE.VICTIM": "namespace", "$SYS.REQ.SERVER.PING": "namespace",
		"$KV.bucket.key": "namespace", "$G": "namespace", "_INBOX.abc": "namespace", "_INBOX": "namespace",
	} {
		err := wire.ValidateSubject(s)
		if want == "" {
			if err != nil {
				t.Errorf("subject %q: %v, want valid", s, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("subject %q: %v, want an error mentioning %q", s, err, want)
		}
		if want == "namespace" && !errors.Is(err, wire.ErrReservedSubject) {
			t.Errorf("subject %q: %v, want ErrReservedSubject", s, err)
		}
		// The sink applies the same rule: one definition.
		if natssink.ValidateSubject(s) == nil {
			t.Errorf("subject %q: the sink takes it", s)
		}
	}
}

// BuildMessage refuses a row's header exactly when ValidateHeader does: the
// producer (package outbox) refuses what the relay would.
func TestBuildMessageAgreesWithValidateHeader(t *testing.T) {
	type hc struct{ name, value string }
	cases := []hc{
		{"traceparent", "00-1-2-01"}, {"X-Tenant", "a b"}, {"x", ""}, {"", "v"}, {"a:b", "v"}, {"a b", "v"},
		{"a\tb", "v"}, {"a\nb", "v"}, {"a", "x\ny"}, {"a", "x\ry"}, {"a", "tab\tok"}, {"Nats-Msg-Id", "v"},
		{"nats-expected-stream", "v"}, {"NATS-ROLLUP", "all"}, {"Outbox-Kind", "v"}, {"outbox-anything", "v"},
		{"Natsy", "v"}, {"Outboxed", "v"}, {"X-Nats-Thing", "v"}, {"ümlaut", "v"}, {"a\x01", "v"}, {"a/b", "v"},
		{"a", " lead"}, {"a", "trail "}, {"a", "x\x00y"}, {"a", "x\x1b[2Ky"}, {"a", "日本"}, {strings.Repeat("h", 257), "v"},
	}
	for _, c := range cases {
		ours := wire.ValidateHeader(c.name, c.value)
		hdr, err := json.Marshal(map[string]string{c.name: c.value})
		if err != nil {
			t.Fatal(err)
		}
		_, theirs := wire.BuildMessage(wire.Row{WorkID: "w", Kind: "k", Payload: []byte(`{}`), Headers: hdr}, "outbox.", nil)
		if (ours == nil) != (theirs == nil) {
			t.Errorf("header %q=%q: ValidateHeader says %v, BuildMessage says %v", c.name, c.value, ours, theirs)
		}
		if re, ok := wire.IsRejected(theirs); theirs != nil && (!ok || re.Reason != wire.ReasonInvalidHeader) {
			t.Errorf("header %q=%q: BuildMessage returned %v, want a rejection with reason %s", c.name, c.value, theirs, wire.ReasonInvalidHeader)
		}
	}
}

// The reproductions of issue 16 that BuildMessage decides alone.
func TestBuildMessageRefusesHostileRows(t *testing.T) {
	big := map[string]string{}
	for i := range 100 {
		big[strings.Repeat("h", 8)+string(rune('a'+i%26))+string(rune('a'+i/26))] = strings.Repeat("v", 1000)
	}
	bigHeaders, _ := json.Marshal(big)
	for _, c := range []struct {
		name   string
		row    wire.Row
		reason string
	}{
		{"trailing space", wire.Row{WorkID: "col-x ", Kind: "k"}, wire.ReasonInvalidWorkID},
		{"trailing newline", wire.Row{WorkID: "col-x\n", Kind: "k"}, wire.ReasonInvalidWorkID},
		{"leading tab", wire.Row{WorkID: "\tcol-x", Kind: "k"}, wire.ReasonInvalidWorkID},
		{"blank", wire.Row{WorkID: " ", Kind: "k"}, wire.ReasonInvalidWorkID},
		{"empty", wire.Row{WorkID: "", Kind: "k"}, wire.ReasonInvalidWorkID},
		{"70 KB work_id", wire.Row{WorkID: strings.Repeat("w", 70<<10), Kind: "k"}, wire.ReasonInvalidWorkID},
		{"70 KB kind, explicit subject", wire.Row{WorkID: "w", Kind: strings.Repeat("k", 70<<10), Subject: "outbox.x"}, wire.ReasonInvalidKind},
		{"kind with CRLF", wire.Row{WorkID: "w", Kind: "k\r\nNats-Rollup: all", Subject: "outbox.x"}, wire.ReasonInvalidKind},
		{"100 headers of 1,000 bytes", wire.Row{WorkID: "w", Kind: "k", Headers: bigHeaders}, wire.ReasonHeaderTooLarge},
		{"JetStream API subject", wire.Row{WorkID: "w", Kind: "k", Subject: "$JS.API.STREAM.DELETE.OUTBOX"}, wire.ReasonReservedSubject},
		{"kind that cannot form a subject", wire.Row{WorkID: "w", Kind: "order received"}, wire.ReasonInvalidSubject},
		{"inbox subject", wire.Row{WorkID: "w", Kind: "k", Subject: "_INBOX.abc"}, wire.ReasonReservedSubject},
		{"non-ASCII header name", wire.Row{WorkID: "w", Kind: "k", Headers: []byte(`{"ümlaut":"v"}`)}, wire.ReasonInvalidHeader},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.row.Payload = []byte(`{}`)
			_, err := wire.BuildMessage(c.row, "outbox.", nil)
			re, ok := wire.IsRejected(err)
			if !ok || re.Reason != c.reason {
				t.Fatalf("BuildMessage = %v, want a rejection with reason %s", err, c.reason)
			}
		})
	}
}

// FuzzBuildMessage: whatever a row holds, BuildMessage either refuses it
// with a reason or builds a message that the NATS client sends unchanged:
// the ID is the work ID, every header value survives the client's trimming
// and line-break rewriting, every name is one the client accepts, the
// header block fits the broker's limit, and the subject is a valid one
// outside the server's namespaces.
func FuzzBuildMessage(f *testing.F) {
	for _, s := range [][4]string{
		{"col-x", "k", "", `{"traceparent":"00-1"}`}, {"col-x ", "k", "", ""}, {"col-x\n", "k", "", ""}, {"\tcol-x", "k", "", ""},
		{" ", "k", "", ""}, {"w", "k\r\n", "outbox.x", ""}, {"w", "k", "$JS.API.STREAM.DELETE.OUTBOX", ""}, {"w", "k", "_INBOX.x", ""},
		{"w", "k", "", `{"ü":"v"}`}, {"w", "k", "", `{"a":" v"}`}, {"w", "k", "", `{"a":1}`}, {"w", "$JS.API.INFO", "", ""},
		{"x\x1b[2K\r\nredrove 0 rows; all good", "k", "", ""}, {"w", "k", "", `{"Nats-Msg-Id":"other"}`},
	} {
		f.Add(s[0], s[1], s[2], s[3])
	}
	f.Fuzz(func(t *testing.T, workID, kind, subject, headers string) {
		row := wire.Row{WorkID: workID, Kind: kind, Subject: subject, Payload: []byte(`{}`)}
		if headers != "" {
			row.Headers = []byte(headers)
		}
		m, err := wire.BuildMessage(row, "outbox.", map[string]string{wire.HeaderAttempt: "1"})
		if err != nil {
			if re, ok := wire.IsRejected(err); !ok || re.Reason == "" {
				t.Fatalf("error %v is not a rejection with a reason", err)
			}
			return
		}
		if m.ID != workID {
			t.Fatalf("message ID %q, want the work ID %q", m.ID, workID)
		}
		if err := wire.ValidateSubject(m.Subject); err != nil {
			t.Fatalf("built a message with subject %q: %v", m.Subject, err)
		}
		sent := func(v string) string {
			return strings.NewReplacer("\r", " ", "\n", " ").Replace(textproto.TrimString(v))
		}
		if sent(workID) != workID || !utf8.ValidString(workID) {
			t.Fatalf("work ID %q would arrive as %q", workID, sent(workID))
		}
		for k, vs := range m.Header {
			if k == "" || strings.ContainsAny(k, "\"()/,:;<=>?@[\\]{} \t\r\n") {
				t.Fatalf("header name %q would be refused by the client", k)
			}
			for _, c := range []byte(k) {
				if c < 33 || c > 126 {
					t.Fatalf("header name %q would be refused by the client", k)
				}
			}
			for _, v := range vs {
				if sent(v) != v {
					t.Fatalf("header %s=%q would arrive as %q", k, v, sent(v))
				}
			}
		}
		if m.Header[wire.HeaderKind][0] != kind {
			t.Fatalf("Outbox-Kind %q, want %q", m.Header[wire.HeaderKind][0], kind)
		}
		if n := wire.HeaderBlockSize(m.ID, m.Header); n > wire.MaxHeaderBytes {
			t.Fatalf("header block of %d bytes", n)
		}
	})
}

// Each bounded rule takes a value exactly when it is 1 to limit bytes,
// compared at limit-1, limit and limit+1 with multi-byte characters ending
// at and straddling the limit: a rule off by one or counting characters
// fails here. The table's CHECKs are compared with these rules at the same
// values in internal/store (TestTableChecksMatchTheRelay), the broker in
// sinks/jetstream (TestRowsAtTheLimitsRoundTrip).
func TestRulesAtTheLimits(t *testing.T) {
	ascii := func(s string) bool {
		for i := 0; i < len(s); i++ {
			if s[i] >= 0x80 {
				return false
			}
		}
		return true
	}
	for _, r := range []struct {
		name  string
		limit int
		rule  func(string) error
		other func(string) bool // besides the length
	}{
		{"work_id", wire.MaxWorkIDBytes, wire.ValidateWorkID, nil},
		{"kind", wire.MaxKindBytes, wire.ValidateKind, nil},
		{"aggregate_type", wire.MaxKindBytes, func(s string) error { return wire.ValidateAggregate(s, "a", 1) }, nil},
		{"aggregate_id", wire.MaxWorkIDBytes, func(s string) error { return wire.ValidateAggregate("t", s, 1) }, nil},
		{"subject", wire.MaxSubjectBytes, wire.ValidateSubject, nil},
		{"header name", 256, func(s string) error { return wire.ValidateHeader(s, "v") }, ascii},
	} {
		for _, v := range wiretest.AtLimit(r.limit) {
			want := v != "" && len(v) <= r.limit && (r.other == nil || r.other(v))
			if err := r.rule(v); (err == nil) != want {
				t.Errorf("%s of %d bytes (%d characters, limit %d): %v, want accepted=%v", r.name, len(v), utf8.RuneCountInString(v), r.limit, err, want)
			}
		}
	}
}

// Issue 30, item 11: a database with encoding SQL_ASCII stores any bytes in
// text and jsonb, so a row's payload or a header value can hold bytes that
// are not UTF-8. encoding/json turned such a header value into U+FFFD
// without an error (the message carried other text than the row), and the
// payload was published as it was (JSON must be UTF-8: receivers fail on
// it or read other characters). Both are refused with a reason, as a
// work ID that is not UTF-8 is; a key that is not UTF-8 too. And a header
// whose value is not a string says what it is in JSON's words (null, not
// Go's <nil>) and what to do.
func TestBuildMessageRefusesInvalidUTF8AndNonStringHeaders(t *testing.T) {
	for _, c := range []struct {
		name             string
		payload, headers string
		reason           string
		says             []string
	}{
		{"payload", "{\"a\":\"x\xffy\"}", "", "invalid_payload", []string{"payload", "not valid UTF-8", "offset 7 of 11", "SQL_ASCII"}},
		{"payload, bare byte", "\"\xc3\"", "", "invalid_payload", []string{"offset 1 of 3"}},
		{"header value", `{}`, "{\"traceparent\":\"00-\xfe-01\"}", wire.ReasonInvalidHeader, []string{`header "traceparent"`, "not valid UTF-8", "offset 3 of the value", "SQL_ASCII"}},
		{"header name", `{}`, "{\"x\xff\":\"v\"}", wire.ReasonInvalidHeader, []string{"not valid UTF-8"}},
		{"header null", `{}`, `{"traceparent":null}`, wire.ReasonInvalidHeader, []string{`header "traceparent"`, "is null", "header values must be strings; null is not one", "leave the header out"}},
		{"header number", `{}`, `{"n":1}`, wire.ReasonInvalidHeader, []string{"is a number", "header values must be strings"}},
		{"header object", `{}`, `{"n":{"a":"b"}}`, wire.ReasonInvalidHeader, []string{"is an object"}},
		{"header array", `{}`, `{"n":["a"]}`, wire.ReasonInvalidHeader, []string{"is an array"}},
		{"header boolean", `{}`, `{"n":true}`, wire.ReasonInvalidHeader, []string{"is a boolean"}},
		{"headers not an object", `{}`, `["a"]`, wire.ReasonInvalidHeader, []string{"not a JSON object of strings"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			row := wire.Row{WorkID: "w1", Kind: "k", Payload: []byte(c.payload)}
			if c.headers != "" {
				row.Headers = []byte(c.headers)
			}
			m, err := wire.BuildMessage(row, "outbox.", nil)
			re, ok := wire.IsRejected(err)
			if !ok || re.Reason != c.reason {
				var hdr any
				if m != nil {
					hdr = m.Header
				}
				t.Fatalf("BuildMessage = %v (headers %q), want a rejection with reason %s", err, hdr, c.reason)
			}
			for _, s := range c.says {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not say %q", err, s)
				}
			}
			if !utf8.ValidString(err.Error()) {
				t.Errorf("error %q is not valid UTF-8 itself (it goes into last_error)", err)
			}
		})
	}
	// Valid UTF-8 of every width is taken, byte for byte.
	payload := `{"a":"é日本😀"}`
	m, err := wire.BuildMessage(wire.Row{WorkID: "w1", Kind: "k", Payload: []byte(payload), Headers: []byte(`{"x":"é日本😀"}`)}, "outbox.", nil)
	if err != nil || string(m.Data) != payload || m.Header["x"][0] != "é日本😀" {
		t.Fatalf("valid UTF-8: %v, %+v", err, m)
	}
}
