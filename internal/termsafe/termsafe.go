// Package termsafe makes untrusted text safe to print to an operator's
// terminal. Row data (work_id, kind, last_error, ...) is written by
// producers, not by the operator reading it: printed raw, a carriage return,
// a line feed or an escape sequence in it can erase or overwrite what the
// relay printed and forge lines of its own ("redrove 0 rows; all good"), and
// bidi controls can reorder what is shown.
package termsafe

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// String returns s unchanged when every rune is printable text, and
// otherwise strconv.Quote(s): a double-quoted Go string in which control
// characters (ESC, CR, LF, ...), Unicode format and bidi characters
// (U+202E, U+2066, zero-width ones, ...), other non-printing runes and
// invalid UTF-8 appear as escapes (\x1b, \r, \u202e, \xff). Printable
// non-ASCII text stays readable.
//
// A string that starts with a double quote is quoted too, so that output
// in quotes always means "escaped": a producer cannot make plain text look
// like the escaped form of something else.
func String(s string) string {
	if Safe(s) {
		return s
	}
	return strconv.Quote(s)
}

// Safe reports whether String would print s unchanged.
func Safe(s string) bool {
	if strings.HasPrefix(s, `"`) || !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		// unicode.IsPrint admits letters, marks, numbers, punctuation,
		// symbols and the ASCII space only: it excludes controls (Cc),
		// format characters including every bidi control (Cf), line and
		// paragraph separators, private use and unassigned code points.
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// Strings applies String to each element, for lists.
func Strings(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = String(s)
	}
	return out
}
