package main

import (
	"strings"
	"testing"
	"time"
)

// Ages beyond time.Duration's range used to wrap round (213504d became
// 25m26s); they are refused, naming the flag and the largest accepted age.
func TestParseAgeRefusesOverflow(t *testing.T) {
	const largest = "106751d (2562047h)"
	good := []struct {
		in   string
		want time.Duration
	}{
		{"7d", 7 * 24 * time.Hour},
		{"+7d", 7 * 24 * time.Hour},
		{"1d", 24 * time.Hour},
		{"168h", 168 * time.Hour},
		{"90m", 90 * time.Minute},
		{"1h30m", 90 * time.Minute},
		{"1.5h", 90 * time.Minute},
		{"106751d", 106751 * 24 * time.Hour},
		{"2562047h", 2562047 * time.Hour},
	}
	for _, c := range good {
		got, err := parseAge("older-than", c.in)
		if err != nil || got != c.want {
			t.Errorf("parseAge(%q) = %s, %v; want %s", c.in, got, err, c.want)
		}
	}
	bad := []struct{ in, want string }{
		{"213504d", largest},
		{"106752d", largest},
		{"9999999999999d", largest},
		{"99999999999999999999d", largest}, // beyond int64 itself
		{"2562048h", largest},
		{"9999999999h", largest},
		{"99999999999999999999h", largest},
		{"2562047h48m", largest},
		{"106751d1h", "want an age like 168h or 7d"}, // days take no other unit
		{"0d", "want a positive age"},
		{"0", "want a positive age"},
		{"0s", "want a positive age"},
		{"-1h", "want a positive age"},
		{"-7d", "want a positive age"},
		{"-9999999999999d", "want a positive age"},
		{"-9999999999h", "want a positive age"},
		{"1.5d", "want whole days like 7d"},
		{"d", "want whole days like 7d"},
		{"soon", "want an age like 168h or 7d"},
		{"7", "want an age like 168h or 7d"},
		{"", "want an age like 168h or 7d"},
	}
	for _, c := range bad {
		got, err := parseAge("older-than", c.in)
		if err == nil {
			t.Errorf("parseAge(%q) = %s, want an error", c.in, got)
			continue
		}
		if !strings.Contains(err.Error(), "--older-than") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("parseAge(%q): %q does not name --older-than and %q", c.in, err, c.want)
		}
	}
}

// --since reads times and ages; an age it cannot hold is refused the same
// way, not misread as a time.
func TestParseSince(t *testing.T) {
	if _, ago, err := parseSince("7d"); err != nil || ago != 7*24*time.Hour {
		t.Errorf("7d = %s, %v", ago, err)
	}
	if at, ago, err := parseSince("2024-05-01T00:00:00Z"); err != nil || ago != 0 || !at.Equal(time.Date(2024, 5, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("RFC3339 = %s, %s, %v", at, ago, err)
	}
	for in, want := range map[string]string{
		"213504d":        "--since \"213504d\": too large; the largest accepted age is 106751d (2562047h)",
		"106752d":        "largest accepted age is 106751d",
		"9999999999999d": "largest accepted age is 106751d",
		"9999999999h":    "largest accepted age is 106751d",
		"-1h":            "--since \"-1h\": want a positive age",
		"0d":             "want a positive age",
		"yesterday":      "--since \"yesterday\": want an age like 24h or 7d, or an RFC3339 time",
	} {
		if _, ago, err := parseSince(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseSince(%q) = %s, %v; want an error containing %q", in, ago, err, want)
		}
	}
}
