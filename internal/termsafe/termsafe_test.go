package termsafe

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestString(t *testing.T) {
	cases := []struct{ in, want string }{
		// Ordinary text is left alone.
		{"order-42", "order-42"},
		{"", ""},
		{"rejected: max_payload: 2 MB over", "rejected: max_payload: 2 MB over"},
		{"Bestellung für Jürgen ✓ 注文", "Bestellung für Jürgen ✓ 注文"},
		{`mid "quote"`, `mid "quote"`},
		// Anything that can move the cursor, erase or forge a line is quoted.
		{"x\r\nredrove 0 rows; all good\x1b[2K", `"x\r\nredrove 0 rows; all good\x1b[2K"`},
		{"a\nb", `"a\nb"`},
		{"tab\there", `"tab\there"`},
		{"bell\a", `"bell\a"`},
		{"\u009b2K", `"\u009b2K"`}, // C1 CSI, as a valid UTF-8 rune
		{"\x9b2K", `"\x9b2K"`},     // C1 CSI as a raw byte: invalid UTF-8
		{"del\x7f", `"del\x7f"`},   // DEL
		{"bad\xffutf8", `"bad\xffutf8"`},
		// Bidi and format characters reorder or hide text.
		{"evil\u202etxt.exe", `"evil\u202etxt.exe"`},
		{"iso\u2066late", `"iso\u2066late"`},
		{"zero\u200bwidth", `"zero\u200bwidth"`},
		{"bom\ufeff", `"bom\ufeff"`},
		{"line\u2028sep", `"line\u2028sep"`},
		// Leading quote: quoted, so quotes on screen always mean escaped.
		{`"x\r\n"`, `"\"x\\r\\n\""`},
	}
	for _, c := range cases {
		if got := String(c.in); got != c.want {
			t.Errorf("String(%q) = %s, want %s", c.in, got, c.want)
		}
		if got := String(c.in); strings.ContainsAny(got, "\x1b\r\n\u202e\u2066\u200b\x7f") {
			t.Errorf("String(%q) = %q still holds a raw control or format character", c.in, got)
		}
	}
}

// JSON output (status --json) needs no String: encoding/json escapes
// control characters and replaces invalid UTF-8. It does not escape bidi
// characters, which is acceptable for machine output but is why human
// output must go through String.
func TestJSONEscapesControls(t *testing.T) {
	b, err := json.Marshal(map[string]string{"x\r\n\x1b[2K": "y\r\n\x1b[2K\xff"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.ContainsAny(string(b), "\x1b\r\n\xff") {
		t.Errorf("json output %q holds raw control bytes", b)
	}
}
