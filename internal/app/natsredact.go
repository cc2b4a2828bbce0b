package app

import (
	"errors"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// redacted stands in for a secret, as in the database URL's redaction.
const redacted = "xxxxx"

// RedactNATSURLs hides the credentials of every URL in a comma-separated
// --nats-url list: a password (user:xxxxx@host) or a token in the user
// position (xxxxx@host), which nats.go's ConnectedUrlRedacted leaves visible.
// It never relies on url.Parse: the input may be exactly what url.Parse
// rejects (a bare %, '#', spaces, a bad port), and a leak is worse than a
// redaction too many, so everything before the last '@' of an entry counts
// as userinfo, with or without a scheme.
func RedactNATSURLs(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		parts[i] = redactNATSURL(p)
	}
	return strings.Join(parts, ",")
}

func redactNATSURL(p string) string {
	prefix, info, rest, ok := splitUserinfo(p)
	if !ok {
		return p
	}
	if user, _, hasPass := strings.Cut(info, ":"); hasPass {
		return prefix + user + ":" + redacted + rest
	}
	return prefix + redacted + rest
}

// splitUserinfo cuts one URL (or a schemeless host spec) into what precedes
// its userinfo (scheme and "://", and any leading space), the userinfo, and
// the rest from '@' on. ok is false when there is no '@' or nothing before
// it.
func splitUserinfo(p string) (prefix, info, rest string, ok bool) {
	start := 0
	if i := strings.Index(p, "://"); i >= 0 {
		start = i + len("://")
	} else {
		start = len(p) - len(strings.TrimLeft(p, " \t"))
	}
	at := strings.LastIndex(p[start:], "@")
	if at <= 0 {
		return "", "", "", false
	}
	return p[:start], p[start : start+at], p[start+at:], true
}

// NATSScrubber removes NATS credentials from text bound for a log line, an
// error message or a command's output. nats.go's and net/url's errors can
// quote the URL they failed on in full, or in pieces (`invalid port ":pa"
// after host` when a '#' cut a password short), so a redacted URL alone is
// not enough: every configured secret and every quoted piece of a userinfo
// is replaced as well.
type NATSScrubber struct {
	urls      []string // the entries of --nats-url that carry userinfo
	secrets   []string // longest first, so a secret holding another is replaced whole
	pieces    []string // of the secrets, between the characters a URL parser cuts at
	userinfos []string
}

// NewNATSScrubber collects the secrets of a --nats-url list and of the
// --nats-password and --nats-token flags.
func NewNATSScrubber(urls string, auth NATSAuth) *NATSScrubber {
	s := &NATSScrubber{}
	seen := map[string]bool{}
	addSecret := func(v string) {
		if v == "" || seen[v] {
			return
		}
		seen[v] = true
		s.secrets = append(s.secrets, v)
	}
	// A secret can reach a message as written, decoded (nats.go sends and
	// may print the decoded form) or re-encoded by url.URL.String.
	addForms := func(v string, encode func(string) string) {
		addSecret(v)
		if dec, err := url.PathUnescape(v); err == nil {
			addSecret(dec)
			addSecret(encode(dec))
		}
	}
	for _, p := range strings.Split(urls, ",") {
		p = strings.TrimSpace(p)
		_, info, _, ok := splitUserinfo(p)
		if !ok {
			continue
		}
		s.urls = append(s.urls, p)
		s.userinfos = append(s.userinfos, info)
		if dec, err := url.PathUnescape(info); err == nil && dec != info {
			s.userinfos = append(s.userinfos, dec)
		}
		if _, pass, hasPass := strings.Cut(info, ":"); hasPass {
			addForms(pass, func(v string) string { return strings.TrimPrefix(url.UserPassword("", v).String(), ":") })
		} else {
			addForms(info, func(v string) string { return url.User(v).String() })
		}
	}
	addSecret(auth.Password)
	addSecret(auth.Token)
	sort.SliceStable(s.secrets, func(i, j int) bool { return len(s.secrets[i]) > len(s.secrets[j]) })
	// url.Parse cuts a malformed userinfo at a '#', '?', '/' or '@' and then
	// reports, or dials, what is left: "nats://relay:pass" of
	// "nats://relay:pass#word@host", or a host named "pass". Those pieces
	// of a secret are hidden too, where they stand as a word of their own.
	for _, v := range s.secrets {
		ps := strings.FieldsFunc(v, func(r rune) bool { return !isUnreserved(r) })
		if len(ps) < 2 {
			continue
		}
		for _, p := range ps {
			if !seen[p] {
				seen[p] = true
				s.pieces = append(s.pieces, p)
			}
		}
	}
	sort.SliceStable(s.pieces, func(i, j int) bool { return len(s.pieces[i]) > len(s.pieces[j]) })
	// Whole entries first: their redacted form keeps the host readable.
	sort.SliceStable(s.urls, func(i, j int) bool { return len(s.urls[i]) > len(s.urls[j]) })
	return s
}

var quoted = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

// Scrub returns text with every NATS secret replaced by xxxxx.
func (s *NATSScrubber) Scrub(text string) string {
	if s == nil {
		return text
	}
	for _, u := range s.urls {
		text = strings.ReplaceAll(text, u, redactNATSURL(u))
	}
	for _, v := range s.secrets {
		text = strings.ReplaceAll(text, v, redacted)
	}
	for _, p := range s.pieces {
		text = replaceWord(text, p)
	}
	if len(s.userinfos) == 0 {
		return text
	}
	return quoted.ReplaceAllStringFunc(text, func(q string) string {
		inner, err := strconv.Unquote(q)
		if err != nil {
			inner = q[1 : len(q)-1]
		}
		if inner == "" || inner == redacted {
			return q
		}
		for _, info := range s.userinfos {
			if strings.Contains(info, inner) {
				return `"` + redacted + `"`
			}
		}
		return q
	})
}

// Err returns err with its message scrubbed. The result still matches the
// sentinel errors err wraps (errors.Is), so callers can tell
// nats.ErrNoServers or nats.ErrAuthorization apart, but it does not unwrap
// to the original: whoever prints an unwrapped error would print the
// secret.
func (s *NATSScrubber) Err(err error) error {
	if err == nil {
		return nil
	}
	msg := s.Scrub(err.Error())
	if msg == err.Error() {
		return err
	}
	return &scrubbedError{msg: msg, orig: err}
}

type scrubbedError struct {
	msg  string
	orig error
}

func (e *scrubbedError) Error() string { return e.msg }

func (e *scrubbedError) Is(target error) bool { return errors.Is(e.orig, target) }

// isUnreserved reports the characters a URL carries unescaped anywhere
// (RFC 3986), around which no parser splits.
func isUnreserved(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' || r == '~'
}

func isAlnum(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9'
}

// replaceWord replaces w in text where it is not part of a longer word, so
// that a short piece of a secret ("pa") hides itself without rewriting every
// word that holds it ("parse").
func replaceWord(text, w string) string {
	var b strings.Builder
	for {
		i := strings.Index(text, w)
		if i < 0 {
			b.WriteString(text)
			return b.String()
		}
		end := i + len(w)
		if (i == 0 || !isAlnum(text[i-1])) && (end == len(text) || !isAlnum(text[end])) {
			b.WriteString(text[:i])
			b.WriteString(redacted)
		} else {
			b.WriteString(text[:end])
		}
		text = text[end:]
	}
}
