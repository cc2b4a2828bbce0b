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

// wide are multi-byte characters of each UTF-8 width: a rule that counts
// characters instead of bytes, or that cuts a value inside a character,
// differs from a byte rule only with them at the limit.
var wide = []string{"ü", "日", "😀"}

// AtLimit returns the values a rule bounded at limit bytes must be checked
// at: the empty string and values of exactly limit-1, limit and limit+1
// bytes, in ASCII, made mostly of multi-byte characters (far fewer
// characters than bytes), and ending in a multi-byte character that ends
// at the limit or straddles it. Every value is valid UTF-8 and otherwise
// harmless (no control characters, no edge spaces), so only its length
// decides; none repeats.
func AtLimit(limit int) []string {
	seen := map[string]bool{}
	var out []string
	add := func(s string) {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	add("")
	for n := limit - 1; n <= limit+1; n++ {
		add(strings.Repeat("a", n))
		for _, w := range wide {
			// Mostly wide characters, padded with ASCII in front to n bytes.
			add(strings.Repeat("b", n%len(w)) + strings.Repeat(w, n/len(w)))
		}
	}
	for _, w := range wide {
		// The wide character's last byte at limit-1 .. limit+len(w)-1: it
		// ends below, at, or straddles the limit by 1 to len(w)-1 bytes.
		for end := limit - 1; end < limit+len(w); end++ {
			add(strings.Repeat("c", end+1-len(w)) + w)
		}
	}
	return out
}

// Near returns a random value of exactly limit-1, limit or limit+1 bytes
// built from the hostile pieces (so some of them are refused for their
// content too), or the empty string.
func Near(r *rand.Rand, limit int) string {
	if r.IntN(20) == 0 {
		return ""
	}
	n := limit - 1 + r.IntN(3)
	var b strings.Builder
	for {
		p := pieces[r.IntN(len(pieces))]
		if p == "\x00" {
			continue // PostgreSQL's text cannot hold it
		}
		if b.Len()+len(p) > n {
			break
		}
		b.WriteString(p)
	}
	for b.Len() < n {
		b.WriteByte('x')
	}
	return b.String()
}
