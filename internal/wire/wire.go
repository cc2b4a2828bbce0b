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
)

// Header names of the message format (DESIGN.md, "The message").
const (
	HeaderMsgID           = "Nats-Msg-Id"
	HeaderKind            = "Outbox-Kind"
	HeaderCommitLSN       = "Outbox-Commit-LSN"
	HeaderCommitTime      = "Outbox-Commit-Time"
	HeaderAttempt         = "Outbox-Attempt"
	HeaderClaimGeneration = "Outbox-Claim-Generation"
)

// MaxSubjectBytes bounds a subject. NATS itself only fails at its control
// line limit (4 KiB by default), and then by closing the client's connection
// ("maximum control line exceeded"): one such row would cut the relay off
// the broker on every retry. 256 bytes leaves room below any server setting.
const MaxSubjectBytes = 256

// ValidateSubject applies NATS's rules for a publish subject: dot-separated
// non-empty tokens, no whitespace, no wildcards, at most MaxSubjectBytes.
func ValidateSubject(s string) error {
	if s == "" {
		return errors.New("empty subject")
	}
	if len(s) > MaxSubjectBytes {
		return fmt.Errorf("subject %.40q... is %d bytes, over the %d-byte limit (a subject longer than the broker's control line closes the connection)", s, len(s), MaxSubjectBytes)
	}
	if strings.ContainsAny(s, " \t\r\n") {
		return fmt.Errorf("subject %q contains whitespace", s)
	}
	for _, tok := range strings.Split(s, ".") {
		switch tok {
		case "":
			return fmt.Errorf("subject %q has an empty token (a leading, trailing or doubled dot)", s)
		case "*", ">":
			return fmt.Errorf("subject %q contains a wildcard (* or >); publish to a concrete subject", s)
		}
	}
	return nil
}

// ValidateHeader checks one of a row's own headers: a name NATS can carry and
// the relay does not reserve, and a value without line breaks.
func ValidateHeader(name, value string) error {
	if name == "" || strings.ContainsAny(name, ": \t\r\n") {
		return fmt.Errorf("header name %q: names may not be empty or hold ':' or whitespace", name)
	}
	if strings.ContainsAny(value, "\r\n") {
		return fmt.Errorf("header %q: values may not hold line breaks", name)
	}
	// Nats-* headers steer JetStream itself (expected sequence, rollup,
	// message ID) and Outbox-* are the relay's; a row must set neither.
	lower := strings.ToLower(name)
	if strings.HasPrefix(lower, "nats-") || strings.HasPrefix(lower, "outbox-") {
		return fmt.Errorf("header %q: Nats-* and Outbox-* headers are reserved for the broker and the relay; choose another name", name)
	}
	return nil
}
