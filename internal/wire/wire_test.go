package wire_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// The producer validates with this package; the relay with its own code.
// These tests feed both the same cases, so a change to either side that makes
// them disagree fails here.

func TestSubjectRulesMatchTheSink(t *testing.T) {
	cases := []string{
		"", "a", "outbox.order.received", "a.b.c.d", "a b", "a\tb", "a\nb", " a", "a.", ".a", "a..b",
		"*", ">", "a.*", "a.>", "a.*.b", "a*", "a>", "a.b*", "ä.ö", "a-b_c", "a/b", strings.Repeat("x.", 200) + "y",
	}
	for _, s := range cases {
		ours, theirs := wire.ValidateSubject(s), natssink.ValidateSubject(s)
		if (ours == nil) != (theirs == nil) {
			t.Errorf("subject %q: wire says %v, the sink says %v", s, ours, theirs)
		}
	}
}

func TestHeaderRulesMatchTheRelay(t *testing.T) {
	type hc struct{ name, value string }
	cases := []hc{
		{"traceparent", "00-1-2-01"}, {"X-Tenant", "a b"}, {"x", ""}, {"", "v"}, {"a:b", "v"}, {"a b", "v"},
		{"a\tb", "v"}, {"a\nb", "v"}, {"a", "x\ny"}, {"a", "x\ry"}, {"a", "tab\tok"}, {"Nats-Msg-Id", "v"},
		{"nats-expected-stream", "v"}, {"NATS-ROLLUP", "all"}, {"Outbox-Kind", "v"}, {"outbox-anything", "v"},
		{"Natsy", "v"}, {"Outboxed", "v"}, {"X-Nats-Thing", "v"}, {"ümlaut", "v"},
	}
	for _, c := range cases {
		ours := wire.ValidateHeader(c.name, c.value)
		hdr, err := json.Marshal(map[string]string{c.name: c.value})
		if err != nil {
			t.Fatal(err)
		}
		_, theirs := relay.BuildMessage(relay.MessageFields{WorkID: "w", Kind: "k", Payload: []byte(`{}`), Headers: hdr}, "outbox.", nil)
		if (ours == nil) != (theirs == nil) {
			t.Errorf("header %q=%q: wire says %v, the relay says %v", c.name, c.value, ours, theirs)
		}
	}
}

func TestHeaderNamesMatchTheRelay(t *testing.T) {
	for ours, theirs := range map[string]string{
		wire.HeaderKind: relay.HeaderKind, wire.HeaderCommitLSN: relay.HeaderCommitLSN, wire.HeaderCommitTime: relay.HeaderCommitTime,
		wire.HeaderAttempt: relay.HeaderAttempt, wire.HeaderClaimGeneration: relay.HeaderClaimGeneration,
	} {
		if ours != theirs {
			t.Errorf("wire has %q where the relay has %q", ours, theirs)
		}
	}
}
