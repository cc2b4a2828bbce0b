// Package wiretest generates hostile row fields for property tests of the
// row -> message path: strings biased towards what breaks headers and
// subjects (control characters, edge whitespace, the server's namespaces,
// oversized values), next to ordinary ones. Used by tests only.
package wiretest

import (
	"math/rand/v2"
	"strings"
)

// pieces are the fragments hostile values are built from.
var pieces = []string{
	"col-x", "order-103", "a", "Z", "0", "-", "_", ".", "..", "*", ">", " ", "  ", "\t", "\r", "\n", "\r\n",
	"\x00", "\x01", "\x1b[2K", "\x7f", "\u0085", "\u00a0", "\u200b", "\u202e", "\ufeff", "ü", "日本", "😀",
	"$", "$JS.API.STREAM.DELETE.OUTBOX", "$JS.API.STREAM.PURGE.VICTIM", "$SYS.REQ", "$KV.b.k", "_INBOX.", "_INBOX",
	"outbox.", "nats-msg-id", "Nats-Msg-Id", "Outbox-Kind", ":", "\"", "(", "/", "\\", "@", "{", "=", ";", ",",
	"%zz", "#", "'", "--", "'; DROP TABLE outbox; --",
}

// String returns a random string of up to about max bytes: usually a few
// pieces, sometimes one piece repeated past a limit.
func String(r *rand.Rand, max int) string {
	var b strings.Builder
	switch r.IntN(10) {
	case 0:
		// Long: around a limit.
		p := pieces[r.IntN(3)]
		for b.Len() < max-len(p) {
			b.WriteString(p)
		}
	case 1:
		// Random bytes in printable ASCII and controls.
		for range 1 + r.IntN(12) {
			b.WriteByte(byte(r.IntN(128)))
		}
	default:
		for range 1 + r.IntN(5) {
			b.WriteString(pieces[r.IntN(len(pieces))])
		}
	}
	s := b.String()
	if len(s) > max {
		s = s[:max]
	}
	return strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "?")
}
