package main

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// The largest ages a time.Duration holds (about 292 years), in the units
// the messages suggest. A larger age must be refused, not converted: the
// multiplication wraps round, and `prune --older-than 213504d` became 25m26s,
// which would have deleted rows published minutes ago.
const (
	maxAgeDays  = math.MaxInt64 / int64(24*time.Hour)
	maxAgeHours = math.MaxInt64 / int64(time.Hour)
)

// ageSyntaxError is a value that is not written as an age at all, so that
// --since can go on to read it as a time.
type ageSyntaxError struct{ error }

// durationSyntax is time.ParseDuration's grammar. A value that matches it
// but does not parse overflowed: ParseDuration reports both the same way.
var durationSyntax = regexp.MustCompile(`^[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:ns|us|µs|μs|ms|s|m|h))+$`)

// parseAge reads the age of --flag: a Go duration (168h, 90m) or whole days
// (7d), the unit retention is usually thought in. Every caller subtracts the
// age from now to select rows, so zero and negative ages are refused as
// meaningless, and ages beyond time.Duration's range as too large.
func parseAge(flag, s string) (time.Duration, error) {
	positive := fmt.Errorf("--%s %q: want a positive age like 168h or 7d", flag, s)
	tooLarge := fmt.Errorf("--%s %q: too large; the largest accepted age is %dd (%dh)", flag, s, maxAgeDays, maxAgeHours)
	negative := strings.HasPrefix(s, "-")
	if n, ok := strings.CutSuffix(s, "d"); ok {
		days, err := strconv.ParseInt(n, 10, 64)
		switch {
		case err != nil && !errors.Is(err, strconv.ErrRange):
			return 0, ageSyntaxError{fmt.Errorf("--%s %q: want whole days like 7d", flag, s)}
		case negative || days == 0:
			return 0, positive
		case err != nil || days > maxAgeDays:
			return 0, tooLarge
		}
		return time.Duration(days) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(s)
	switch {
	case err != nil && !durationSyntax.MatchString(s):
		return 0, ageSyntaxError{fmt.Errorf("--%s %q: want an age like 168h or 7d", flag, s)}
	case negative || (err == nil && d == 0):
		return 0, positive
	case err != nil:
		return 0, tooLarge
	}
	return d, nil
}
