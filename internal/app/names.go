package app

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// maxStreamName is nats-server's JSMaxNameLen: the longest stream name it
// accepts.
const maxStreamName = 255

// ValidateStream checks a --stream value against the rules nats-server
// (v2.15) applies when the stream is created or looked up: not empty, at most
// 255 bytes, no whitespace, '.', '*', '>' (the name is a token of the
// $JS.API subjects) and no '/' or '\' (it is a directory on the server's
// disk). The server refuses such a name on every request, and the relay
// would retry that forever instead of saying what is wrong. Control and
// other non-printing characters are refused too: nothing good comes of
// them in a subject or a log line. Every command that takes --stream checks
// it before it connects.
func ValidateStream(name string) error { return validateStreamName("--stream", name) }

func validateStreamName(flag, name string) error {
	bad := func(why string) error {
		return fmt.Errorf("%s %q: %s; a JetStream stream name is 1 to %d bytes without whitespace, '.', '*', '>', '/', '\\' or control characters, e.g. OUTBOX",
			flag, name, why, maxStreamName)
	}
	switch {
	case name == "":
		return bad("empty")
	case len(name) > maxStreamName:
		return bad(fmt.Sprintf("%d bytes long", len(name)))
	case !utf8.ValidString(name):
		return bad("not valid UTF-8")
	}
	for _, r := range name {
		switch {
		case unicode.IsSpace(r):
			return bad("holds whitespace")
		case strings.ContainsRune(".*>", r):
			return bad(fmt.Sprintf("holds %q, which the server reads as a subject token separator or wildcard", r))
		case r == '/' || r == '\\':
			return bad(fmt.Sprintf("holds the path separator %q", r))
		case !unicode.IsPrint(r):
			return bad(fmt.Sprintf("holds the non-printing character %U", r))
		}
	}
	return nil
}

// checkReservedPrefix refuses a --subject-prefix in a namespace the server
// uses itself. The relay's stream binds <prefix>>, so it would capture (and
// store, and answer for) that traffic: with $JS. the JetStream API, $SYS.
// the system account, $KV. every key-value bucket; with _INBOX. every reply
// to a request on the account, breaking request/reply for all its clients.
func checkReservedPrefix(prefix string) error {
	first, _, _ := strings.Cut(prefix, ".")
	switch {
	case strings.HasPrefix(prefix, "$"):
		return fmt.Errorf("--subject-prefix %q: subjects starting with '$' are reserved for the server ($JS, $SYS, $KV, ...), and the relay's stream would capture its API traffic; choose a prefix of your own, e.g. outbox.", prefix)
	case first == "_INBOX":
		return fmt.Errorf("--subject-prefix %q: _INBOX is where request replies go, and the relay's stream would capture every reply on the account; choose a prefix of your own, e.g. outbox.", prefix)
	}
	return nil
}
