package app

import (
	"errors"
	"net/url"
	"strings"
)

// redactURL hides the password of every URL in a comma-separated list, for
// messages and logs.
func redactURL(s string) string {
	parts := strings.Split(s, ",")
	for i, p := range parts {
		u, err := url.Parse(strings.TrimSpace(p))
		if err != nil || u.User == nil {
			continue
		}
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		}
		parts[i] = u.String()
	}
	return strings.Join(parts, ",")
}

// redactErr removes a connection string's password from an error message
// (pgx's parse errors can quote the input).
func redactErr(err error, connString string) error {
	msg := err.Error()
	changed := false
	if u, perr := url.Parse(connString); perr == nil && u.User != nil {
		if pw, ok := u.User.Password(); ok && pw != "" && strings.Contains(msg, pw) {
			msg = strings.ReplaceAll(msg, pw, "xxxxx")
			changed = true
		}
	}
	if i := strings.Index(connString, "password="); i >= 0 {
		pw := strings.Fields(connString[i+len("password="):])
		if len(pw) > 0 && pw[0] != "" && strings.Contains(msg, pw[0]) {
			msg = strings.ReplaceAll(msg, pw[0], "xxxxx")
			changed = true
		}
	}
	if !changed {
		return err
	}
	return errors.New(msg)
}
