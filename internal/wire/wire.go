// Package wire holds the message format's names and the rules a row must meet
// to become a NATS message: one definition used by the relay (BuildMessage,
// the JetStream sink's subject check) and by the packages applications import
// (outbox, inbox), so the producer refuses exactly what the relay would reject
// later, when it is too late to tell the caller.
package wire

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// Header names of the message format (DESIGN.md, "The message").
const (
	HeaderMsgID           = "Nats-Msg-Id"
	HeaderKind            = "Outbox-Kind"
	HeaderCommitLSN       = "Outbox-Commit-LSN"
	HeaderCommitTime      = "Outbox-Commit-Time"
	HeaderAttempt         = "Outbox-Attempt"
	HeaderClaimGeneration = "Outbox-Claim-Generation"
	// Rows with an aggregate (G12): the business object and the row's
	// position in its sequence, so receivers can detect gaps and stale
	// versions.
	HeaderAggregateType = "Outbox-Aggregate-Type"
	HeaderAggregateID   = "Outbox-Aggregate-Id"
	HeaderSequence      = "Outbox-Sequence"
	// Rows with a deadline (G13), RFC 3339 in UTC: receivers that must not
	// act late enforce it themselves.
	HeaderExpiresAt = "Outbox-Expires-At"
	// HeaderExpectedStream is set by the sink on every publish to the
	// stream it resolved for the subject: JetStream refuses the message
	// when the subject is bound to another stream by then.
	HeaderExpectedStream = "Nats-Expected-Stream"
	// HeaderTTL is set by the JetStream sink on a row with a deadline, on
	// a stream that allows per-message TTL (G21): the time left until the
	// deadline, in whole seconds rounded up, so the stream removes the
	// message once the deadline has passed.
	HeaderTTL = "Nats-TTL"
)

// ttlHeaderRoom is what a Nats-TTL header adds to a header block at most:
// its name, the longest value (seconds to year 9999) and the separators.
const ttlHeaderRoom = len(HeaderTTL) + len("253402300800s") + 4

// MaxStreamNameBytes is the longest stream name JetStream accepts.
const MaxStreamNameBytes = 255

// MaxSubjectBytes bounds a subject. NATS itself only fails at its control
// line limit (4 KiB by default), and then by closing the client's connection
// ("maximum control line exceeded"): one such row would cut the relay off
// the broker on every retry. 256 bytes leaves room below any server setting.
const MaxSubjectBytes = 256

// ErrReservedSubject marks a subject in the server's own namespaces.
var ErrReservedSubject = errors.New("reserved subject")

// ValidateSubject applies NATS's rules for a publish subject: dot-separated
// non-empty tokens, no whitespace or control characters, no wildcards, at
// most MaxSubjectBytes. It also refuses the server's own namespaces: a
// subject starting with '$' ($JS.API, $SYS, $KV, ...) is a request to the
// server (a row with '$JS.API.STREAM.DELETE.OUTBOX' deleted the relay's
// stream), and _INBOX.* are replies another client waits for.
func ValidateSubject(s string) error {
	if s == "" {
		return errors.New("empty subject")
	}
	if len(s) > MaxSubjectBytes {
		return fmt.Errorf("subject %.40q... is %d bytes, over the %d-byte limit (a subject longer than the broker's control line closes the connection)", s, len(s), MaxSubjectBytes)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c == 0x7f {
			return fmt.Errorf("subject %q contains whitespace or a control character", s)
		}
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("subject %q is not valid UTF-8", s)
	}
	first, _, _ := strings.Cut(s, ".")
	if strings.HasPrefix(first, "$") || first == "_INBOX" {
		return fmt.Errorf("%w: subject %q is in the NATS server's own namespace ($... is the server's API, _INBOX.... are replies another client waits for): a row may only publish into a stream", ErrReservedSubject, s)
	}
	for tok := range strings.SplitSeq(s, ".") {
		switch tok {
		case "":
			return fmt.Errorf("subject %q has an empty token (a leading, trailing or doubled dot)", s)
		case "*", ">":
			return fmt.Errorf("subject %q contains a wildcard (* or >); publish to a concrete subject", s)
		}
	}
	return nil
}

// ValidateHeader checks one of a row's own headers: a name the NATS client
// accepts (printable ASCII without separators), one the relay does not
// reserve, and a value that arrives as written (see headerText).
func ValidateHeader(name, value string) error {
	if !validHeaderName(name) {
		return fmt.Errorf("header name %q: names must be 1 to 256 printable ASCII characters without spaces or any of %s", name, headerNameForbidden)
	}
	if err := headerText(value, true); err != nil {
		return fmt.Errorf("header %q: its value %.60q %v, so it would not arrive as written", name, value, err)
	}
	// Nats-* headers steer JetStream itself (expected sequence, rollup,
	// message ID) and Outbox-* are the relay's; a row must set neither.
	lower := strings.ToLower(name)
	if strings.HasPrefix(lower, "nats-") || strings.HasPrefix(lower, "outbox-") {
		return fmt.Errorf("header %q: Nats-* and Outbox-* headers are reserved for the broker and the relay; choose another name", name)
	}
	return nil
}

// headerNameForbidden are the printable characters the NATS client refuses
// in a header name (nats.go's isHeaderKeyValid); past that, names are ASCII
// 33 to 126.
const headerNameForbidden = `"()/,:;<=>?@[\]{}`

func validHeaderName(name string) bool {
	if name == "" || len(name) > 256 {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c < 33 || c > 126 || strings.IndexByte(headerNameForbidden, c) >= 0 {
			return false
		}
	}
	return true
}
